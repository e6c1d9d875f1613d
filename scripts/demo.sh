#!/usr/bin/env bash
# Set up (idempotent), then run the main job: the local multi-node demo with its default settings.
# Extra arguments go to `tierckpt demo` (see `tierckpt demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tierckpt demo "$@"
