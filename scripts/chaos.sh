#!/usr/bin/env bash
# Set up (idempotent), then run the chaos harness (as root): real training on the local netns cluster
# while a seeded scheduler injects random, overlapping faults, every invariant checked after every fault
# and at every restore. Extra arguments go to `tierckpt-chaos`, e.g. `--duration 1h --seed random`,
# `--replay chaos-runs/.../minimal-schedule.json` (docs/reliability.md, docs/operations.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tierckpt-chaos "$@"
