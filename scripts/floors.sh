#!/usr/bin/env bash
# Do the declared lower bounds hold? Installs every bound of pyproject.toml exactly (each
# `name>=X` of the dependencies and of the test extras becomes `name==X`) into a scratch venv
# in a temp dir, the project beside them (editable, --no-deps), runs the unit layer and one
# 2-worker run on the default data (its metrics.json must say completed), prints one RESULT
# line and removes the venv. Not part of CI: it takes about 10 minutes and up to 7 GB of disk.
#
#   bash scripts/floors.sh               # on Python 3.11, where pip finds the torch floor
#
# Where PyPI's torchvision cannot load beside the torch floor's build (a CPU-only torch file),
# the tests that imported torchvision and failed run again at FLOORS_TV_PAIR (default
# torch==2.14.1 torchvision==0.29.1), every other pin kept.
# Settings (environment): PYTHON (default python3), FLOORS_JOBS (pytest-xdist processes for the
# unit layer, default 2; 0 = one process), FLOORS_KEEP=1 keeps the scratch dir and says where.
# Exit status: 0 when the install, the unit layer and the 2-worker run all passed.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
JOBS=${FLOORS_JOBS:-2}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ddpexp-floors.XXXXXX") || exit 1
if [ "${FLOORS_KEEP:-0}" = 1 ]; then
  trap 'echo "scratch dir kept: $WORK" >&2' EXIT
else
  trap 'rm -rf "$WORK"' EXIT
fi
START=$(date +%s)

# ------------------------------------------------------------------ the pins, from pyproject
# Every requirement carries a lower bound; one without would have no floor to test, so it is
# reported rather than installed at whatever is newest.
"$PY" - "$ROOT/pyproject.toml" > "$WORK/floors.txt" <<'EOF' || exit 1
import re
import sys
import tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
missing = []
for req in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
    m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)\s*(.*)$", req)
    name, spec = m.group(1), m.group(2)
    low = re.search(r">=\s*([^,;\s]+)", spec)
    if low is None:
        missing.append(req)
        continue
    print(f"{name}=={low.group(1)}")
if missing:
    sys.exit(f"no lower bound to test: {', '.join(missing)}")
EOF

# ------------------------------------------------------------------ install
"$PY" -m venv "$WORK/venv" || exit 1
VPY=$WORK/venv/bin/python
echo "== installing the floors: $(tr '\n' ' ' < "$WORK/floors.txt")"
if ! "$VPY" -m pip install -q --no-compile -r "$WORK/floors.txt" > "$WORK/pip.txt" 2>&1; then
  grep -v "is ignored: it is neither a file nor a directory" "$WORK/pip.txt" | tail -n 30
  echo "RESULT: the floors do not install together"
  exit 1
fi
# Editable, as the README and CI install it.
"$VPY" -m pip install -q --no-compile --no-deps -e "$ROOT" > "$WORK/pip-project.txt" 2>&1 \
  || { tail -n 20 "$WORK/pip-project.txt"; echo "RESULT: the project does not install"; exit 1; }
# What the floors' own requirements say of each other (not fatal: pins beat their ranges).
"$VPY" -m pip check > "$WORK/pipcheck.txt" 2>&1 || { echo "== pip check:"; cat "$WORK/pipcheck.txt"; }
VERSIONS=$("$VPY" - "$WORK/floors.txt" <<'EOF'
import sys
from importlib.metadata import version

names = [line.split("==")[0].split("[")[0] for line in open(sys.argv[1]) if line.strip()]
print(" ".join(f"{n}=={version(n)}" for n in names))
EOF
)
echo "== installed: $VERSIONS"

# ------------------------------------------------------------------ the unit layer
# PyPI's torchvision is built against PyPI's torch; beside a torch from another build it fails
# to load ('operator torchvision::nms does not exist'). ddpexp imports torchvision only where
# it is used (resnet18, file datasets, transforms), so everything else is still tested at the
# floors, and the tests that imported it and failed run again below at TV_PAIR.
TV_PAIR=${FLOORS_TV_PAIR:-torch==2.14.1 torchvision==0.29.1}
TV_OK=1
"$VPY" -c "import torchvision" > "$WORK/tv.txt" 2>&1 || TV_OK=0
[ $TV_OK = 1 ] || echo "== torchvision does not load beside this torch: $(tail -n 1 "$WORK/tv.txt")"
# A plugin that writes each failed test's id, and whether the test tried to import torchvision
# (when torchvision does not load, only such tests count as failing for that reason).
cat > "$WORK/floors_plugin.py" <<'EOF2'
import os
import sys

_touched = False


class _Watch:
    @staticmethod
    def find_spec(name, path=None, target=None):
        global _touched
        if name.split(".")[0] == "torchvision":
            _touched = True
        return None


sys.meta_path.insert(0, _Watch)


def pytest_runtest_logstart(nodeid, location):
    global _touched
    _touched = False


