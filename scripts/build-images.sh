#!/usr/bin/env bash
# Build the tierckpt OCI images on this machine, from Debian's packages and PyPI alone (no registry is
# pulled from): mmdebstrap makes a minimal Debian root filesystem, the images' Python packages are
# installed from their locks (images/*.lock, with hashes), and umoci writes an OCI image layout.
#
#   scripts/build-images.sh              # the daemon image: tierckpt-replicator, -operator, -csi and the CLI
#   scripts/build-images.sh --training   # and the optional training image (torch + tierckpt[torch])
#   scripts/build-images.sh --relock-debian   # let apt choose Debian's current versions, rewrite the lock
#
# Output, under build/images/ (ignored by git):
#   oci/                      one OCI image layout holding both images, tagged tierckpt-<version> and
#                             tierckpt-training-<version>; push with skopeo (docs/install.md)
#   <image>.json              its size, layers and package counts (docs/benchmarks.md quotes them)
#
# Pinned: the Python packages by images/*.lock (scripts/lock-images.py), the Debian packages by
# images/debian.lock (every package of the root filesystem at one version; a version Debian has since
# replaced fails the build: rebuild with --relock-debian and commit the lock), the suite (bookworm).
# Run as root (mmdebstrap, chroot); the tools are installed with apt-get when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

TRAINING=0
RELOCK=0
for arg in "$@"; do
  case $arg in
    --training) TRAINING=1 ;;
    --relock-debian) RELOCK=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-images: unknown argument $arg" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "build-images: run as root (mmdebstrap and chroot need it)" >&2; exit 1; }

need=()
for tool in mmdebstrap:mmdebstrap umoci:umoci; do
  command -v "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "build-images: installing ${need[*]}" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") >/dev/null
fi

PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3
VERSION=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
CREATED=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# The roots of the root filesystem: Python (3.11, as the locks), the C++ runtime that manylinux wheels
# expect of the system (grpcio) and /etc/services; apt adds their dependencies. No shell, no package manager's front end, no compiler: nothing runs in the images but
# the Python interpreter and the code it loads. (debconf only for libc6's maintainer scripts: it goes
# again, with dpkg and tar, once the packages are installed.)
DEBIAN_ROOTS=(python3.11-minimal libpython3.11-stdlib libstdc++6 netbase debconf)
BUILD_ONLY=(debconf dpkg tar)

OUT=$REPO/build/images
WORK=$OUT/work
LAYOUT=$OUT/oci
rm -rf "$WORK" "$LAYOUT"
mkdir -p "$WORK/wheels"
start=$(date +%s)

log() { echo "build-images: $* ($(($(date +%s) - start)) s)" >&2; }

# --------------------------------------------------------------------------------------- wheels
# The tierckpt wheel is built from a copy of the sources, so the checkout stays as it is.
mkdir -p "$WORK/src"
cp -a pyproject.toml README.md client cli demo replicator csi operator "$WORK/src/"
find "$WORK/src" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/wheels" "$WORK/src" 2>&1 |
  grep -v "is ignored: it is neither" >&2 || true
WHEEL=$(basename "$WORK"/wheels/tierckpt-"$VERSION"-*.whl)
locks=(images/daemon.lock)
[ $TRAINING = 1 ] && locks+=(images/training-torch.lock images/training.lock)
for lock in "${locks[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --require-hashes -r "$lock" -d "$WORK/wheels" 2>&1 |
    grep -v "is ignored: it is neither" >&2 || true
  cp "$lock" "$WORK/wheels/"
done
# pip runs from its wheel inside the root filesystem and is never installed there
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WORK/pip" pip 2>&1 | grep -v "is ignored" >&2 || true
PIP_WHEEL=$(ls "$WORK"/pip/pip-*.whl)
log "wheels ready"

# ----------------------------------------------------------------------------- Debian rootfs
if [ $RELOCK = 1 ] || [ ! -f images/debian.lock ]; then
  include=$(IFS=,; echo "${DEBIAN_ROOTS[*]}")
else
  include=$(grep -v '^#' images/debian.lock | paste -sd, -)
fi
mmdebstrap --quiet --variant=custom --mode=chrootless --include="$include" \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  "$SUITE" "$WORK/debian" "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" \
  "deb $SECURITY $SUITE-security main"
