#!/usr/bin/env bash
# install.sh VENV - a venv with real SGLang 0.5.23 for this machine's CPU (the tests' second server; `make sglang-venv`).
#
# SGLang pins versions that differ from the project's (transformers 5.19.0, ...), so it lives in a venv of its own.
# 1. torch==2.13.0, the CPU wheel (SGLang's torch 2.14.1 pin is a CUDA build; its CPU path runs on 2.13.0);
# 2. every other package pinned in requirements.txt, with --no-deps: SGLang's metadata asks for CUDA-only packages;
# 3. this folder on the venv's path (a .pth file): the `sgl_kernel` stand-in and `sitecustomize.py`, the two
#    workarounds SGLang needs on a CPU without its kernel wheel and with PyPI's (CUDA) torchvision (see each file);
# 4. a check that the server's modules import, so a broken install fails here, loudly, not in a test.
set -euo pipefail
venv="${1:?usage: install.sh VENV}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps -r "$here/requirements.txt"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
echo "$here" > "$site/open_r1_ext_sglang_cpu.pth"
SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -W ignore -c '
import sys, torch, sglang, sglang.launch_server, sglang.srt.entrypoints.http_server, torchvision, sgl_kernel
print(f"SGLang {sglang.__version__} (torch {torch.__version__}) ready on the CPU in {sys.prefix}")'
