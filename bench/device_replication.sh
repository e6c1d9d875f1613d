#!/usr/bin/env bash
# The replication benchmarks (bench/replicator_bench.py, bench/erasure_bench.py) on the device machine:
# 16 idle cores, so the training-slowdown figure is not swamped by a shared 2-core VM's noise.
#
#   here (with network), once:   bash bench/device_replication.sh download   # fills .whl/
#   on the device (Python 3.12): bash bench/device_replication.sh [all|transfers|training|erasure]
#                                (SIZE_MIB=256 by default; STREAMS=8 ranks at once in the transfers
#                                part; JSON and logs go to $OUT)
# The data path runs as deployed: mutual TLS, each connection a sealed channel (replication/channel.py),
# cryptography's wheel bringing its own OpenSSL; "transfers" also measures STREAMS ranks pushed at once
# against as many raw TCP flows (the multi-core figure).
# "all" takes about 10 minutes on 16 cores; the parts fit one device call each.
#
# The device's image already has torch, anyio, httpx, h11, idna, click, prometheus-client, psutil,
# uvloop and annotated-doc; the replicator's other dependencies travel as wheels (cp312, x86-64):
# fastapi, starlette, pydantic, pydantic-core, typing-inspection, annotated-types, typing-extensions,
# uvicorn, httptools, google-crc32c, inotify-simple, tenacity, pyeclib, and cryptography with cffi and
# pycparser (the cluster's CA and node certificates: it runs mutual TLS) (versions: constraints.txt).
# Carry .whl with the call (run's `carry: [".whl"]`; about 6 MiB); add `echo /.whl/ >> .git/info/exclude`.
#
# Network namespaces are used when `ip netns` works there, else the nodes are loopback ports; either
# way the ramdisks live in a tmpfs mounted with huge=within_size (as the chart mounts the node
# ramdisk), or /dev/shm when mounting is refused.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  fastapi starlette pydantic pydantic_core typing-inspection annotated-types typing-extensions
  uvicorn httptools google-crc32c inotify-simple tenacity pyeclib cryptography cffi pycparser
)

if [ "${1:-}" = download ]; then
  mkdir -p .whl
  specs=()
  for w in "${WHEELS[@]}"; do
    pin=$(grep -i "^${w//[-_]/[-_]}==" constraints.txt || true)
    [ -n "$pin" ] || pin=$w
    specs+=("$pin")
  done
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${specs[@]}"
fi

part=${1:-all}
size=${SIZE_MIB:-256}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheels missing: run 'bash bench/device_replication.sh download' here and carry .whl" >&2; exit 1; }
export PYTHONPATH=$PWD/client:$PWD/replicator:$PWD/demo:/tmp/site PYTHONUNBUFFERED=1
# LocalCluster starts nodes through the tierckpt-replicator console script; without the package
# installed, a wrapper on PATH does the same.
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -m tierckpt_replicator "$@"\n' > /tmp/bin/tierckpt-replicator
chmod +x /tmp/bin/tierckpt-replicator
export PATH=/tmp/bin:$PATH

RD=/mnt/tierckpt-repl
mkdir -p $RD
if mountpoint -q $RD || mount -t tmpfs -o size=32g,huge=within_size tierckpt-repl $RD; then
  huge=keep
else
  RD=/dev/shm; huge=keep
fi
export TMPDIR=$RD/tmp
mkdir -p "$TMPDIR"
grep " $RD " /proc/self/mountinfo | tee "$OUT/ramdisk.txt"
nproc | tee "$OUT/cpus.txt"
net=()
if ip netns add tck-probe 2>/dev/null; then
  ip netns del tck-probe
  huge=within_size  # each node's ramdisk is its own tmpfs: remount it huge=within_size
else
  net=(--loopback)
  echo "no network namespaces here: loopback nodes under $TMPDIR" | tee -a "$OUT/ramdisk.txt"
fi

common=(--size-mib "$size" --skip-restore --huge "$huge" "${net[@]}" --json)
show() {
  python3 - "$1" <<'EOF'
import json, sys
sys.path.insert(0, "bench")
from replicator_bench import _print_table
_print_table(json.load(open(sys.argv[1])))
EOF
}
if [ "$part" = all ] || [ "$part" = transfers ]; then
  echo "== replicator bench: transfers, stages, receive loops (${size} MiB)"
  timeout ${T_TRANSFERS:-420} python3 bench/replicator_bench.py "${common[@]}" --repeat ${REPEAT:-5} --stages --receivers \
    --streams ${STREAMS:-8} --skip-training \
    > "$OUT/transfers.json" 2> "$OUT/transfers.err"
  echo "rc=$?"; tail -5 "$OUT/transfers.err"; show "$OUT/transfers.json"
fi
if [ "$part" = all ] || [ "$part" = training ]; then
  echo "== replicator bench: training beside replication (${size} MiB every second)"
  timeout 420 python3 bench/replicator_bench.py "${common[@]}" --repeat 1 --train-seconds 6 --train-repeat 3 \
    > "$OUT/training.json" 2> "$OUT/training.err"
  echo "rc=$?"; tail -5 "$OUT/training.err"; show "$OUT/training.json"
fi
if [ "$part" = all ] || [ "$part" = erasure ]; then
  echo "== erasure bench"
  timeout 240 python3 bench/erasure_bench.py --size-mib "$size" --json > "$OUT/erasure.json" 2> "$OUT/erasure.err"
  echo "rc=$?"; tail -3 "$OUT/erasure.err"; cat "$OUT/erasure.json"
fi
rm -rf "${TMPDIR:?}"/*
