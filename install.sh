#!/usr/bin/env bash
# Creates .venv (if it is not there) and installs the pinned requirements into it.
#   bash install.sh         what the tour needs
#   bash install.sh --dev   and what the tests need
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" -r requirements.txt
"${pip[@]}" --no-build-isolation -r requirements-deepspeed.txt  # builds against the torch installed above
# DeepSpeed compiles its CPU communication op at its first run on a machine without a GPU (about 45 s on 2
# cores, cached in ~/.cache/torch_extensions): once here, not in the middle of a first run. On GPUs: nothing.
# With the environment's ninja, as in an activated environment: another ninja would build it again.
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null ||
    echo "warning: DeepSpeed's CPU op did not compile (a C++ compiler?); step 05 will try again at its first run" >&2
if [ "${1:-}" = "--dev" ]; then
    "${pip[@]}" -r requirements-dev.txt
fi
.venv/bin/python -c "import torch, torchvision; print(f'torch {torch.__version__}, torchvision {torchvision.__version__}, CUDA available: {torch.cuda.is_available()}')"
