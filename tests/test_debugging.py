"""Debugging options: JTD_DUMP_IR, JTD_LOG, and the intra-kernel timeline (CPU backend; the
timeline's compiled form is checked in PTX)."""

import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist.kernels.ring_exchange import ring_shift_kernel
from jax_triton_dist.runtime import call_site
from jax_triton_dist.runtime.cuda_compile import compile_kernel, signature_of


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def _ring(size=64):
    def body(v):
        return jtd.triton_call(
            ring_shift_kernel, v, n=size, out_shape=jax.ShapeDtypeStruct((size,), v.dtype),
            workspace=[jtd.Workspace((2, size), v.dtype), jtd.Workspace((2,), jnp.int32)],
            grid=(1,), axis_name="x", BLOCK=64)
    return body


def _run_ring(n, size=64):
    f = jax.jit(jax.shard_map(_ring(size), mesh=_mesh(n), in_specs=P("x"), out_specs=P("x")))
    x = jnp.arange(n * size, dtype=jnp.float32)
    out = f(x)
    np.testing.assert_array_equal(out, jnp.roll(x.reshape(n, size), 1, 0).reshape(-1))
    return f, x


# ---------------------------------------------------------------------------
# JTD_DUMP_IR
# ---------------------------------------------------------------------------


def test_dump_ir_writes_every_stage_per_site_and_device(tmp_path, monkeypatch):
    monkeypatch.setenv("JTD_DUMP_IR", str(tmp_path))
    jax.clear_caches()
    _run_ring(2, size=48)
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert len(folders) == 2 and all(f.startswith("ring_shift_kernel.site") for f in folders)
    assert {f.rsplit(".", 1)[1] for f in folders} == {"device0", "device1"}
    for folder in tmp_path.iterdir():
        names = {p.name for p in folder.iterdir()}
        assert {"kernel.ttir", "kernel.ttgir", "kernel.llir", "kernel.ptx", "kernel.cubin",
                "metadata.json"} <= names
        assert "tt.func public @ring_shift_kernel" in (folder / "kernel.ttir").read_text()
        assert ".entry ring_shift_kernel" in (folder / "kernel.ptx").read_text()
        meta = json.loads((folder / "metadata.json").read_text())
        assert meta["kernel"] == "ring_shift_kernel" and meta["num_ranks"] == 2
        assert meta["constexprs"] == {"BLOCK": 64} and meta["grid"] == [1]
        assert meta["target"].startswith("cuda")
    jax.clear_caches()


def test_dump_ir_must_name_a_directory(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("JTD_DUMP_IR", str(afile))
    with pytest.raises(ValueError, match="JTD_DUMP_IR=.* is a file; expected a directory"):
        jax.jit(jax.shard_map(_ring(), mesh=_mesh(2), in_specs=P("x"), out_specs=P("x"))
                ).lower(jnp.zeros(128))


# ---------------------------------------------------------------------------
# JTD_LOG
# ---------------------------------------------------------------------------


def test_log_launch_gives_a_line_per_plan_and_launch(monkeypatch, caplog):
    monkeypatch.setenv("JTD_LOG", "launch")
    jax.clear_caches()
    with caplog.at_level(logging.INFO, logger="absl"):
        f, x = _run_ring(4)
        f(x).block_until_ready()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("jtd ")]
    plans = [line for line in lines if line.startswith("jtd plan kernel=ring_shift_kernel")]
    launches = [line for line in lines if line.startswith("jtd launch kernel=ring_shift_kernel")]
    assert len(plans) == 4 and len(launches) == 8
    assert {f"rank={r}" for r in range(4)} <= {part for line in plans for part in line.split()}
    assert all("num_ranks=4" in line and "team=(0,1,2,3)" in line for line in launches)
    assert sum("epoch=2" in line for line in launches) == 4
    jax.clear_caches()


def test_log_rejects_unknown_categories(monkeypatch):
    monkeypatch.setenv("JTD_LOG", "launch,verbose")
    with pytest.raises(ValueError, match=r"JTD_LOG='launch,verbose': unknown categories "
                                         r"\['verbose'\]"):
        jax.jit(jax.shard_map(_ring(), mesh=_mesh(2), in_specs=P("x"), out_specs=P("x"))
                ).lower(jnp.zeros(128))


# ---------------------------------------------------------------------------
# The timeline
# ---------------------------------------------------------------------------


def _check_trace(trace, pes):
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(names) == pes
    programs = [e for e in events if e.get("cat") == "program"]
    waits = [e for e in events if e.get("cat") == "wait"]
    notifies = [e for e in events if e.get("cat") == "notify"]
    assert programs and waits and notifies
    for e in programs + waits:
        assert e["ph"] == "X" and e["dur"] >= 0
    for w in waits:  # every wait lies inside a program of its track
        assert any(p["pid"] == w["pid"] and p["tid"] == w["tid"] and p["ts"] <= w["ts"]
                   and w["ts"] + w["dur"] <= p["ts"] + p["dur"] + 1e-3 for p in programs)
    return programs, waits, notifies


