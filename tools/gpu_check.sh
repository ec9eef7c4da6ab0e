#!/usr/bin/env bash
# The GPU checks (issues #22 and #31: the network weight sync, embedded servers on a GPU of their own), for a
# machine with one NVIDIA GPU (the `device` tool's nvidia-h200 image: python3 with CUDA torch, no network). A few
# minutes; not run in CI (no GPU there).
#
#   bash tools/gpu_check.sh fetch   here, once: the wheels that image lacks (python 3.12) into .whl/ (git-ignored)
#   bash tools/gpu_check.sh         there, with carry [".whl"]: installs them under /tmp/site, builds the tiny and
#                                   ~100M models, runs tools/gpu_check.py (figures on stdout and in $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(trl==1.16.0 transformers==5.25.0 datasets==5.2.0 dill==0.4.0 multiprocess==0.70.18 fastapi==0.165.0
        starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.7.0
        typing-inspection==0.4.2 orjson==3.13.0 submitit==1.5.4 h11==0.16.0)

if [[ "${1:-}" == "fetch" ]]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
  mkdir -p .whl
  for wheel in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$wheel"
  done
  du -sh .whl
  exit 0
fi

export PYTHONUNBUFFERED=1 OUT="${OUT:-/tmp/gpu_check}" PYTHONPATH="/tmp/site:$PWD"
mkdir -p "$OUT" /tmp/site
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'transformers', transformers.__version__, 'trl', trl.__version__)"
python3 tools/make_tiny_model.py /tmp/gpu_models/tiny --seed 0 > /dev/null
python3 tools/make_tiny_model.py /tmp/gpu_models/100m --seed 0 --size 100m > /dev/null
timeout 540 python3 tools/gpu_check.py /tmp/gpu_models "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
