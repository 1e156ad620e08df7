#!/usr/bin/env bash
# Open TensorBoard on ddpexp's runs.
#   scripts/tensorboard.sh                 every run and sweep under outputs/
#   scripts/tensorboard.sh latest          the newest sweep (outputs/multirun/<date>/<time>)
#   scripts/tensorboard.sh DIR [ARGS...]   any run dir, sweep dir or tree; ARGS go to tensorboard
# TensorBoard finds each run's tb/ dir under the logdir; in a sweep dir the HParams tab shows
# one row per job with its overrides and metrics.
set -euo pipefail
target=${1:-outputs}
shift || true
if [ "$target" = latest ]; then
  target=$(ls -d outputs/multirun/*/* 2>/dev/null | sort | tail -n 1)
  [ -n "$target" ] || { echo "no sweep under outputs/multirun" >&2; exit 1; }
fi
[ -d "$target" ] || { echo "$target is not a directory" >&2; exit 1; }
echo "TensorBoard on $target" >&2
exec tensorboard --logdir "$target" "$@"
