#!/usr/bin/env bash
# The GPU checks as one bounded run on a CUDA machine with no package index (the device tool's
# H200): the GPU tests, then bench/gpu.py. Wheels the image lacks travel in .whl/ (flashinfer-python
# and what it imports, structlog, pytest-asyncio; see docs/benchmarks.md "On a GPU"). Outputs go
# to $OUT (default ./gpu-out). FlashInfer compiles its kernels on first use (JIT, sm_90 only here).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc;
  python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'flashinfer', flashinfer.__version__)"; } 2>&1 | tee "$OUT/env.txt"
timeout "${TESTS_S:-330}" python3 -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
timeout "${BENCH_S:-200}" python3 bench/gpu.py --arch "${ARCH:-qwen3_moe}" --batches "${BATCHES:-1,8,32}" --repeats 2 --long 2048 \
  --out "$OUT/gpu.json" 2>&1 | grep -v "kernel_choice\|shard_loaded" | tee "$OUT/gpu_bench.log"
