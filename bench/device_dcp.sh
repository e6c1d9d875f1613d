#!/usr/bin/env bash
# DCP on 2 GPUs (run by the lead on the device machine, Python with CUDA torch): an FSDP2 model with
# Adam over NCCL, dcp.async_save through RamdiskWriter against FileSystemWriter on the same tmpfs, and the
# native Checkpointer for the same bytes; blocking time, time to durable, load (bench/dcp_bench.py --fsdp).
# Usage there: bash bench/device_dcp.sh "1024 4096"   (state sizes in MiB, all ranks). JSON and logs to $OUT.
set -uo pipefail
sizes=${1:-"1024 4096"}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD/client:$PWD/cli:$PWD/demo:/tmp/site PYTHONUNBUFFERED=1
RD=/mnt/tierckpt-bench
mkdir -p $RD && (mountpoint -q $RD || mount -t tmpfs -o size=100g,huge=${HUGE:-within_size} tierckpt-bench $RD) || RD=/dev/shm
df -h $RD | tail -1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.device_count(), 'GPUs')" | tee -a "$OUT/gpu.txt"
gpus=$(python3 -c "import torch; print(min(2, torch.cuda.device_count()))")
if [ -z "${SKIP_TESTS:-}" ]; then  # device_run.sh's "tests" part runs them too
  echo "== dcp gpu tests"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/dcp/test_dcp_gpu.py 2>&1 | tail -20 | tee "$OUT/dcp-gpu-tests.txt"
fi
for s in $sizes; do
  echo "== FSDP2 on $gpus GPUs, ${s} MiB"
  timeout ${T_RUN:-560} torchrun --standalone --nproc-per-node "$gpus" bench/dcp_bench.py --fsdp --device cuda \
    --mib "$s" --repeats 3 --dir $RD --json > "$OUT/dcp-fsdp-${s}m.json" 2> "$OUT/dcp-fsdp-${s}m.err"
  echo "rc=$?"; tail -3 "$OUT/dcp-fsdp-${s}m.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({k: d[k] for k in ('machine', 'world_size', 'bytes_per_rank_max', 'floor_s', 'filesystem_writer', 'ramdisk_writer', 'checkpointer', 'ramdisk_async_blocked_vs_native_blocked', 'ramdisk_async_durable_vs_native_durable')}, indent=1))" "$OUT/dcp-fsdp-${s}m.json"
  rm -rf $RD/tierckpt-dcp-bench-*
done
[ -n "${SKIP_ONE_GPU:-}" ] && exit 0
echo "== one process, 1 GPU, 1024 MiB"
timeout 300 python3 bench/dcp_bench.py --device cuda --mib 1024 --dir $RD --json > "$OUT/dcp-cuda-1g.json" 2> "$OUT/dcp-cuda-1g.err"
echo "rc=$?"; tail -3 "$OUT/dcp-cuda-1g.err"; cat "$OUT/dcp-cuda-1g.json"
