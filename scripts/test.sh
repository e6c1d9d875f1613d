#!/usr/bin/env bash
# Set up (idempotent), then run every check CI runs: ruff, import-linter, the declared dependencies, mypy,
# the docs build, and pytest.
# Extra arguments go to pytest. GPU tests are deselected here and run on the device machine; the chaos
# harness's fixed-seed run (marker "chaos") runs in .ci/scheduled while it still fails about 1 run in 3
# on open bugs (docs/reliability.md, "Open"): a test that fails at random would block every change.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff" && ruff check client cli demo replicator csi operator tests bench
echo "== ruff format" && ruff format --check --quiet client cli demo replicator csi operator tests bench
echo "== import-linter" && lint-imports
echo "== dependencies (deptry, per install target)" && python scripts/check-deps.py
echo "== mypy (strict)" && mypy
if [ -f mkdocs.yml ]; then echo "== docs (strict)" && mkdocs build --strict --quiet -d "$(mktemp -d)"; fi
echo "== pytest"
set +e
python -m pytest -m "not gpu and not chaos" -p no:cacheprovider "$@"
rc=$?
set -e
[ $rc -eq 5 ] && { echo "no tests collected"; exit 1; }
exit $rc
