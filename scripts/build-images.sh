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
#                             tierckpt-training-<version> (the chart's default image is
#                             <registry>/tierckpt:<version>); push with skopeo (docs/install.md)
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
# The chart's default image names what this builds: <registry>/<name>:<appVersion> (tests/packaging).
REPOSITORY=$(sed -n '/^image:/,/^[a-z]/s/^  repository: *//p' charts/tierckpt/values.yaml)
NAME=${REPOSITORY##*/}
REGISTRY=${REGISTRY:-${REPOSITORY%/*}}
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
# The training image is a stand-in for a user's: it has a shell and the tools a launch script uses
# (deploy/examples/jobset.yaml), the daemon image has none.
TRAINING_ROOTS=("${DEBIAN_ROOTS[@]}" bash coreutils sed grep)

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
# debian_rootfs DIR LOCK ROOTS...: the root filesystem of LOCK's packages in DIR (with --relock-debian
# or without LOCK: of ROOTS and their dependencies, as apt chooses now, and LOCK rewritten).
debian_rootfs() {
  local dir=$1 lock=$2 include installed out
  shift 2
  if [ $RELOCK = 1 ] || [ ! -f "$lock" ]; then
    include=$(IFS=,; echo "$*")
  else
    include=$(grep -v '^#' "$lock" | paste -sd, -)
  fi
  mmdebstrap --quiet --variant=custom --mode=chrootless --include="$include" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    "$SUITE" "$dir" "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" \
    "deb $SECURITY $SUITE-security main"
  installed=$(dpkg-query --admindir="$dir/var/lib/dpkg" -W -f='${Package}=${Version}\n' | sort)
  if [ $RELOCK = 1 ] || [ ! -f "$lock" ]; then
    { echo "# The Debian packages of an image's root filesystem (scripts/build-images.sh --relock-debian)."
      echo "# Roots: $*; suite $SUITE with its updates and security fixes."
      echo "$installed"; } >"$lock"
    log "wrote $lock"
  elif [ "$installed" != "$(grep -v '^#' "$lock")" ]; then
    echo "build-images: the root filesystem differs from $lock:" >&2
    diff <(grep -v '^#' "$lock") <(echo "$installed") >&2 || true
    exit 1
  fi
  # No package manager in the image; dpkg's database stays, for scanners to read.
  if ! out=$(dpkg --root="$dir" --force-script-chrootless --force-remove-essential --force-depends \
    --purge "${BUILD_ONLY[@]}" 2>&1); then
    echo "$out" >&2
    exit 1
  fi
  rm -rf "$dir"/var/cache/* "$dir"/var/log/* "$dir"/var/lib/apt "$dir"/etc/apt "$dir"/etc/dpkg
  # The users the images run as: root (the CSI plugin, the replicator) and nonroot (65532, the default).
  printf '%s\n' root:x:0:0:root:/root:/usr/sbin/nologin \
    nonroot:x:65532:65532:nonroot:/home/nonroot:/usr/sbin/nologin >"$dir/etc/passwd"
  printf '%s\n' root:x:0: nonroot:x:65532: >"$dir/etc/group"
  install -d -m 0700 "$dir/root"
  install -d -m 0755 -o 65532 -g 65532 "$dir/home/nonroot"
  install -d -m 1777 "$dir/tmp"
  install -d -m 0755 "$dir/proc" "$dir/dev" "$dir/sys"
  log "Debian root filesystem ready: $(grep -vc '^#' "$lock") packages of $lock"
}
debian_rootfs "$WORK/debian" images/debian.lock "${DEBIAN_ROOTS[@]}"
root=$WORK/debian

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
  # Only extension modules that carry debug sections: strip rewrites an ELF file, and the libraries
  # auditwheel grafted into the wheels (*.libs/, edited by patchelf) no longer load once rewritten.
  find "$rootfs$venv" -name '*.so*' -type f ! -path '*.libs/*' -print0 |
    while IFS= read -r -d '' so; do
      if readelf -S "$so" 2>/dev/null | grep -q '\.debug_info'; then strip --strip-debug "$so"; fi
    done
  # every shared object loads in the image: its libraries are there, and it is intact
  local sos
  mapfile -t sos < <(find "$rootfs$venv" -name '*.so*' -type f -printf "$venv/%P\n")
  chroot "$rootfs" "$venv/bin/python" -c '
import ctypes, sys
failed = []
for path in sys.argv[1:]:
    try:
        ctypes.CDLL(path)
    except OSError as exc:
        failed.append(str(exc))
if failed:
    sys.exit("build-images: shared objects that do not load in the image:\n" + "\n".join(failed))
' "${sos[@]}"
  if [ "$compile" = 1 ]; then
    # (torch ships a test helper in Python 3.12 syntax: such files stay source, as they cannot import)
    chroot "$rootfs" "$venv/bin/python" -m compileall -q -j 0 --invalidation-mode unchecked-hash \
      "$venv/lib/python3.11/site-packages" >"$WORK/compileall.log" ||
      log "byte-compiled all but $(grep -c '^\*\*\*' "$WORK/compileall.log" || true) files (Python 3.11 cannot read them)"
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
# kept ROOTS...: the roots that stay in the image (not BUILD_ONLY)
kept() {
  local r out=()
  for r in "$@"; do [[ " ${BUILD_ONLY[*]} " == *" $r "* ]] || out+=("$r"); done
  echo "${out[*]}"
}
# add_layer TAG DIR TARGET WHAT: DIR's contents as a new layer at TARGET, timestamps clamped.
add_layer() {
  find "$2" -newermt "@$SOURCE_DATE_EPOCH" -exec touch --no-dereference --date="@$SOURCE_DATE_EPOCH" {} +
  umoci insert --image "$LAYOUT:$1" --history.created "$CREATED" --history.created_by "$4" "$2" "$3"
}
report() {
  local tag=$1 rootfs=$2
  "$PY" - "$LAYOUT" "$tag" "$rootfs" "$OUT/$tag.json" "$(($(date +%s) - start))" "${@:3}" <<'PYTHON'
import gzip, json, os, sys
from pathlib import Path
layout, tag, rootfs, out, seconds, *locks = sys.argv[1:]
index = json.loads(Path(layout, "index.json").read_text())
desc = next(m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == tag)
blob = lambda d: Path(layout, "blobs", *d["digest"].split(":"))
manifest = json.loads(blob(desc).read_text())
config = json.loads(blob(manifest["config"]).read_text())
def tree_bytes(path):
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)
def unpacked(layer):
    with gzip.open(blob(layer)) as f:
        return sum(len(chunk) for chunk in iter(lambda: f.read(1 << 20), b""))
layers = [
    {"created_by": h.get("created_by", ""), "compressed_bytes": layer["size"], "tar_bytes": unpacked(layer)}
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
    size = f"{mb(layer['tar_bytes'])} ({mb(layer['compressed_bytes'])} compressed)"
    print(f"  layer {size:>22}: {layer['created_by']}")
PYTHON
}

# The daemon image: Debian, then one virtualenv with tierckpt[replicator,operator,csi].
DAEMON=$NAME-$VERSION
umoci new --image "$LAYOUT:$DAEMON"
add_layer "$DAEMON" "$root" / "mmdebstrap $SUITE: $(kept "${DEBIAN_ROOTS[@]}") (images/debian.lock)"
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
  TRAIN=$NAME-training-$VERSION
  umoci new --image "$LAYOUT:$TRAIN"
  debian_rootfs "$WORK/training" images/debian-training.lock "${TRAINING_ROOTS[@]}"
  add_layer "$TRAIN" "$WORK/training" / "mmdebstrap $SUITE: $(kept "${TRAINING_ROOTS[@]}") (images/debian-training.lock)"
  install_layer "$WORK/training" /opt/tierckpt 1 images/training-torch.lock
  cp -a "$WORK/training/opt/tierckpt" "$WORK/torch-layer"
  add_layer "$TRAIN" "$WORK/torch-layer" /opt/tierckpt "pip install torch (images/training-torch.lock): the user's torch"
  install_layer "$WORK/training" /opt/tierckpt 1 images/training.lock "$WHEEL"
  # only what the second install added or changed goes into the last layer
  "$PY" - "$WORK/torch-layer" "$WORK/training/opt/tierckpt" "$WORK/tierckpt-layer" <<'PYTHON'
import filecmp, os, shutil, sys
before, after, out = sys.argv[1:]
for top, dirs, files in os.walk(after):
    for name in dirs + files:
        new = os.path.join(top, name)
        rel = os.path.relpath(new, after)
        old = os.path.join(before, rel)
        if os.path.islink(new):
            if os.path.islink(old) and os.readlink(old) == os.readlink(new):
                continue
        elif os.path.isdir(new) or (os.path.isfile(old) and filecmp.cmp(old, new, shallow=False)):
            continue
        os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
        shutil.copy2(new, os.path.join(out, rel), follow_symlinks=False)
PYTHON
  add_layer "$TRAIN" "$WORK/tierckpt-layer" /opt/tierckpt "pip install tierckpt[torch] (images/training.lock)"
  image_config "$TRAIN" "tierckpt-training" \
    "an example training image: torch (CPU) and tierckpt[torch], the training library and its CLI" \
    65532:65532 python
  log "training image ready"
  report "$TRAIN" "$WORK/training" images/training-torch.lock images/training.lock
fi

umoci gc --layout "$LAYOUT"
echo "build-images: push with skopeo (REGISTRY=... to build for another registry):" >&2
for tag in $(umoci ls --layout "$LAYOUT"); do
  echo "  skopeo copy oci:$LAYOUT:$tag docker://$REGISTRY/${tag%-"$VERSION"}:$VERSION" >&2
done
rm -rf "$WORK/src" "$WORK/wheels" "$WORK/pip" "$WORK/torch-layer" "$WORK/tierckpt-layer"
log "done: $(umoci ls --layout "$LAYOUT" | paste -sd' ' -) in $LAYOUT"
