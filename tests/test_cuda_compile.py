"""Distributed kernels compile for NVIDIA GPUs (sm_90) with stock Triton; no GPU needed.

Checks the compiled lowering of the ``dl`` primitives in the PTX: the rank context global,
release signals, acquire waits with a watchdog.
"""

import importlib.util
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

import jax_triton_dist.language as dl
from jax_triton_dist.kernels.allreduce import two_shot_all_reduce_kernel
from jax_triton_dist.kernels.attention import (
    attention_bwd_dkdv_kernel,
    attention_bwd_dq_kernel,
    sequence_parallel_attention_kernel,
)
from jax_triton_dist.kernels.exchange import push_exchange_kernel
from jax_triton_dist.kernels.gemm_allreduce import matmul_all_reduce_kernel
from jax_triton_dist.kernels.gemm_collectives import (
    all_gather_matmul_kernel,
    matmul_reduce_scatter_kernel,
)
from jax_triton_dist.kernels.moe import moe_combine_kernel, moe_dispatch_kernel
from jax_triton_dist.kernels.ring_exchange import ring_shift_kernel
from jax_triton_dist.language.device_abi import CTX_SYMBOL
from jax_triton_dist.runtime.cuda_compile import compile_kernel, signature_of

F32, I32, U64 = np.dtype("float32"), np.dtype("int32"), np.dtype("uint64")
BF16 = np.dtype(jnp.bfloat16)


def ptx_of(kernel, pointers, kwargs):
    signature, constexprs = signature_of(kernel, [("pointer", p) for p in pointers], kwargs)
    return compile_kernel(kernel, signature, constexprs).asm["ptx"]


@triton.jit
def shmem_calls_kernel(x_ptr, out_ptr, buf_ptr, sig_ptr, n, BLOCK: tl.constexpr):
    me = dl.my_pe()
    dl.putmem_signal(buf_ptr, x_ptr, n, sig_ptr, 1, "add", (me + 1) % dl.n_pes(), BLOCK)
    dl.signal_wait_until(sig_ptr, "ge", dl.epoch())
    dl.getmem(out_ptr, buf_ptr, n, me, BLOCK)
    dl.quiet()
    dl.barrier_all()


