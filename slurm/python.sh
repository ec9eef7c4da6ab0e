#!/usr/bin/env bash
# python.sh - the interpreter slurm/*.slurm run open_r1_ext with; execs it with the arguments given.
#
# Usage: slurm/python.sh -m open_r1_ext.launch.jobs ...   (the last line of each slurm/*.slurm)
#
# The first of these that has open_r1_ext and TRL: $PYTHON when set (then only it), else this repository's
# .venv/bin/python, else python3 and python on PATH. So `sbatch slurm/grpo.slurm RECIPE` from the repository root
# needs nothing activated once `make venv` (or `python3 -m venv .venv && .venv/bin/pip install -e .`) has run.
# When none has them, it says which it tried and how to fix it, and exits 2.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${PYTHON:-}" ]; then candidates=("$PYTHON"); else candidates=("$repo/.venv/bin/python" python3 python); fi
check='import importlib.util as u, sys; sys.exit(0 if u.find_spec("open_r1_ext") and u.find_spec("trl") else 3)'
tried=()
for candidate in "${candidates[@]}"; do
    if ! command -v "$candidate" >/dev/null 2>&1; then
        tried+=("$candidate (not found)")
    elif "$candidate" -c "$check" >/dev/null 2>&1; then
        exec "$candidate" "$@"
    else
        tried+=("$(command -v "$candidate") (cannot import open_r1_ext and trl)")
    fi
done
{
    echo "slurm/python.sh: no Python interpreter with open_r1_ext and its dependencies (trl) was found; tried:"
    printf '  %s\n' "${tried[@]}"
    echo "Fix: create the project's environment on the shared file system, in $repo:"
    echo "  make venv   (or: python3 -m venv .venv && .venv/bin/pip install -e .)"
    echo "or point PYTHON at an interpreter that has it: PYTHON=/path/to/python sbatch slurm/grpo.slurm RECIPE"
} >&2
exit 2
