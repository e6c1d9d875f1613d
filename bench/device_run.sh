#!/usr/bin/env bash
# Run the GPU tests and the GPU benchmarks on the device machine (Python 3.12 with CUDA torch), all in
# one call, each part under its own time limit. Writes at most 8 files to $OUT (JSON results, one log)
# and prints a short summary.
# Usage there: bash bench/device_run.sh [parts]   parts: tests train stall prefault restore (default: all),
#   and dp (replica groups on every GPU, 2 or more: bench/dp_bench.py; not in the default)
#   SIZES="1 4 16"        restore/save sizes in GiB      HUGE=within_size   the ramdisk's huge= option
#   DP_SIZES="1 4"        dp: state sizes per rank in GiB
#   TRAIN_ARGS="..."      extra arguments for the training loop (e.g. --layers 4 --steps 30,100)
# Missing Python packages are installed from wheels in $WHEELS (default .whl or ../wheels).
set -uo pipefail
parts=${1:-"tests train stall prefault restore"}
sizes=${SIZES:-"1 4 16"}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-$( [ -d .whl ] && echo .whl || echo ../wheels )}
export PYTHONPATH=$PWD/client:$PWD/cli:$PWD/demo:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
need=()
python3 -c "import google_crc32c" 2>/dev/null || need+=(google_crc32c)
python3 -c "import pydantic" 2>/dev/null || need+=(pydantic pydantic_core annotated_types typing_inspection typing_extensions)
python3 -c "import pytest" 2>/dev/null || need+=(pytest pluggy iniconfig)
for name in "${need[@]}"; do
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/${name}-*.whl
done
RD=/mnt/tierckpt-bench
mkdir -p $RD && (mountpoint -q $RD || mount -t tmpfs -o size=100g,huge=${HUGE:-within_size} tierckpt-bench $RD) || RD=/dev/shm
mount -o remount,size=48g /dev/shm 2>/dev/null  # the tests' ramdisk directories live there
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  echo "cpus $(nproc); $(grep MemTotal /proc/meminfo); ramdisk $(findmnt -no OPTIONS $RD)"
  echo "shmem_enabled: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null)"
  echo "installed: ${need[*]:-nothing}"
} | tee "$OUT/machine.txt"
py() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); $1" "$2" 2>/dev/null; }
if [[ $parts == *tests* ]]; then
  echo "== gpu tests"
  timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider -W ignore::pytest.PytestConfigWarning -m gpu \
    tests/client/test_client_cuda.py tests/client/test_client_devstage_cuda.py tests/client/test_client_replica_cuda.py \
    tests/client/test_client_pinned_pieces.py \
    tests/dcp/test_dcp_gpu.py \
    > "$OUT/gpu-tests.txt" 2>&1
  echo "rc=$?"; tail -15 "$OUT/gpu-tests.txt"
fi
if [[ $parts == *train* ]]; then
  echo "== training loop (timed, then check mode)"
  timeout ${T_TRAIN:-300} python3 bench/client_bench.py --train --check --device cuda --root $RD ${TRAIN_ARGS:-} \
    > "$OUT/train.json" 2> >(tee -a "$OUT/bench.log" >&2)
  echo "rc=$?"
  py 'print(d["floor"], d.get("errors")); keys=("mode","every","overhead","per_save_vs_floor","blocking_s","saving_step_s","step_after_s","last_snapshot"); [print({k: r[k] for k in keys if k in r}) for r in d["summary"]]; print(d.get("check"))' "$OUT/train.json"
  rm -rf ${RD:?}/*
fi
if [[ $parts == *stall* ]]; then
  echo "== training steps while another thread pre-faults and registers a slot (bench/register_stall_bench.py)"
  timeout 200 python3 bench/register_stall_bench.py --root $RD --gib ${STALL_GIB:-11} > "$OUT/stall.jsonl" 2>> "$OUT/bench.log"
  echo "rc=$?"; cat "$OUT/stall.jsonl"
  rm -rf ${RD:?}/*
fi
if [[ $parts == *prefault* ]]; then
  echo "== pre-fault and registration, huge=never vs huge=within_size"
  timeout 90 python3 bench/client_bench.py --prefault --device cuda --size-gib 8 --root $RD --repeats 3 \
    > "$OUT/prefault.json" 2>> "$OUT/bench.log"
  echo "rc=$?"; cat "$OUT/prefault.json"
  rm -rf ${RD:?}/*
fi
if [[ $parts == *restore* ]]; then
  for s in $sizes; do
    echo "== client bench cuda ${s} GiB"
    timeout 120 python3 bench/client_bench.py --device cuda --size-gib "$s" --root $RD --skip-torch-save --skip-dcp \
      --json > "$OUT/client-cuda-${s}g.json" 2>> "$OUT/bench.log"
    echo "rc=$?"
    py 't=d["tierckpt"]; print(json.dumps({"floor": d["floor"], "checks": d["checks"], **{k: t.get(k) for k in ("first_blocking_s", "warmup_blocking_s", "steady_blocking_s", "restore_warm_s", "restore_warm_noverify_s", "restore_cold_s", "restore_warm_phases", "cold_background_register_s")}}))' "$OUT/client-cuda-${s}g.json"
    rm -rf ${RD:?}/*
  done
fi
if [[ $parts == *dp* ]]; then
  for s in ${DP_SIZES:-1 4}; do
    echo "== replica groups ${s} GiB per rank: save once per node; restore own copies vs load once + broadcast"
    timeout ${T_DP:-300} python3 bench/dp_bench.py --size-gib "$s" --root $RD > "$OUT/dp-${s}g.json" 2>> "$OUT/bench.log"
    echo "rc=$?"
    py 'print(json.dumps({k: d.get(k) for k in ("machine", "save", "ramdisk", "digest_gbps", "floors", "restore_warm_s", "restore_cold_s", "restored_ok", "restore_checks")}, indent=1))' "$OUT/dp-${s}g.json"
    rm -rf ${RD:?}/*
  done
fi