installed=$(dpkg-query --admindir="$WORK/debian/var/lib/dpkg" -W -f='${Package}=${Version}\n' | sort)
if [ $RELOCK = 1 ] || [ ! -f images/debian.lock ]; then
  { echo "# The Debian packages of the images' root filesystem (scripts/build-images.sh --relock-debian)."
    echo "# Roots: ${DEBIAN_ROOTS[*]}; suite $SUITE with its updates and security fixes."
    echo "$installed"; } >images/debian.lock
  log "wrote images/debian.lock"
elif [ "$installed" != "$(grep -v '^#' images/debian.lock)" ]; then
  echo "build-images: the root filesystem differs from images/debian.lock:" >&2
  diff <(grep -v '^#' images/debian.lock) <(echo "$installed") >&2 || true
  exit 1
fi
root=$WORK/debian
# No package manager in the image; dpkg's database stays, for scanners to read.
if ! out=$(dpkg --root="$root" --force-script-chrootless --force-remove-essential --force-depends \
  --purge "${BUILD_ONLY[@]}" 2>&1); then
  echo "$out" >&2
  exit 1
fi
rm -rf "$root"/var/cache/* "$root"/var/log/* "$root"/var/lib/apt "$root"/etc/apt "$root"/etc/dpkg
# The users the images run as: root (the CSI plugin, the replicator) and nonroot (65532, the default).
cat >"$root/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/usr/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/usr/sbin/nologin
PASSWD
cat >"$root/etc/group" <<'GROUP'
root:x:0:
nonroot:x:65532:
GROUP
install -d -m 0700 "$root/root"
install -d -m 0755 -o 65532 -g 65532 "$root/home/nonroot"
install -d -m 1777 "$root/tmp"
install -d -m 0755 "$root/proc" "$root/dev" "$root/sys"
log "Debian root filesystem ready ($(grep -vc '^#' images/debian.lock) packages)"

# -------------------------------------------------------------------------------- Python layers
# install_layer ROOTFS VENV COMPILE LOCK [WHEEL]: the packages of LOCK (and WHEEL) into the virtualenv
# VENV of ROOTFS, with ROOTFS's own Python, from the downloaded wheels only. Debug information is
# stripped from the shared objects (uvloop's alone is 12 MB of it). COMPILE=1 byte-compiles (the
# images are read-only at run time): worth it for torch, not for the daemons, whose imports take
# 0.1-0.3 s longer without (measured), against 80 MB of .pyc files.
install_layer() {
  local rootfs=$1 venv=$2 compile=$3 lock=$4 wheel=${5:-}
  [ -x "$rootfs$venv/bin/python" ] || chroot "$rootfs" /usr/bin/python3.11 -m venv --without-pip "$venv"
  mkdir -p "$rootfs/tmp/build"
  unshare --mount --propagation private bash -euo pipefail -c '
    rootfs=$1; venv=$2; lock=$3; wheel=$4; wheels=$5; pip=$6
    mount --bind "$wheels" "$rootfs/tmp/build"
    mount --bind /dev "$rootfs/dev"
    mount -t proc proc "$rootfs/proc"
    run_pip() {
      env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot "$rootfs" "$venv/bin/python" "/tmp/build/$pip/pip" \
        install --quiet --no-index --no-cache-dir --no-deps --no-compile --find-links /tmp/build \
        --disable-pip-version-check "$@"
    }
    run_pip --require-hashes -r "/tmp/build/$(basename "$lock")"
    [ -z "$wheel" ] || run_pip "/tmp/build/$wheel"
  ' _ "$rootfs" "$venv" "$lock" "$wheel" "$WORK/wheels" "$(basename "$PIP_WHEEL")"
  rmdir "$rootfs/tmp/build"
  rm -f "$rootfs$venv"/bin/activate* "$rootfs$venv"/bin/Activate.ps1
  find "$rootfs$venv" -name '*.so*' -type f -exec strip --strip-debug {} +
  # every shared object finds its libraries in the image
  local missing
  missing=$(find "$rootfs$venv" -name '*.so*' -type f -printf '/%P\n' | sed "s|^|$venv|" |
    xargs -r -n 50 chroot "$rootfs" /lib64/ld-linux-x86-64.so.2 --list 2>&1 | grep 'not found' | sort -u || true)
  [ -z "$missing" ] || { echo "build-images: libraries missing from the image:" >&2; echo "$missing" >&2; exit 1; }
  if [ "$compile" = 1 ]; then
    chroot "$rootfs" "$venv/bin/python" -m compileall -q -j 0 --invalidation-mode unchecked-hash \
      "$venv/lib/python3.11/site-packages" >/dev/null
  fi
}
cp "$PIP_WHEEL" "$WORK/wheels/"

# ------------------------------------------------------------------------------------ the image
# image NAME TITLE DESCRIPTION USER CMD: the config and labels of the image just assembled.
umoci init --layout "$LAYOUT"
image_config() {
  local tag=$1 title=$2 description=$3 user=$4
  shift 4
  local cmd=()
  for word in "$@"; do cmd+=(--config.cmd "$word"); done
  umoci config --image "$LAYOUT:$tag" --no-history --created "$CREATED" --author tierckpt \
    --config.user "$user" --config.workingdir /tmp \
    --config.env PATH=/opt/tierckpt/bin:/usr/local/bin:/usr/bin:/bin \
    --config.env PYTHONUNBUFFERED=1 --config.env PYTHONDONTWRITEBYTECODE=1 \
    --clear config.cmd "${cmd[@]}" \
    --config.label "org.opencontainers.image.title=$title" \
    --config.label "org.opencontainers.image.description=$description" \
    --config.label "org.opencontainers.image.version=$VERSION" \
    --config.label "org.opencontainers.image.revision=$REVISION" \
    --config.label "org.opencontainers.image.created=$CREATED" \
    --config.label "org.opencontainers.image.source=https://github.com/tierckpt/tierckpt" \
    --config.label "org.opencontainers.image.licenses=Apache-2.0" \
    --config.label "org.opencontainers.image.vendor=tierckpt" \
    --config.label "org.opencontainers.image.base.name=debian:$SUITE (mmdebstrap, images/debian.lock)" \
    --manifest.annotation "org.opencontainers.image.ref.name=$tag" \
    --manifest.annotation "org.opencontainers.image.title=$title"
}
# add_layer TAG DIR TARGET WHAT: DIR's contents as a new layer at TARGET, timestamps clamped.
add_layer() {
  find "$2" -newermt "@$SOURCE_DATE_EPOCH" -exec touch --no-dereference --date="@$SOURCE_DATE_EPOCH" {} +
  umoci insert --image "$LAYOUT:$1" --history.created "$CREATED" --history.created_by "$4" "$2" "$3"
}
report() {
  local tag=$1 rootfs=$2
  "$PY" - "$LAYOUT" "$tag" "$rootfs" "$OUT/$tag.json" "$(($(date +%s) - start))" "${@:3}" <<'PYTHON'
import json, os, sys
from pathlib import Path
layout, tag, rootfs, out, seconds, *locks = sys.argv[1:]
index = json.loads(Path(layout, "index.json").read_text())
desc = next(m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == tag)
blob = lambda d: Path(layout, "blobs", *d["digest"].split(":"))
manifest = json.loads(blob(desc).read_text())
config = json.loads(blob(manifest["config"]).read_text())
def tree_bytes(path):
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)
layers = [
    {"created_by": h.get("created_by", ""), "compressed_bytes": layer["size"]}
    for h, layer in zip([h for h in config["history"] if not h.get("empty_layer")], manifest["layers"])
]
dpkg = Path(rootfs, "var/lib/dpkg/status").read_text().splitlines().count("Status: install ok installed")
python = sum(1 for lock in locks for line in Path(lock).read_text().splitlines() if "==" in line) + 1
data = {
    "image": tag, "uncompressed_bytes": tree_bytes(rootfs),
    "compressed_bytes": sum(layer["size"] for layer in manifest["layers"]), "layers": layers,
    "debian_packages": dpkg, "python_packages": python, "build_seconds": int(seconds),
    "has_torch": Path(rootfs, "opt/tierckpt/lib/python3.11/site-packages/torch").exists(),
}
Path(out).write_text(json.dumps(data, indent=2) + "\n")
mb = lambda n: f"{n / 1e6:.0f} MB"
print(f"{tag}: {mb(data['uncompressed_bytes'])} uncompressed, {mb(data['compressed_bytes'])} compressed, "
      f"{dpkg} Debian + {python} Python packages, torch: {data['has_torch']}")
for layer in layers:
    print(f"  layer {mb(layer['compressed_bytes']):>7} compressed: {layer['created_by']}")
PYTHON
}

# The daemon image: Debian, then one virtualenv with tierckpt[replicator,operator,csi].
DAEMON=tierckpt-$VERSION
umoci new --image "$LAYOUT:$DAEMON"
add_layer "$DAEMON" "$root" / "mmdebstrap $SUITE: $(IFS=' '; echo "${DEBIAN_ROOTS[*]}") (images/debian.lock)"
cp -a "$root" "$WORK/daemon"
install_layer "$WORK/daemon" /opt/tierckpt 0 images/daemon.lock "$WHEEL"
# every entry point imports in the image, as the user it runs as by default
chroot --userspec=65532:65532 "$WORK/daemon" /opt/tierckpt/bin/python -c \
  'import tierckpt_replicator.daemon, tierckpt_operator.__main__, tierckpt_csi.service, tierckpt_cli.app'
! chroot "$WORK/daemon" /opt/tierckpt/bin/python -c 'import torch' 2>/dev/null ||
  { echo "build-images: torch is in the daemon image" >&2; exit 1; }
add_layer "$DAEMON" "$WORK/daemon/opt/tierckpt" /opt/tierckpt "pip install tierckpt[replicator,operator,csi] (images/daemon.lock)"
image_config "$DAEMON" "tierckpt" \
  "tierckpt daemons: tierckpt-replicator, tierckpt-operator, tierckpt-csi and the tierckpt CLI (no torch)" \
  65532:65532 tierckpt --help
log "daemon image ready"
report "$DAEMON" "$WORK/daemon" images/daemon.lock

if [ $TRAINING = 1 ]; then
  # The training image: the same Debian, the stand-in for the user's torch, then what tierckpt adds.
  TRAIN=tierckpt-training-$VERSION
  umoci new --image "$LAYOUT:$TRAIN"
  add_layer "$TRAIN" "$root" / "mmdebstrap $SUITE: $(IFS=' '; echo "${DEBIAN_ROOTS[*]}") (images/debian.lock)"
  cp -a "$root" "$WORK/training"
  install_layer "$WORK/training" /opt/tierckpt 1 images/training-torch.lock
  cp -a "$WORK/training/opt/tierckpt" "$WORK/torch-layer"
  add_layer "$TRAIN" "$WORK/torch-layer" /opt/tierckpt "pip install torch (images/training-torch.lock): the user's torch"
  install_layer "$WORK/training" /opt/tierckpt 1 images/training.lock "$WHEEL"
  # only what the second install added or changed goes into the last layer
  (cd "$WORK/training/opt/tierckpt" && find . \( -type f -o -type l \) -print0) |
    while IFS= read -r -d '' f; do
      if [ ! -e "$WORK/torch-layer/$f" ] && [ ! -L "$WORK/torch-layer/$f" ] ||
        ! cmp -s "$WORK/training/opt/tierckpt/$f" "$WORK/torch-layer/$f"; then
        mkdir -p "$WORK/tierckpt-layer/$(dirname "$f")"
        cp -a "$WORK/training/opt/tierckpt/$f" "$WORK/tierckpt-layer/$f"
      fi
    done
  add_layer "$TRAIN" "$WORK/tierckpt-layer" /opt/tierckpt "pip install tierckpt[torch] (images/training.lock)"
  image_config "$TRAIN" "tierckpt-training" \
    "an example training image: torch (CPU) and tierckpt[torch], the training library and its CLI" \
    65532:65532 python
  log "training image ready"
  report "$TRAIN" "$WORK/training" images/training-torch.lock images/training.lock
fi

umoci gc --layout "$LAYOUT"
rm -rf "$WORK/src" "$WORK/wheels" "$WORK/pip" "$WORK/torch-layer" "$WORK/tierckpt-layer"
log "done: $(umoci ls --layout "$LAYOUT" | paste -sd' ' -) in $LAYOUT"
