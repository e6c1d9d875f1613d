#!/usr/bin/env bash
# Run the client suite (tests/client, tests/dcp) on the oldest and the newest torch that the "torch"
# extra of pyproject.toml admits, each in a virtualenv of its own under .work/torch-range/.
#
#   scripts/torch-range.sh                # the oldest and the newest release in the declared range
#   scripts/torch-range.sh 2.6.0 2.9.1    # these releases instead
#   TORCH_RANGE_KEEP=1 ...                # keep the virtualenvs (several GB each) for a rerun
#
# torch and its own dependencies are installed as that release requires them (from PyPI: the CUDA
# build, which runs the suite on CPU); everything else at the versions constraints.txt pins. Too long
# for the main CI run (two torch installs, two runs of the suite): the scheduled job (.ci/scheduled)
# runs it, and docs/install.md ("Your training image") says what it found last.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
WORK=$REPO/.work/torch-range
mkdir -p "$WORK"

if [ $# -gt 0 ]; then
  versions=("$@")
else
  mapfile -t versions < <("$PY" - <<'PYTHON'
import re, subprocess, sys, tomllib
from packaging.specifiers import SpecifierSet
from packaging.version import Version

extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["torch"]
spec = SpecifierSet(next(r for r in extra if re.match(r"torch\b", r))[len("torch"):])
out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "torch"], capture_output=True, text=True)
listed = re.search(r"Available versions: (.*)", out.stdout).group(1).split(", ")
ok = sorted(v for v in map(Version, listed) if not v.is_prerelease and not v.local and v in spec)
print(ok[0]); print(ok[-1])
PYTHON
)
fi
echo "torch-range: torch ${versions[*]}" >&2

results=()
status=0
for version in "${versions[@]}"; do
  venv=$WORK/torch-$version
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  start=$(date +%s)
  # the machine's own pip constraints (if any) must not cap the release under test
  export PIP_CONSTRAINT=/dev/null
  "$venv/bin/pip" install -q "torch==$version"
  # everything but torch's own dependencies at constraints.txt's pins
  "$venv/bin/pip" list --format=freeze | "$PY" -c '
import re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
have = {norm(line.split("==")[0]) for line in sys.stdin}
for line in open("constraints.txt"):
    if "==" not in line or norm(line.split("==")[0]) not in have:
        print(line, end="")
' >"$WORK/constraints-$version.txt"
  "$venv/bin/pip" install -q -c "$WORK/constraints-$version.txt" -e ".[torch,demo]" \
    pytest pytest-asyncio pytest-timeout hypothesis psutil 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  got=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  [ "${got%%+*}" = "$version" ] || { echo "torch-range: asked for torch $version, got $got" >&2; exit 1; }
  echo "torch-range: torch $got installed in $(($(date +%s) - start)) s; running the client suite" >&2
  log=$WORK/torch-$version.log
  set +e
  "$venv/bin/python" -m pytest -m "not gpu" -p no:cacheprovider -q tests/client tests/dcp >"$log" 2>&1
  rc=$?
  set -e
  summary=$(tail -1 "$log")
  results+=("torch $got: $summary")
  [ $rc -eq 0 ] || { status=1; tail -40 "$log" >&2; }
  [ "${TORCH_RANGE_KEEP:-0}" = 1 ] || rm -rf "$venv"
done
printf 'torch-range: %s\n' "${results[@]}"
exit $status
