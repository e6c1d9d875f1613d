#!/usr/bin/env bash
# On the device machine: the training-loop goodput benchmark (bench/goodput_bench.py) from process start,
# then (RESTORE_SIZES) restore against the H2D floor. Wheels for what the image lacks come from .whl
# (bash bench/device_replication.sh download here, then carry .whl). Results go to $OUT.
# Usage there: bash bench/device_goodput.sh [goodput_bench.py arguments...]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/google_crc32c-*.whl .whl/pydantic-*.whl .whl/pydantic_core-*.whl .whl/annotated_types-*.whl \
  .whl/typing_inspection-*.whl .whl/typing_extensions-*.whl .whl/py_spy-*.whl .whl/pytest-*.whl \
  .whl/pluggy-*.whl .whl/iniconfig-*.whl 2>&1 | tail -2
export PATH=/tmp/site/bin:$PATH PYTHONPATH=$PWD/client:$PWD/cli:$PWD/demo:/tmp/site PYTHONUNBUFFERED=1
RD=/mnt/tierckpt-bench
mkdir -p $RD && (mountpoint -q $RD || mount -t tmpfs -o size=${RD_SIZE:-100g},huge=${HUGE:-within_size} tierckpt-bench $RD)
mount -o remount,size=48g /dev/shm 2>/dev/null
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  echo "cpus $(nproc); $(grep MemTotal /proc/meminfo); ramdisk $(findmnt -no OPTIONS $RD)"
  echo "shmem_enabled: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null); date $(date -u +%F)"
} | tee "$OUT/machine.txt"
if [ "${SKIP_TRAIN:-}" != 1 ]; then
  timeout ${T_TRAIN:-420} python3 bench/goodput_bench.py --root ${ROOT:-$RD} --out "$OUT" "$@" \
    > "$OUT/goodput.json" 2> >(tee "$OUT/goodput.log" >&2)
  echo "rc=$?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(json.dumps(r)) for r in d['summary']]; print(json.dumps(d.get('check')))" "$OUT/goodput.json"
fi
for s in ${RESTORE_SIZES:-}; do
  echo "== restore ${s} GiB"
  timeout 150 python3 bench/client_bench.py --device cuda --size-gib "$s" --root $RD --skip-torch-save --skip-dcp \
    --json > "$OUT/client-cuda-${s}g.json" 2>> "$OUT/bench.log"
  echo "rc=$?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); t=d['tierckpt']; print(json.dumps({'floor': d['floor'], **{k: t.get(k) for k in ('first_blocking_s', 'steady_blocking_s', 'restore_warm_s', 'restore_warm_noverify_s', 'restore_cold_s', 'restore_warm_phases')}}))" "$OUT/client-cuda-${s}g.json"
  rm -rf ${RD:?}/*
done
