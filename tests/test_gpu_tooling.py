"""GPU tier of the tools: doctor, JTD_LOG / JTD_DUMP_IR through the CUDA launcher, the
timeline from the GPU clock (through JAX at world size 1, a fused op's, 4 ranks on one GPU,
the overlap benchmark's waits part), stress (skipped without a GPU)."""

import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_support import have_gpu
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist import one_gpu
from jax_triton_dist.kernels.ring_exchange import ring_shift_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs a GPU")]


def _ring_call():
    mesh = Mesh(np.array(jax.devices("gpu")), ("x",))
    size = 4096

    def body(v):
        return jtd.triton_call(
            ring_shift_kernel, v, n=size, out_shape=jax.ShapeDtypeStruct((size,), v.dtype),
            workspace=[jtd.Workspace((2, size), v.dtype), jtd.Workspace((2,), jnp.int32)],
            grid=(1,), axis_name="x", BLOCK=1024)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return f, jnp.arange(mesh.size * size, dtype=jnp.float32)


def test_doctor_on_the_gpu():
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-m", "jax_triton_dist", "doctor"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[ok  ] libcuda" in result.stdout and "platform                   gpu:" in result.stdout
    assert "[ok  ] extension _cuda" in result.stdout
    assert "[ok  ] triton_call ring kernel" in result.stdout


def test_log_and_dump_through_the_cuda_launcher(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JTD_LOG", "launch,compile")
    monkeypatch.setenv("JTD_DUMP_IR", str(tmp_path))
    jax.clear_caches()
    f, x = _ring_call()
    with caplog.at_level(logging.INFO, logger="absl"):
        for _ in range(3):
            out = f(x)
        out.block_until_ready()
    np.testing.assert_array_equal(out, x)  # one rank: its own data comes back
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("jtd plan kernel=ring_shift_kernel") for line in lines) == 1
    assert sum(line.startswith("jtd compile kernel=ring_shift_kernel") for line in lines) == 1
    launches = [line for line in lines if line.startswith("jtd launch kernel=ring_shift_kernel")]
    assert [line.split("epoch=")[1].split()[0] for line in launches] == ["1", "2", "3"]
    (folder,) = list(tmp_path.iterdir())
    assert folder.name.endswith(".device0")
    assert {"kernel.ptx", "kernel.cubin", "metadata.json"} <= {p.name for p in folder.iterdir()}
    jax.clear_caches()


def test_timeline_from_the_gpu_clock_through_jax(tmp_path):
    path = tmp_path / "gpu_trace.json"
    with jtd.timeline.record(str(path)) as rec:
        f, x = _ring_call()
        for _ in range(3):
            f(x).block_until_ready()
    assert {e["clock"] for e in rec.events} == {"gpu globaltimer"}
    kinds = [e["kind"] for e in rec.events]
    assert kinds.count("PROGRAM_START") == kinds.count("PROGRAM_END") == 3
    assert kinds.count("WAIT_START") == kinds.count("WAIT_END") == 3
    assert kinds.count("NOTIFY") == 3
    trace = json.loads(path.read_text())
    programs = [e for e in trace["traceEvents"] if e.get("cat") == "program"]
    assert len(programs) == 3 and all(e["dur"] > 0 for e in programs)


def test_timeline_of_a_fused_op_through_jax():
    """A timed fused kernel (defaulted constexprs) compiles and records on the GPU."""
    mesh = Mesh(np.array(jax.devices("gpu")[:1]), ("x",))
    f = jax.jit(jax.shard_map(lambda x, w: jtd.all_gather_matmul(x, w, "x"), mesh=mesh,
                              in_specs=(P("x"), P()), out_specs=P("x"), check_vma=False))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, 64)), jnp.bfloat16)
    with jtd.timeline.record() as rec:
        out = f(x, w).block_until_ready()
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(x, np.float32) @ np.asarray(w, np.float32),
                               rtol=2e-2, atol=2e-1)
    assert {e["kernel"] for e in rec.events} == {"all_gather_matmul_kernel"}
    kinds = [e["kind"] for e in rec.events]
    assert kinds.count("PROGRAM_START") == kinds.count("PROGRAM_END") > 0


def test_overlap_waits_part_on_the_gpu():
    """``bench overlap --parts waits`` at two ranks: every op and its GEMM read off the
    timeline, nothing dropped."""
    from jax_triton_dist.bench import overlap

    rows = overlap.waits([2])
    assert [(r["op"], r["form"]) for r in rows] == [
        (op, form) for op in overlap.SHAPES for form in overlap.FORMS[op]]
    for row in rows:
        assert "error" not in row, row["error"]
        assert row["dropped_events"] == 0
        assert 0 < row["program_us"] <= row["span_us"] and row["gemm_span_us"] > 0
        assert 0 <= row["wait_us"] <= row["wait_max_us"] <= row["span_us"]


def test_timeline_of_four_ranks_sharing_the_gpu():
    world, n = 4, 1 << 16
    x = np.random.default_rng(0).standard_normal((3, world, n)).astype(np.float32)
    with jtd.timeline.record() as rec:
        out = one_gpu.run_ranks(
            ring_shift_kernel, world, lambda c, r: [x[c, r]], [((n,), np.float32)],
            [((2, n), np.float32), ((2,), np.int32)], grid=(1,),
            kwargs={"n": n, "BLOCK": 1024}, calls=3)
    for c in range(3):
        for r in range(world):
            np.testing.assert_array_equal(out[c][r][0], x[c, (r - 1) % world])
    trace = rec.trace()
    pids = {e["pid"] for e in trace["traceEvents"] if e.get("cat") == "program"}
    assert pids == set(range(world))
    programs = [e for e in trace["traceEvents"] if e.get("cat") == "program"]
    assert len(programs) == 3 * world
    # The ranks ran concurrently: in each call, some two ranks' programs overlap in time.
    by_epoch = {}
    for e in programs:
        by_epoch.setdefault(e["args"]["epoch"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_epoch.values():
        spans.sort()
        assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))


def test_stress_on_the_gpu():
    result = subprocess.run([sys.executable, "-m", "jax_triton_dist.stress", "all", "--iters",
                             "3", "--platform", "gpu"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "summary" in result.stdout