def pytest_runtest_logreport(report):
    # Under xdist the controller sees each report again: the worker that ran the test writes it.
    ran_here = "PYTEST_XDIST_WORKER" in os.environ or os.environ.get("FLOORS_XDIST") != "1"
    if report.failed and ran_here:
        with open(os.environ["FLOORS_FAILED"], "a") as f:
            f.write(f"{'tv' if _touched else 'other'}\t{report.nodeid}\n")
EOF2
# From the repo root, so that pyproject's pytest settings apply; ddpexp comes from the venv.
FAILED_LOG=$WORK/failed.tsv
unit() {
  ( cd "$ROOT" && env -u PYTHONPATH PYTHONPATH="$WORK" FLOORS_FAILED="$FAILED_LOG" \
      FLOORS_XDIST=$([ "$JOBS" = 0 ] && echo 0 || echo 1) \
      "$VPY" -m pytest -q -n "$JOBS" -p no:cacheprovider -p floors_plugin "$@" )
}
summary() { grep -E "[0-9]+ (passed|failed|error)" "$1" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//'; }
echo "== unit layer (pytest -n $JOBS tests/unit)"
: > "$WORK/failed.tsv"
unit tests/unit > "$WORK/unit.txt" 2>&1
UNIT_RC=$?
UNIT=$(summary "$WORK/unit.txt")
echo "   ${UNIT:-no summary line; the last lines:}"
[ -n "$UNIT" ] || tail -n 20 "$WORK/unit.txt"
sort -u -o "$WORK/failed.tsv" "$WORK/failed.tsv"
TV_IDS=()
if [ $TV_OK = 0 ]; then
  mapfile -t TV_IDS < <(awk -F'\t' '$1 == "tv" {print $2}' "$WORK/failed.tsv" | sort -u)
  OTHER=$(awk -F'\t' '$1 == "other" {print $2}' "$WORK/failed.tsv" | sort -u | wc -l)
  echo "   of the failures, ${#TV_IDS[@]} in tests that import torchvision"
else
  OTHER=$(cut -f2 "$WORK/failed.tsv" | sort -u | wc -l)
fi
awk -F'\t' -v tv="$TV_OK" '$1 == "other" || tv == 1 {print "   FAILED " $2}' "$WORK/failed.tsv" | head -n 40

# ------------------------------------------------------------------ one 2-worker run
# In the scratch dir, so that its outputs and any store it opens land there.
echo "== 2-worker run (python -m ddpexp trainer.procs=2 trainer.max_epochs=1)"
RUN=$WORK/run
RUN_START=$(date +%s)
( cd "$WORK" && env -u PYTHONPATH timeout 300 "$VPY" -m ddpexp trainer.procs=2 trainer.max_epochs=1 \
    "hydra.run.dir=$RUN" ) > "$WORK/run.txt" 2>&1
RUN_RC=$?
RUN_S=$(( $(date +%s) - RUN_START ))
STATUS=$("$VPY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["status"])' \
  "$RUN/metrics.json" 2>/dev/null || echo "no metrics.json")
[ "$STATUS" = completed ] || tail -n 20 "$WORK/run.txt"
echo "   exit $RUN_RC after ${RUN_S}s, metrics.json status: $STATUS"

# ------------------------------------------------------------------ torchvision's tests
TV=""
TV_RC=0
if [ ${#TV_IDS[@]} -gt 0 ]; then
  echo "== the ${#TV_IDS[@]} tests that need torchvision, at $TV_PAIR (the other pins kept)"
  # shellcheck disable=SC2086  # TV_PAIR is a list of requirements
  if "$VPY" -m pip install -q --no-compile $TV_PAIR > "$WORK/pip-tv.txt" 2>&1; then
    FAILED_LOG=$WORK/failed-tv.tsv
    unit "${TV_IDS[@]}" > "$WORK/unit-tv.txt" 2>&1
    TV_RC=$?
    TV=$(summary "$WORK/unit-tv.txt")
    grep -E "^(FAILED|ERROR) " "$WORK/unit-tv.txt" | head -n 30 | sed "s/^/   /"
  else
    TV_RC=1
    TV="install failed"
    grep -v "is ignored: it is neither" "$WORK/pip-tv.txt" | tail -n 10
  fi
  echo "   $TV"
fi

# ------------------------------------------------------------------ result
WALL=$(( $(date +%s) - START ))
OK=0
UNIT_OK=$UNIT_RC
# Failures that were only torchvision's load error count as passed when they pass at TV_PAIR.
[ "$UNIT_RC" != 0 ] && [ "$OTHER" = 0 ] && [ ${#TV_IDS[@]} -gt 0 ] && [ "$TV_RC" = 0 ] && UNIT_OK=0
[ "$UNIT_OK" = 0 ] && [ "$RUN_RC" = 0 ] && [ "$STATUS" = completed ] && OK=1
echo "RESULT $(date -u +%Y-%m-%d) python $("$VPY" -c 'import platform; print(platform.python_version())'):" \
  "unit: ${UNIT:-none}${TV:+ (the ${#TV_IDS[@]} that need torchvision, at $TV_PAIR: $TV)};" \
  "2-worker run: $STATUS in ${RUN_S}s; ${WALL}s in all; $([ $OK = 1 ] && echo PASS || echo FAIL)"
[ $OK = 1 ]
