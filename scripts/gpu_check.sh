#!/usr/bin/env bash
# One command for the GPU machine (device tool): build the project with the machine's own
# packages, run the GPU tier and the compile tests, run the GPU benchmarks; logs and JSON
# go to $OUT (or ./gpu_out): setup.log, tests.log, checks.log, bench.log, bench_*.json.
#
#   GPU_CHECK_BENCH="single-gpu collectives gemm overlap attention"   benchmark suites
#                                                    (default: all; "" runs none)
#   GPU_CHECK_BENCH_ARGS_<suite>="..."               replaces a suite's arguments (suite
#                                                    name with - as _, e.g. _single_gpu)
#   GPU_CHECK_TESTS="..."                            pytest selection (default: GPU tier)
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export JTD_WAIT_TIMEOUT=${JTD_WAIT_TIMEOUT:-20}
BENCH=${GPU_CHECK_BENCH-single-gpu collectives gemm overlap attention}
TESTS=${GPU_CHECK_TESTS-tests/test_gpu.py tests/test_gpu_faults.py tests/test_gpu_tooling.py tests/test_gpu_tuning.py tests/test_gpu_attention.py tests/test_one_gpu.py tests/test_shmem.py tests/test_nvshmem.py tests/test_cuda_compile.py tests/test_device_abi.py}
# The autotuner's cache lives in $OUT (fetched with the results; a fresh machine has none).
export JTD_AUTOTUNE_CACHE=${JTD_AUTOTUNE_CACHE:-$OUT/autotune.json}

# Build-time packages the machine's image lacks travel as wheels in .whl/ (the device tool's
# `carry`; seen 2026-12-07: no scikit-build-core, no pathspec). Fetch them here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       scikit-build-core==1.1.2 pathspec==0.12.1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/jtd-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/jtd-site${PYTHONPATH:+:$PYTHONPATH}
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"
  echo "== build"
  start=$(date +%s)
  python3 -m pip install --no-build-isolation --no-deps -q . || exit 1
  echo "built in $(( $(date +%s) - start )) s"
} >"$OUT/setup.log" 2>&1 || { tail -50 "$OUT/setup.log"; exit 1; }
cat "$OUT/setup.log" | head -5

# Run from outside the source tree so the installed package (with its extensions) is used.
cd "$OUT"
echo "== GPU tier: $TESTS"
tests_rc=0
if [ -n "$TESTS" ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -q -rs -m "" -p no:cacheprovider $(for t in $TESTS; do echo "$SRC/$t"; done) 2>&1 \
    | tee "$OUT/tests.log" | tail -30
  tests_rc=${PIPESTATUS[0]}
fi

{
  echo "== demo: TP MLP on the GPU(s)"
  python3 "$SRC/examples/tp_mlp.py" 2>&1 | tail -4
  echo "== SASS of the bf16 GEMM tile (expect HGMMA)"
  python3 - <<'PY'
import numpy as np, jax.numpy as jnp
from jax_triton_dist.kernels.gemm import matmul_kernel
from jax_triton_dist.runtime import cuda_compile
pos = [("pointer", np.dtype(jnp.bfloat16))] * 3
kw = dict(M=8192, N=8192, K=8192, stride_am=8192, stride_ak=1, stride_bk=8192, stride_bn=1,
          stride_cm=8192, stride_cn=1, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8)
sig, cx = cuda_compile.signature_of(matmul_kernel, pos, kw)
k = cuda_compile.compile_kernel(matmul_kernel, sig, cx, attrs=cuda_compile.divisibility(sig, pos, kw),
                                num_warps=8, num_stages=3)
open("/tmp/gemm_bf16.cubin", "wb").write(k.asm["cubin"])
PY
  CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
  echo "HGMMA instructions: $("$CUOBJDUMP" -sass /tmp/gemm_bf16.cubin | grep -c HGMMA)"
} 2>&1 | tee "$OUT/checks.log"

for suite in $BENCH; do
  echo "== bench $suite"
  case $suite in
    collectives) args="--iters 20" ;;
    gemm) args="--iters 20" ;;
    overlap) args="--iters 10" ;;
    *) args="--iters 20" ;;
  esac
  override="GPU_CHECK_BENCH_ARGS_${suite//-/_}"
  args=${!override-$args}
  # shellcheck disable=SC2086
  platform="--platform gpu"
  [ "$suite" = overlap ] && platform=""  # always on the GPU
  python3 -m jax_triton_dist.bench "$suite" $platform $args \
    --json "$OUT/bench_${suite//-/_}.json" 2>&1 | tee -a "$OUT/bench.log" | tail -40
done
exit "$tests_rc"
