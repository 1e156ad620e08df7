#!/usr/bin/env bash
# The GPU checks in one go, on a machine with CUDA and no network: make the project importable
# (Hydra from the wheels in .whl/ when they are there, else the installed one), run the tests
# marked gpu (NCCL DDP, DataParallel, FSDP, and tensor parallelism, trainer.gpus=N trainer.tp=N
# alone and inside fsdp, where there are 2 GPUs or more), run the benchmark's GPU cases (plain
# loop vs ddpexp vs Lightning where installed;
# fp32 and bf16; DDP on one rank over NCCL, DataParallel and FSDP in bf16; torch.compile on and
# off), and
# write a markdown table and the raw figures.
#
#   bash scripts/gpu_check.sh             # on one GPU: about 6-8 minutes on an H200
#   bash scripts/gpu_check.sh --dry-run   # on the CPU: the same steps, tiny, skipping what
#                                         # needs CUDA (tests/e2e/test_gpu_check.py runs it)
#
# Output folder: $OUT if set, else ./gpu_check_out: gpu_check.md (the table), bench.json and
# bench_compile.json (every run's figures), pytest.txt, env.txt.
# Settings (environment): PYTHON (default python3), GPU_CHECK_WHEELS (default .whl), and
# GPU_CHECK_BUDGET_S (default 470): the steps share this many seconds, each one is stopped
# when they are spent, and what finished is still written.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$ROOT/gpu_check_out}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
mkdir -p "$OUT_DIR" || exit 1
STATUS=0

# ------------------------------------------------------------------ install, without a network
# The project runs from src/ (its Hydra plugin included); Hydra and its two dependencies are
# pure-Python wheels, installed into a private folder so that nothing on the machine changes.
SITE=""
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/ddpexp-site.XXXXXX")
  if ! "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl; then
    echo "gpu_check: could not install the wheels in $WHEELS" >&2
    exit 1
  fi
fi
export PYTHONPATH="${SITE:+$SITE:}$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import hydra, omegaconf" 2> /dev/null; then
  echo "gpu_check: Hydra is not importable: put the hydra-core, omegaconf and" \
       "antlr4-python3-runtime wheels in $WHEELS, or install them" >&2
  exit 1
fi

"$PY" - > "$OUT_DIR/env.txt" 2>&1 <<'EOF'
import platform, torch, hydra
print("python", platform.python_version(), "| torch", torch.__version__, "| hydra", hydra.__version__)
print("cuda", torch.cuda.is_available(), torch.version.cuda,
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for name in ("lightning", "pytorch_lightning"):
    try:
        print(name, __import__(name).__version__)
        break
    except ImportError:
        pass
else:
    print("lightning: not installed")
EOF
if [ "$DRY" = 0 ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check: CUDA is not available here; run with --dry-run on a CPU machine" >&2
  exit 1
fi

START=$SECONDS
# step_limit CAP: the seconds a step may take: CAP, or what is left of the budget if less.
step_limit() {
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt "$1" ]; then echo $((left > 10 ? left : 10)); else echo "$1"; fi
}
# run_step NAME CAP CMD...: run, note a failure or a timeout, carry on.
run_step() {
  local name=$1 cap
  cap=$(step_limit "$2")
  shift 2
  local t0=$SECONDS rc=0
  timeout --kill-after=10 "$cap" "$@" || rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "$name: stopped after ${cap}s (time budget)" >> "$OUT_DIR/steps.txt"
    STATUS=1
  elif [ "$rc" != 0 ]; then
    echo "$name: exit $rc" >> "$OUT_DIR/steps.txt"
    STATUS=1
  else
    echo "$name: ok in $((SECONDS - t0))s" >> "$OUT_DIR/steps.txt"
  fi
}
: > "$OUT_DIR/steps.txt"

# ------------------------------------------------------------------ the checks
# The benchmark first (no torch.compile: the quick part), then the tests, then the compiled
# case, so that a slow compilation cannot cost the other figures.
if [ "$DRY" = 1 ]; then
  BENCH=(--gpu --dry-run --peers --timeout 120)
  COMPILE=()  # torch.compile's GPU path needs CUDA: gpu_cases() leaves it out of a dry run
else
  BENCH=(--gpu --peers --repeats "${GPU_CHECK_REPEATS:-1}" --timeout 150
         --cases gpu-fp32 gpu-bf16 gpu-dp gpu-fsdp)
  COMPILE=(--gpu --peers --repeats 1 --timeout 200 --cases gpu-compile)
fi
run_step bench 240 "$PY" scripts/bench.py "${BENCH[@]}" --json "$OUT_DIR/bench.json" \
  > "$OUT_DIR/bench.md" 2> "$OUT_DIR/bench.log"
# One process (-o addopts: the GPU machine's pytest may have no pytest-xdist, and the GPU
# tests share one device). Only the files that mark tests gpu are collected: collecting the
# whole suite imports every test module for nothing.
mapfile -t GPU_TESTS < <(grep -rlE "mark\.gpu|pytestmark.*gpu" tests --include="*.py" | sort)
run_step "pytest -m gpu" 200 "$PY" -m pytest -o addopts="-ra --strict-markers" -m gpu -q \
  -p no:cacheprovider --timeout 180 "${GPU_TESTS[@]:-tests}" \
  > "$OUT_DIR/pytest.txt" 2>&1
if [ "${#COMPILE[@]}" -gt 0 ]; then
  run_step "bench compile" 240 "$PY" scripts/bench.py "${COMPILE[@]}" \
    --json "$OUT_DIR/bench_compile.json" > "$OUT_DIR/bench_compile.md" 2> "$OUT_DIR/bench_compile.log"
fi

# ------------------------------------------------------------------ the report
{
  echo "# GPU check$([ "$DRY" = 1 ] && echo " (dry run on the CPU: CUDA paths skipped)")"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2> /dev/null || echo unknown)"
  echo
  sed 's/^/    /' "$OUT_DIR/env.txt"
  echo
  echo "## Steps"
  echo
  sed 's/^/- /' "$OUT_DIR/steps.txt"
  echo
  echo "## pytest -m gpu"
  echo
  echo "    $(tail -n 1 "$OUT_DIR/pytest.txt" 2> /dev/null)"
  for part in bench bench_compile; do
    [ -s "$OUT_DIR/$part.md" ] || continue
    echo
    echo "## scripts/bench.py ($part)"
    echo
    cat "$OUT_DIR/$part.md"
  done
} > "$OUT_DIR/gpu_check.md"
cat "$OUT_DIR/gpu_check.md"
[ -n "$SITE" ] && rm -rf "$SITE"
exit $STATUS
