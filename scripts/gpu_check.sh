#!/usr/bin/env bash
# GPU checks for the triton kernel backend, for a machine with CUDA, triton and fla-core:
# the triton-vs-ref kernel tests, the whole engine on CUDA vs the reference on CPU, and a
# short generation smoke run on CUDA. (`kdaserve bench throughput` has no --device option yet.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
$PY -c "import torch, triton, fla; assert torch.cuda.is_available(); \
print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, \
torch.cuda.get_device_name())"
$PY -m pytest -m gpu tests/kernels/test_triton.py -q -rs
$PY -m kdaserve.cli generate --model tiny --device cuda --dtype bfloat16 --prompt "Hello" \
    --max-tokens 16 --ignore-eos
