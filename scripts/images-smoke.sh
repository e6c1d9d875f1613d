#!/usr/bin/env bash
# Build the images (scripts/build-images.sh, with the training image), then run every daemon from the
# daemon image in the netns cluster and the training library in the training image (tests/images,
# pytest marker "images"). Root, as the build and the cluster need. Extra arguments go to pytest.
#
#   scripts/images-smoke.sh              # build, then test
#   IMAGES_BUILT=1 scripts/images-smoke.sh   # test what build/images/oci holds already
#
# Too slow for the main CI run (the build alone takes 1-3 minutes): the scheduled job (.ci/scheduled)
# runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ "${IMAGES_BUILT:-0}" = 1 ] || bash scripts/build-images.sh --training
command -v crun >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq crun) >/dev/null
export TIERCKPT_IMAGE_LAYOUT=$PWD/build/images/oci
set +e
.venv/bin/python -m pytest -p no:cacheprovider -m images tests/images "$@"
rc=$?
set -e
[ $rc -eq 5 ] && { echo "images-smoke: no test ran"; exit 1; }
exit $rc
