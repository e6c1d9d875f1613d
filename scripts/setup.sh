#!/usr/bin/env bash
# Idempotent setup for a fresh machine: system tools (when root), a virtualenv in .venv, and the
# project with every extra, pinned through constraints.txt (which pins torch==2.13.0, a CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  command -v ip >/dev/null || need+=(iproute2)
  command -v nft >/dev/null || need+=(nftables)
  command -v mount >/dev/null || need+=(mount)
  if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing ${need[*]}" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") >/dev/null
  fi
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.tierckpt-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  echo "setup: installing tierckpt and its pinned dependencies into .venv" >&2
  .venv/bin/pip install -q -c constraints.txt -e '.[dev]' 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  .venv/bin/python -c "import tierckpt, torch" && touch "$stamp"
fi