def test_timeline_of_a_fused_op_has_a_track_per_rank_and_program(tmp_path):
    mesh = _mesh(4)
    f = jax.jit(jax.shard_map(lambda x, w: jtd.all_gather_matmul(x, w, "x"), mesh=mesh,
                              in_specs=(P("x"), P()), out_specs=P(None, None), check_vma=False))
    x = jnp.ones((4 * 16, 32), jnp.float32)
    w = jnp.ones((32, 16), jnp.float32)
    path = tmp_path / "trace.json"
    with jtd.timeline.record(str(path)) as rec:
        f(x, w).block_until_ready()
        f(x, w).block_until_ready()
    trace = json.loads(path.read_text())
    programs, waits, notifies = _check_trace(trace, [0, 1, 2, 3])
    assert {e["args"]["epoch"] for e in programs} == {1, 2}
    assert {e["args"]["kernel"] for e in programs} == {"all_gather_matmul_kernel"}
    per_pe = {pe: len({e["tid"] for e in programs if e["pid"] == pe}) for pe in range(4)}
    assert len(set(per_pe.values())) == 1  # every rank ran the same programs
    assert {e["args"]["peer"] for e in notifies} <= {0, 1, 2, 3}
    assert rec.dropped == 0 and len(rec.events) > 0
    # Sites traced after the block are not timed.
    f2 = jax.jit(jax.shard_map(lambda x, w: jtd.all_gather_matmul(x, w, "x"), mesh=mesh,
                               in_specs=(P("x"), P()), out_specs=P(None, None),
                               check_vma=False))
    f2(x, w).block_until_ready()
    assert all(site.timeline == 0 for site in call_site._sites.values())


def test_timeline_shows_peers_waiting_for_a_straggler(straggler):
    straggler(jax.devices()[2].id, 0.3)
    with jtd.timeline.record() as rec:
        f, x = _run_ring(4)  # the first run's team join absorbs the delay
        f(x).block_until_ready()  # the second run's waits show it
    trace = rec.trace()
    _, waits, _ = _check_trace(trace, [0, 1, 2, 3])
    longest = {pe: max(w["dur"] for w in waits if w["pid"] == pe and w["args"]["epoch"] == 2)
               for pe in range(4)}
    assert longest[3] > 2e5  # µs: rank 3 waits for rank 2's data
    assert longest[2] < longest[3]
    # The overlap benchmark's reading of the same events (its latest epoch: the second run)
    from jax_triton_dist.bench.overlap import timeline_summary

    summary = timeline_summary(rec.events)
    assert summary["wait_max_us"] == pytest.approx(longest[3], rel=1e-3)
    assert 0 <= summary["wait_us"] < summary["wait_max_us"] <= summary["span_us"]
    assert 0 < summary["program_us"] <= summary["span_us"] and summary["skew_us"] >= 0


def test_timeline_counts_events_beyond_its_capacity(monkeypatch):
    monkeypatch.setenv("JTD_TIMELINE_EVENTS", "2")
    with jtd.timeline.record() as rec:
        _run_ring(2)
    assert rec.dropped > 0
    assert rec.trace()["otherData"]["dropped_events"] == rec.dropped


def test_timeline_environment_variable_writes_the_trace_at_exit(tmp_path):
    path = tmp_path / "exit_trace.json"
    script = (
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from jax.sharding import Mesh, PartitionSpec as P\n"
        "import jax_triton_dist as jtd\n"
        "mesh = Mesh(np.array(jax.devices()[:2]), ('x',))\n"
        "f = jax.jit(jax.shard_map(lambda v: jtd.all_reduce(v, 'x'), mesh=mesh,"
        " in_specs=P('x'), out_specs=P()))\n"
        "f(jnp.ones((2, 256))).block_until_ready()\n")
    env = dict(os.environ, JTD_TIMELINE=str(path))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    _check_trace(json.loads(path.read_text()), [0, 1])


def test_timed_kernel_with_defaulted_parameters_compiles():
    """The fused kernels have defaulted constexprs (PERSISTENT, STREAM_K, ...): Triton
    evaluates every default of the timed wrapper's source, so they must be written there
    as it can read them (before, any timed fused kernel failed to compile for the GPU)."""
    from jax_triton_dist.kernels.gemm_collectives import all_gather_matmul_kernel

    bf16, f32, i32 = np.dtype(jnp.bfloat16), np.dtype("float32"), np.dtype("int32")
    sig, constexprs = signature_of(
        all_gather_matmul_kernel, [("pointer", t) for t in (bf16, bf16, bf16, bf16, i32, f32,
                                                            i32)],
        {"m": 1024, "N": 1376, "K": 4096, "R": 1024, "stride_wk": 1376, "stride_wn": 1,
         "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "PERSISTENT": True})
    timed = compile_kernel(all_gather_matmul_kernel, sig, constexprs, timeline=(4096, 64),
                           num_warps=8)
    assert timed.metadata.name == "all_gather_matmul_kernel__jtd_timed"
    assert "wgmma.mma_async" in timed.asm["ptx"]


def test_compiled_timeline_is_free_when_off():
    f32, i32 = np.dtype("float32"), np.dtype("int32")
    sig, constexprs = signature_of(ring_shift_kernel, [("pointer", t) for t in (f32, f32, f32,
                                                                                i32)],
                                   {"n": 1000, "BLOCK": 256})
    plain = compile_kernel(ring_shift_kernel, sig, constexprs)
    timed = compile_kernel(ring_shift_kernel, sig, constexprs, timeline=(4096, 16))
    untimed_again = compile_kernel(ring_shift_kernel, sig, constexprs)
    assert plain.asm["ptx"] == untimed_again.asm["ptx"]
    assert timed.metadata.name == "ring_shift_kernel__jtd_timed"
    # The watchdog of each wait reads %globaltimer already; the timeline adds a read per
    # event (program start and end, the wait's start and end, the notify).
    assert timed.asm["ptx"].count("%globaltimer") > plain.asm["ptx"].count("%globaltimer") + 3
    assert "atom.global.gpu.relaxed.add" in timed.asm["ptx"] or "atom.relaxed" in timed.asm[
        "ptx"] or "atom.global" in timed.asm["ptx"]
