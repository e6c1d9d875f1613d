#!/usr/bin/env bash
# One batched device run after a change to the GPU paths (2 GPUs): the GPU tests, DCP FSDP2 on 2 GPUs,
# two trainers of the README's loop, and a 1 GiB restore. Results to $OUT; a summary on stdout.
# Usage there: bash bench/device_final.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
umount /mnt/tierckpt-bench 2>/dev/null
SKIP_TRAIN=1 RD_SIZE=150g bash bench/device_goodput.sh > "$OUT/setup.txt" 2>&1  # wheels, ramdisk (huge pages)
export PATH=/tmp/site/bin:$PATH PYTHONPATH=$PWD/client:$PWD/cli:$PWD/demo:/tmp/site PYTHONUNBUFFERED=1
cat "$OUT/machine.txt"
echo "== gpu tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore::pytest.PytestConfigWarning -m gpu tests/client/test_client_cuda.py \
  tests/client/test_client_devstage_cuda.py tests/dcp/test_dcp_gpu.py 2>&1 | tail -3
echo "== dcp fsdp2, 2 GiB a rank"
SKIP_TESTS=1 SKIP_ONE_GPU=1 T_RUN=200 bash bench/device_dcp.sh 4096 2>&1 | grep -E '"load_s"|_vs_native|rc='
echo "== two trainers, the README loop"
T_TRAIN=220 SKIP_TRAIN= bash bench/device_goodput.sh --trainers 2 --modes readme 2>&1 | grep '^{"mode"'
echo "== restore 1 GiB"
timeout 90 python3 bench/client_bench.py --device cuda --size-gib 1 --root /mnt/tierckpt-bench --skip-torch-save \
  --skip-dcp --json > "$OUT/client-1g.json" 2>> "$OUT/bench.log"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); t=d['tierckpt']; print({'floor': d['floor']['read_s'], 'warm': t['restore_warm_s'], 'vs_floor': t['restore_vs_floor'], 'phases': t['restore_warm_phases']})" "$OUT/client-1g.json"
