#!/usr/bin/env bash
# Run the GPU tests and the GPU benchmarks on the device machine (Python 3.12 with CUDA torch).
# Usage there: bash bench/device_run.sh "1 4 16"   (sizes in GiB). Writes JSON and logs to $OUT.
set -uo pipefail
sizes=${1:-"1 4 16"}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/client:/tmp/site PYTHONUNBUFFERED=1
RD=/mnt/tierckpt-bench
mkdir -p $RD && (mountpoint -q $RD || mount -t tmpfs -o size=100g tierckpt-bench $RD) || RD=/dev/shm
df -h $RD | tail -1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
echo "== gpu tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/client/test_client_cuda.py tests/dcp/test_dcp_gpu.py 2>&1 | tail -40 | tee "$OUT/gpu-tests.txt"
for s in $sizes; do
  echo "== client bench cuda ${s} GiB"
  extra=""; [ "$s" -ge 16 ] && extra="--skip-torch-save"
  timeout 420 python3 bench/client_bench.py --device cuda --size-gib "$s" --root $RD $extra --json > "$OUT/client-cuda-${s}g.json" 2> "$OUT/client-cuda-${s}g.err"
  echo "rc=$?"; tail -3 "$OUT/client-cuda-${s}g.err"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); t=d['tierckpt']; print(json.dumps({'floor': d['floor'], 'checks': d['checks'], **{k: t.get(k) for k in ('steady_blocking_s', 'restore_warm_s', 'restore_warm_noverify_s', 'restore_cold_s', 'cold_open_s', 'restore_warm_phases', 'restore_cold_phases', 'cold_background_register_s', 'device_staging_bytes')}}, indent=1))" "$OUT/client-cuda-${s}g.json"
  rm -rf $RD/*
done
