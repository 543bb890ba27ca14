#!/usr/bin/env bash
# Sets up a virtual environment (first run only) and runs the main job or the tests.
#
#   bash run.sh            # the main job: fine-tune a tiny Flux (LoRA) with cp=2 on 2 CPU processes
#   bash run.sh test       # the test suite
#   bash run.sh demo       # CP forward/backward of a tiny transformer checked against one process
#
# Extra arguments go to the job (LightningCLI options, cp_lightning.demo) or to pytest.
# VENV=path picks the environment.
set -euo pipefail
cd "$(dirname "$0")"

VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating virtual environment $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"

# torch first, pinned: this machine serves torch 2.13.0 as a local CPU wheel; an unpinned torch
# (asked for directly or by a dependency) would pull a multi-GB CUDA build.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "== installing torch 2.13.0 (CPU)"
  "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi

# The project and its dependencies, again only when pyproject.toml changed.
stamp="$VENV/.cp_lightning-installed"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "== installing cp-lightning and its dependencies"
  "$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
  echo "$want" > "$stamp"
fi

export OMP_NUM_THREADS=1
job=main
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then job=$1; shift; fi
case "$job" in
  main) exec "$PY" -m recipes.flux fit --config configs/tiny_flux_cp2.yaml "$@" ;;
  demo) exec "$VENV/bin/torchrun" --nproc-per-node 2 -m cp_lightning.demo "$@" ;;
  test) exec "$PY" -m pytest "$@" ;;
  *) echo "usage: bash run.sh [main|test|demo] [args...]" >&2; exit 2 ;;
esac