CASES = {
    "ring": (ring_shift_kernel, [F32, F32, F32, I32], {"n": 1000, "BLOCK": 256}),
    "all_gather": (push_exchange_kernel, [BF16, BF16, BF16, I32],
                   {"n": 4096, "SEND_CHUNKS": False, "REDUCE": "none", "BLOCK": 1024}),
    "reduce_scatter": (push_exchange_kernel, [F32, F32, F32, I32],
                       {"n": 999, "SEND_CHUNKS": True, "REDUCE": "sum", "BLOCK": 512}),
    "two_shot": (two_shot_all_reduce_kernel, [F32, F32, F32, F32, I32],
                 {"n": 1000, "chunk": 125, "REDUCE": "max", "BLOCK": 128}),
    "shmem_calls": (shmem_calls_kernel, [F32, F32, F32, U64], {"n": 300, "BLOCK": 128}),
    "all_gather_matmul": (all_gather_matmul_kernel, [BF16, BF16, BF16, BF16, I32, F32, I32],
                          {"m": 1024, "N": 1376, "K": 4096, "R": 1024, "stride_wk": 1376,
                           "stride_wn": 1, "BLOCK_M": 128, "BLOCK_N": 128,
                           "BLOCK_K": 64, "GROUP_M": 8}),
    "matmul_reduce_scatter": (matmul_reduce_scatter_kernel,
                              [BF16, BF16, BF16, BF16, BF16, I32, F32, I32],
                              {"seg": 1024, "N": 4096, "K": 1376, "R": 1024, "stride_wk": 4096,
                               "stride_wn": 1, "BLOCK_M": 128,
                               "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}),
    "moe_dispatch": (moe_dispatch_kernel, [BF16, I32, I32, I32, BF16, I32],
                     {"H": 7168, "S": 1024, "E_local": 4, "C": 2048, "BLOCK_R": 64,
                      "BLOCK_H": 128}),
    "moe_combine": (moe_combine_kernel, [BF16, I32, I32, F32, BF16, I32],
                    {"T": 128, "K": 8, "H": 7168, "BLOCK_T": 32, "BLOCK_H": 128}),
    "matmul_all_reduce": (matmul_all_reduce_kernel, [BF16, BF16, BF16, BF16, I32, F32, I32],
                          {"M": 128, "N": 4096, "K": 1376, "stride_am": 1376, "stride_ak": 1,
                           "stride_bk": 4096, "stride_bn": 1, "BLOCK_M": 64, "BLOCK_N": 128,
                           "BLOCK_K": 64, "GROUP_M": 8}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_compiles_for_sm90(name):
    kernel, pointers, kwargs = CASES[name]
    ptx = ptx_of(kernel, pointers, kwargs)
    assert f".visible .global .align 8 .u64 {CTX_SYMBOL};" in ptx  # set per rank by the runtime
    assert "ld.global.sys.acquire" in ptx  # dl.wait
    if "matmul" in name:
        assert "wgmma.mma_async" in ptx  # the GEMM tiles use Hopper's warpgroup MMA
    assert "release" in ptx and "atom.global.sys" in ptx  # dl.notify
    # The wait's watchdog records a timeout (a compare-and-swap on the error record, the
    # team's abort words) and ends the launch: no trap, which would lose the CUDA context.
    assert "%globaltimer" in ptx and "trap;" not in ptx
    assert "atom.global.acq_rel.sys.cas" in ptx or "atom.acq_rel.sys.global.cas" in ptx or (
        ".cas." in ptx)
    assert "ld.volatile.global" in ptx  # the abort word, read while spinning


@pytest.mark.parametrize("name, use_tma", [
    pytest.param(name, use_tma, marks=() if (name, use_tma) == ("matmul_reduce_scatter", True)
                 else pytest.mark.slow, id=f"{'tma' if use_tma else 'pointers'}-{name}")
    for use_tma in (False, True)
    for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")])
def test_stream_k_forms_of_fused_kernels_compile_for_sm90(name, use_tma):
    """The fused kernels' stream-K forms: the shares' K loops and the whole tiles' on the
    warpgroup MMA, the tiles' counts moved by acquire-release atomics, the op's waits and
    notifies kept."""
    kernel, pointers, kwargs = CASES[name]
    ptx = ptx_of(kernel, pointers,
                 dict(kwargs, PERSISTENT=True, USE_TMA=use_tma, STREAM_K=True))
    assert ptx.count("wgmma.mma_async") >= 2
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert "ld.global.sys.acquire" in ptx and "atom.global.sys" in ptx


def test_new_exchange_and_store_forms_compile_for_sm90():
    """GEMM+AR's two-shot exchange (its sums pushed to the peers, then waited for and
    copied) and AG+GEMM's TMA-store form (its output tiles as bulk tensor stores from
    shared memory) compile for sm_90a with the op's waits and notifies kept."""
    kernel, pointers, kwargs = CASES["matmul_all_reduce"]
    ptx = ptx_of(kernel, pointers, dict(kwargs, PERSISTENT=True, USE_TMA=True, TWO_SHOT=True))
    assert "wgmma.mma_async" in ptx
    assert ptx.count("ld.global.sys.acquire") >= 2  # the owner's waits, the copies' waits
    kernel, pointers, kwargs = CASES["all_gather_matmul"]
    ptx = ptx_of(kernel, pointers, dict(kwargs, PERSISTENT=True, USE_TMA=True, TMA_STORE=True))
    assert "cp.async.bulk.tensor.3d.global.shared" in ptx  # C's [ranks, m, N] descriptor
    assert "wgmma.mma_async" in ptx and "ld.global.sys.acquire" in ptx


def test_flattened_all_gather_matmul_stays_pipelined_for_sm90():
    """AG+GEMM's FLATTEN form (each shard's wait before its tile loop) compiles for sm_90a
    to bulk tensor loads feeding wgmma with the shard waits kept, and its flattened loop
    stays software-pipelined: at least the shared memory of the unflattened loop's stages
    (a flattened loop with a spin loop in its body lost its pipelining: 48 KiB)."""
    _assert_flattened_stays_pipelined("all_gather_matmul")


def test_flattened_matmul_reduce_scatter_stays_pipelined_for_sm90():
    """GEMM+RS's FLATTEN form (the peers' segments in loops that only push) likewise."""
    _assert_flattened_stays_pipelined("matmul_reduce_scatter")


def test_flattened_matmul_all_reduce_stays_pipelined_for_sm90():
    """GEMM+AR's FLATTEN form (one rank's loop of stores) likewise, at a prefill shape."""
    _assert_flattened_stays_pipelined("matmul_all_reduce", M=8192, BLOCK_M=128)


def _assert_flattened_stays_pipelined(name, **shape):
    kernel, pointers, kwargs = CASES[name]
    form = dict(kwargs, PERSISTENT=True, USE_TMA=True, BLOCK_N=256, **shape)
    shared = {}
    for flatten in (False, True):
        signature, constexprs = signature_of(kernel, [("pointer", p) for p in pointers],
                                             dict(form, FLATTEN=flatten))
        compiled = compile_kernel(kernel, signature, constexprs, num_warps=8, num_stages=3)
        ptx = compiled.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.2d.shared" in ptx
        assert "ld.global.sys.acquire" in ptx
        shared[flatten] = compiled.metadata.shared
    assert shared[True] >= shared[False] >= 3 * (128 + 256) * 64 * 2


# Persistent forms of the fused kernels at their overlap-proxy tiles (8 ranks), by name:
# (case, tile and form, warps); the GEMM+AR decode forms run in the default suite
_PIPELINED_FORMS = {
    "ar-one-shot": ("matmul_all_reduce", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128}, 4),
    "ar-two-shot": ("matmul_all_reduce",
                    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "TWO_SHOT": True}, 4),
    "ar-two-shot-tma": ("matmul_all_reduce", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128,
                                              "TWO_SHOT": True, "USE_TMA": True}, 4),
    "rs-pointers": ("matmul_reduce_scatter", {}, 8),
    "rs-sum-tma": ("matmul_reduce_scatter", {"USE_TMA": True, "SUM_TMA": True}, 8),
    "ag-pointers": ("all_gather_matmul", {}, 8),
    "ag-tma": ("all_gather_matmul", {"USE_TMA": True}, 8),
}


@pytest.mark.parametrize("form", [
    pytest.param(form, marks=() if form in ("ar-one-shot", "ar-two-shot") else pytest.mark.slow)
    for form in _PIPELINED_FORMS])
def test_fused_kernels_read_exchanged_data_in_pipelined_loops_for_sm90(form):
    """The persistent fused kernels, 8 ranks, with the runtime's hints: every read of a
    bfloat16 block (operands, gathered shards, the ranks' partials, two-shot's sums) is an
    asynchronous copy of a pipelined loop, no plain load — a plain load in such a loop
    waits on memory once per rank and tile (persistent GEMM+AR's exchange did: ~240 waits
    one after the other per program at the decode tile) — and no spills. GEMM+AR's one-shot
    partials go to the peers from registers, and its sums (two-shot: also the owners'
    copied sums, ``[32, 64]`` halves of its 64x64 tiles) come through such copies."""
    from jax_triton_dist.runtime.cuda_compile import divisibility

    name, tile, warps = _PIPELINED_FORMS[form]
    kernel, pointers, kwargs = CASES[name]
    positional = [("pointer", p) for p in pointers]
    full = dict(kwargs, PERSISTENT=True, **tile)
    signature, constexprs = signature_of(kernel, positional, full)
    compiled = compile_kernel(kernel, signature, constexprs,
                              attrs=divisibility(signature, positional, full),
                              num_warps=warps, num_stages=3, num_ranks=8)
    lines = compiled.asm["ttgir"].splitlines()
    assert not [line for line in lines
                if ("tt.load" in line or "tt.descriptor_load" in line) and "bf16" in line]
    if name == "matmul_all_reduce" and not tile.get("USE_TMA"):
        halves = [line for line in lines
                  if "async_copy_global_to_local" in line and "32x64x!tt.ptr<bf16>" in line]
        assert len(halves) >= (4 if tile.get("TWO_SHOT") else 2)  # each loop's prologue
    assert _ptxas_usage(compiled.asm["ptx"])[1] == 0


def test_all_gather_matmul_subtiled_store_fits_four_stages_for_sm90():
    """AG+GEMM's ``SUBTILE`` form (each output tile stored in two halves through C's
    ``[ranks, m, N]`` descriptor), flattened: 128x256x64 blocks in 4 stages fit an SM's
    227 KiB, the waits and the bulk tensor stores kept."""
    from jax_triton_dist import tiles

    kernel, pointers, kwargs = CASES["all_gather_matmul"]
    form = dict(kwargs, BLOCK_N=256, PERSISTENT=True, USE_TMA=True, TMA_STORE=True,
                SUBTILE=True, FLATTEN=True)
    signature, constexprs = signature_of(kernel, [("pointer", p) for p in pointers], form)
    compiled = compile_kernel(kernel, signature, constexprs, num_warps=8, num_stages=4)
    counted = tiles.gemm_shared_bytes(dict(form, num_stages=4))
    assert counted <= compiled.metadata.shared <= min(counted + 1024, 227 * 1024)
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor.3d.global.shared") >= 2  # the halves
    assert "wgmma.mma_async" in ptx and "ld.global.sys.acquire" in ptx


@pytest.mark.parametrize("name", ["matmul_reduce_scatter", "matmul_all_reduce"])
def test_one_rank_stores_through_a_descriptor_for_sm90(name):
    """GEMM+RS's and GEMM+AR's one-rank loop of stores with ``TMA_STORE`` and ``SUBTILE``
    (flattened, persistent): bulk tensor stores of the output's halves, 128x256x64 in 4
    stages within an SM's 227 KiB, the exchange's waits kept for more ranks."""
    from jax_triton_dist import tiles

    kernel, pointers, kwargs = CASES[name]
    form = dict(kwargs, PERSISTENT=True, USE_TMA=True, FLATTEN=True, TMA_STORE=True,
                SUBTILE=True, BLOCK_M=128, BLOCK_N=256, **({"M": 8192} if "M" in kwargs else {}))
    signature, constexprs = signature_of(kernel, [("pointer", p) for p in pointers], form)
    compiled = compile_kernel(kernel, signature, constexprs, num_warps=8, num_stages=4)
    assert compiled.metadata.shared <= 227 * 1024
    assert compiled.metadata.shared >= tiles.gemm_shared_bytes(dict(form, num_stages=4))
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared") >= 2
    assert "wgmma.mma_async" in ptx and "ld.global.sys.acquire" in ptx


def test_fence_lowers_to_ptx_fence():
    ptx = ptx_of(*CASES["shmem_calls"])
    assert "fence.acq_rel.sys" in ptx


@triton.jit
def block_wait_kernel(flag_ptr):
    dl.wait(flag_ptr + tl.arange(0, 4), 4, "gpu", "acquire", 1)


def test_block_of_flag_pointers_is_cpu_only():
    with pytest.raises(Exception, match="compiled kernels take a scalar pointer"):
        ptx_of(block_wait_kernel, [I32], {})


def test_bad_scope_is_a_compile_error():
    @triton.jit
    def bad_scope_kernel(flag_ptr):
        dl.notify(flag_ptr, 0, 1, "set", "device")

    with pytest.raises(Exception, match=r"scope must be one of \['cta', 'gpu', 'sys'\]"):
        ptx_of(bad_scope_kernel, [I32], {})


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_attention_forward_compiles_to_wgmma(use_tma):
    """The tuned forward's large blocks (128 queries x 64 keys, head_dim 128, 8 warps):
    both products on Hopper's warpgroup MMA; keys and values through bulk tensor copies
    when ``USE_TMA``."""
    signature, constexprs = signature_of(
        sequence_parallel_attention_kernel, [("pointer", p) for p in (BF16,) * 4 + (F32, I32)],
        {"B": 1, "S": 4096, "H": 32, "KVH": 32, "scale": 0.088, "HEAD_DIM": 128,
         "BLOCK_M": 128, "BLOCK_N": 64, "CAUSAL": True, "ZIGZAG": False, "USE_TMA": use_tma})
    ptx = compile_kernel(sequence_parallel_attention_kernel, signature, constexprs,
                         num_warps=8, num_stages=3).asm["ptx"]
    assert ptx.count("wgmma.mma_async") >= 2 and "ld.global.sys.acquire" in ptx
    assert ("cp.async.bulk.tensor" in ptx) == use_tma


@pytest.mark.parametrize("kernel", [attention_bwd_dkdv_kernel, attention_bwd_dq_kernel],
                         ids=["dkdv", "dq"])
def test_attention_backward_compiles_to_wgmma(kernel):
    """The backward kernels at a tuned block (64 x 64, head_dim 128, causal): every product
    on the warpgroup MMA (dK/dV: three, with the scores computed keys-by-queries)."""
    outputs = (F32, F32) if kernel is attention_bwd_dkdv_kernel else (BF16,)
    signature, constexprs = signature_of(
        kernel, [("pointer", p) for p in (BF16, BF16, F32, F32, BF16, BF16, *outputs)],
        {"B": 1, "SQ": 4096, "H": 32, "KVH": 8, "scale": 0.088, "HEAD_DIM": 128,
         "BLOCK_M": 64, "BLOCK_N": 64, "CAUSAL": True, "ZIGZAG": False})
    ptx = compile_kernel(kernel, signature, constexprs, num_warps=4, num_stages=3).asm["ptx"]
    assert ptx.count("wgmma.mma_async") >= (4 if kernel is attention_bwd_dkdv_kernel else 3)


@pytest.mark.parametrize("name", ["all_gather_matmul", "matmul_reduce_scatter",
                                  "matmul_all_reduce"])
def test_fused_kernels_read_nk_weights_through_tma(name):
    """``[N, K]`` weights through tensor descriptors: ``[BLOCK_N, BLOCK_K]`` blocks come
    in by TMA and feed the warpgroup MMA transposed (no transpose through registers)."""
    kernel, pointers, kwargs = CASES[name]
    k = kwargs["K"]
    strides = ({"stride_bk": 1, "stride_bn": k, "B_NK": True} if name == "matmul_all_reduce"
               else {"stride_wk": 1, "stride_wn": k, "W_NK": True})
    ptx = ptx_of(kernel, pointers, {**kwargs, **strides, "USE_TMA": True})
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    """``(registers a thread, bytes of spill stores)`` ptxas reports for the PTX (Triton's
    own ptxas, for sm_90a)."""
    import re
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", f.name,
                                 "-o", "/dev/null"], capture_output=True, text=True,
                                check=True).stderr
    return (int(re.search(r"Used (\d+) registers", report).group(1)),
            int(re.search(r"(\d+) bytes spill stores", report).group(1)))


@pytest.mark.parametrize("block_n", [128, 256])
def test_reduce_scatter_sums_own_tiles_in_registers_for_sm90(block_n):
    """GEMM+RS's ``SUM_TMA`` form (an own tile's partial stays in registers, the peers'
    are read through a 3-D descriptor of the slots) compiles for sm_90a, with the hints the
    runtime gives (``divisibility``), without spills at 128x128 and 128x256 tiles, 8 warps,
    persistent, flattened or not; the other form has no bulk tensor loads of partials."""
    from jax_triton_dist.runtime.cuda_compile import divisibility

    kernel, pointers, kwargs = CASES["matmul_reduce_scatter"]
    positional = [("pointer", p) for p in pointers]
    for flatten in (False, True):
        for sum_tma in (False, True):
            form = dict(kwargs, PERSISTENT=True, USE_TMA=True, FLATTEN=flatten,
                        BLOCK_N=block_n, SUM_TMA=sum_tma)
            signature, constexprs = signature_of(kernel, positional, form)
            ptx = compile_kernel(kernel, signature, constexprs,
                                 attrs=divisibility(signature, positional, form), num_warps=8,
                                 num_stages=3).asm["ptx"]
            assert "ld.global.sys.acquire" in ptx and "wgmma.mma_async" in ptx
            assert ("cp.async.bulk.tensor.3d.shared" in ptx) == sum_tma  # the peers' partials
            if sum_tma:
                assert _ptxas_usage(ptx)[1] == 0


_ABLATION_COMPILE = """
import sys
sys.path.insert(0, sys.argv[1])
import jax.numpy as jnp, numpy as np
import rs_ablation
rs_ablation._patch(sys.argv[2])
from jax_triton_dist.kernels.gemm_collectives import matmul_reduce_scatter_kernel
from jax_triton_dist.runtime.cuda_compile import compile_kernel, signature_of
bf16 = np.dtype(jnp.bfloat16)
pointers = [("pointer", t) for t in [bf16] * 5 + [np.dtype("int32"), np.dtype("float32"),
                                                  np.dtype("int32")]]
for config, warps, stages in rs_ablation.CONFIGS.values():
    kwargs = dict(seg=1024, N=4096, K=1376, R=1024, stride_wk=4096, stride_wn=1,
                  PERSISTENT=True, SUM_TMA=config.get("USE_TMA", False), **config)
    signature, constexprs = signature_of(matmul_reduce_scatter_kernel, pointers, kwargs)
    compile_kernel(matmul_reduce_scatter_kernel, signature, constexprs, num_warps=warps,
                   num_stages=stages, num_ranks=8)
print("compiled")
"""


_SCRIPTS = pathlib.Path(__file__).resolve().parent.parent / "scripts"


def _ablation_variants() -> tuple[str, ...]:
    """``scripts/rs_ablation.py``'s variants (loading the script patches nothing)."""
    spec = importlib.util.spec_from_file_location("rs_ablation", _SCRIPTS / "rs_ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.VARIANTS


@pytest.mark.slow
@pytest.mark.parametrize("variant", _ablation_variants())
def test_rs_ablation_variants_compile_for_sm90(variant, tmp_path):
    """``scripts/rs_ablation.py`` replaces GEMM+RS's exchange helpers with its own; each of
    its variants still compiles for sm_90a in both its configs (a helper whose signature
    changed would break the script only on the GPU machine otherwise). A process each:
    the replacements are global; run outside the source tree, whose unbuilt package would
    shadow the installed one."""
    run = subprocess.run([sys.executable, "-c", _ABLATION_COMPILE, str(_SCRIPTS), variant],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
