"""The benchmark suites run (smoke test; speed is never asserted)."""

import itertools
import json

import numpy as np
import pytest

from jax_triton_dist.bench import __main__ as bench
from jax_triton_dist.bench import collectives


def test_collectives_benchmark_rows():
    rows = collectives.run([1024], ranks=2, dtype="float32", iters=1, platform="cpu")
    assert [r["op"] for r in rows] == list(collectives.OPS)
    for row in rows:
        assert row["ours_us"] > 0 and row["lax_us"] > 0 and row["busbw_gbps"] > 0
        assert row["bytes"] >= 1024 - 16


def test_collectives_benchmark_cli_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    bench.main(["collectives", "--sizes", "512", "--ranks", "2", "--iters", "1",
                "--json", str(path), "--platform", "cpu"])
    printed = capsys.readouterr().out
    assert "all_reduce_two_shot" in printed and "busbw GB/s" in printed
    data = json.loads(path.read_text())
    assert data["suite"] == "collectives" and data["machine"]["platform"] == "cpu"
    assert len(data["results"]) == len(collectives.OPS)


@pytest.mark.slow
def test_gemm_benchmark_times_every_config_on_cpu(tmp_path):
    from jax_triton_dist import tiles
    from jax_triton_dist.bench import gemm

    path = tmp_path / "gemm.json"
    bench.main(["gemm", "--shapes", "32x48x16", "--iters", "1", "--platform", "cpu",
                "--json", str(path)])
    (row,) = json.loads(path.read_text())["results"]
    assert row["shape"] == "32x48x16" and row["timing"] == "wall"  # no device kernels on CPU
    space = tiles.gemm_tile_configs(32, 48, 16)
    assert any(c.get("FLATTEN") for c in space)
    assert len(row["configs"]) == len(space)
    assert row["best_us"] == min(c["us"] for c in row["configs"])
    assert row["table_us"] == row["configs"][0]["us"]
    assert row["rel_err"] < 1e-2 and all(c["rel_err"] < 1e-2 for c in row["configs"])
    assert gemm.describe(tiles.gemm_configs(32, 48, 16)[0]) == row["configs"][0]["config"]


def test_gemm_benchmark_times_only_chosen_configs(tmp_path):
    from jax_triton_dist import tiles
    from jax_triton_dist.bench import gemm

    path = tmp_path / "gemm.json"
    bench.main(["gemm", "--shapes", "32x48x16", "--iters", "1", "--platform", "cpu",
                "--only", "stream-K pointers", "split-K 2", "--json", str(path)])
    (row,) = json.loads(path.read_text())["results"]
    space = tiles.gemm_tile_configs(32, 48, 16)
    chosen = [space[0]] + [c for c in space[1:] if c.get("STREAM_K") and not c["USE_TMA"]
                           or c.get("SPLIT_K") == 2]
    assert any(c.get("STREAM_K") for c in chosen)
    assert [c["config"] for c in row["configs"]] == [gemm.describe(c) for c in chosen]


def test_gemm_benchmark_never_chooses_a_config_with_a_wrong_product(monkeypatch, capsys):
    """A config whose product is wrong (here: the second timed one, made wrong by the
    error measure) is reported and left out of the best, however fast it ran."""
    from jax_triton_dist.bench import gemm

    errors = iter([1e-6, 0.9, 1e-6, 1e-6])
    monkeypatch.setattr(gemm, "relative_error", lambda out, ref: next(errors))
    (row,) = gemm.run([(32, 48, 16)], iters=1, dtype="float32", platform="cpu",
                      only=["persistent TMA flattened", "split-K 2"])
    wrong = row["configs"][1]["config"]
    assert row["wrong"] == [wrong] and row["best_config"] != wrong
    assert row["best_us"] == min(c["us"] for c in row["configs"] if c["config"] != wrong)
    assert f"{wrong}: WRONG RESULT" in capsys.readouterr().out


def test_timeline_summary_reads_spans_skew_and_waits():
    from jax_triton_dist.bench.overlap import timeline_summary

    def ev(pe, program, t_us, kind, epoch=2):
        return {"pe": pe, "program": program, "time_ns": int(t_us * 1000), "kind": kind,
                "epoch": epoch}

    events = [ev(0, 0, 0, "PROGRAM_START", 1), ev(0, 0, 999, "PROGRAM_END", 1),  # older call
              ev(0, 0, 10, "PROGRAM_START"), ev(0, 0, 15, "NOTIFY"), ev(0, 0, 20, "WAIT_START"),
              ev(0, 0, 50, "WAIT_END"), ev(0, 0, 55, "NOTIFY"), ev(0, 0, 60, "WAIT_START"),
              ev(0, 0, 70, "WAIT_END"), ev(0, 0, 110, "PROGRAM_END"),
              ev(1, 0, 40, "PROGRAM_START"), ev(1, 0, 52, "NOTIFY"), ev(1, 0, 100, "PROGRAM_END"),
              ev(1, 1, 45, "PROGRAM_START"), ev(1, 1, 160, "PROGRAM_END")]
    summary = timeline_summary(events)
    # to the first notify: 5 and 12 us (two programs notify); after the last wait: 40 us
    # (one program waits)
    assert summary == pytest.approx({"span_us": 150.0, "skew_us": 30.0,
                                     "program_us": (100 + 60 + 115) / 3,
                                     "wait_us": 40 / 3, "wait_max_us": 40.0,
                                     "before_notify_us": 8.5, "after_wait_us": 40.0})
    quiet = timeline_summary([ev(0, 0, 0, "PROGRAM_START"), ev(0, 0, 9, "PROGRAM_END")])
    assert quiet["before_notify_us"] is None and quiet["after_wait_us"] is None
    with pytest.raises(ValueError, match="no timeline events"):
        timeline_summary([])


def test_overlap_parts_report_as_each_ends(monkeypatch):
    """``run(done=...)`` hands each part's rows over as the part ends, so a later part's
    failure keeps the earlier tables (the GPU run that lost its fused table)."""
    from jax_triton_dist.bench import overlap

    monkeypatch.setattr(overlap, "fused", lambda worlds, iters, ops: [{"bench": "fused"}])

    def broken(worlds, ops):
        raise ValueError("timeline unreadable")

    monkeypatch.setattr(overlap, "waits", broken)
    seen = []
    with pytest.raises(ValueError, match="timeline unreadable"):
        overlap.run([2], 1, [], ("waits", "fused"), done=seen.append)
    assert seen == [[{"bench": "fused"}]]  # parts run in PARTS' order


def test_overlap_waits_reads_each_gemm_once_and_fails_only_unreadable_rows(monkeypatch):
    from jax_triton_dist.bench import overlap

    read = []

    def timeline_of(job, world, programs, num_warps):
        name = job["kernel"].fn.__name__
        read.append((name, world, job["kwargs"].get("TWO_SHOT")))
        if name == "matmul_reduce_scatter_kernel":
            raise ValueError("no epoch in which every program that started also ended")
        return {"span_us": 2.0, "skew_us": 0.0, "program_us": 1.0, "wait_us": 0.0,
                "wait_max_us": 0.0}, 0

    monkeypatch.setattr(overlap, "_timeline_of", timeline_of)
    monkeypatch.setattr(overlap.tiles, "fill_programs", lambda: 8)
    rows = overlap.waits([2])
    assert [name for name, *_ in read].count("matmul_kernel") == len(overlap.SHAPES)
    assert [(r["op"], r["form"]) for r in rows] == [
        (op, form) for op in overlap.SHAPES for form in overlap.FORMS[op]]
    failed = [r for r in rows if "error" in r]
    assert [r["op"] for r in failed] == ["matmul_reduce_scatter"]
    assert "no epoch" in failed[0]["error"]
    assert all(r["program_ratio"] == 1.0 for r in rows if "error" not in r)


def test_overlap_fused_fails_only_failing_rows_and_stops_on_a_stuck_gpu(monkeypatch, capsys):
    """The fused part: a run that fails (here GEMM+RS's tuned kernel) gives its row the
    reason and the others still run, each printed as it ends; a stuck GPU
    (``one_gpu.StuckError``) ends the part."""
    from jax_triton_dist import one_gpu
    from jax_triton_dist.bench import overlap

    def time(job, world, programs, iters, num_warps=None):
        kernel = job["kernel"]
        name = getattr(kernel, "fn", kernel).__name__
        if name == "matmul_reduce_scatter_kernel" and num_warps is None:  # the tuned one
            raise RuntimeError("rank 1: a wait timed out")
        return 2.0 if name == "matmul_kernel" else 2.2

    monkeypatch.setattr(overlap, "_time", time)
    monkeypatch.setattr(overlap, "_reference", lambda op, world, job: [])
    monkeypatch.setattr(overlap, "_largest_error", lambda job, *args: 1e-3)
    monkeypatch.setattr(overlap.tiles, "fill_programs", lambda: 8)
    rows = overlap.fused([2], 1)
    assert [(r["op"], r["form"]) for r in rows] == [
        (op, form) for op in overlap.SHAPES for form in overlap.FORMS[op]]
    failed = [r for r in rows if "error" in r]
    assert [r["op"] for r in failed] == ["matmul_reduce_scatter"]
    assert failed[0]["error"] == "rank 1: a wait timed out" and "tuned_us" not in failed[0]
    assert all(r["tuned_ratio"] == pytest.approx(1.1) for r in rows if "error" not in r)
    printed = capsys.readouterr().out
    assert printed.count("fused: ") == len(rows) and "error: rank 1" in printed

    def stuck(job, world, programs, iters, num_warps=None):
        raise one_gpu.StuckError("rank(s) [0] did not finish")

    monkeypatch.setattr(overlap, "_time", stuck)
    with pytest.raises(one_gpu.StuckError):
        overlap.fused([2], 1)


def test_overlap_fused_part_runs_the_chosen_ops_only(monkeypatch):
    """``--ops``: the fused part runs only the named ops (in the suite's order); an unknown
    name is an error that lists the known ones."""
    from jax_triton_dist.bench import overlap

    monkeypatch.setattr(overlap, "_time", lambda job, world, programs, iters, num_warps=None: 1.0)
    monkeypatch.setattr(overlap, "_reference", lambda op, world, job: [])
    monkeypatch.setattr(overlap, "_largest_error", lambda job, *args: 1e-3)
    monkeypatch.setattr(overlap.tiles, "fill_programs", lambda: 8)
    rows = overlap.fused([2], 1, ("matmul_all_reduce", "all_gather_matmul"))
    assert [r["op"] for r in rows] == ["all_gather_matmul"] + ["matmul_all_reduce"] * len(
        overlap.FORMS["matmul_all_reduce"])
    with pytest.raises(ValueError, match="unknown fused op.*'matmul_all_gather'.*expected"):
        overlap.waits([2], ("matmul_all_gather",))


def test_overlap_fused_reports_a_wrong_result_as_an_error(monkeypatch, capsys):
    """The fused part checks each fused kernel's results before timing it: a kernel whose
    result is off (here the tuned two-shot GEMM+AR's; NaN counts as off) gets an error
    naming the relative error, the others their error in ``rel_err``."""
    from jax_triton_dist.bench import overlap

    def largest_error(job, want, world, programs, num_warps=None):
        wrong = job["kwargs"].get("TWO_SHOT") and num_warps is None
        return float("nan") if wrong else 4e-3

    monkeypatch.setattr(overlap, "_time", lambda job, world, programs, iters, num_warps=None: 1.0)
    monkeypatch.setattr(overlap, "_reference", lambda op, world, job: [])
    monkeypatch.setattr(overlap, "_largest_error", largest_error)
    monkeypatch.setattr(overlap.tiles, "fill_programs", lambda: 8)
    rows = overlap.fused([2], 1, ("matmul_all_reduce",))
    one, two = rows
    assert "error" not in one and one["rel_err"] == 4e-3
    assert two["error"] == f"wrong result: tuned relative error nan > {overlap.TOLERANCE}"
    assert "relative error 4.0e-03" in capsys.readouterr().out


def test_relative_error_against_sums_of_squares():
    """The suites' error measure: Frobenius norms in float32 (bfloat16 results too), here
    against the sums of squares written out; a NaN in the result gives NaN, which no
    ``error <= bound`` check lets through."""
    import jax.numpy as jnp

    from jax_triton_dist.bench.accuracy import relative_error

    rng = np.random.default_rng(3)
    ref = rng.standard_normal((16, 24))
    out = (ref + 1e-2 * rng.standard_normal(ref.shape)).astype(jnp.bfloat16)
    diff = np.asarray(out, np.float64) - ref
    want = np.sqrt((diff ** 2).sum() / (ref ** 2).sum())
    assert relative_error(out, ref) == pytest.approx(want, rel=1e-4)
    out = np.asarray(out, np.float32)
    out[3, 5] = np.nan
    assert np.isnan(relative_error(out, ref))


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter",
                                "matmul_all_reduce"])
def test_overlap_reference_is_every_ranks_result(op):
    """What the fused part checks each rank's result against: the gathered shards' product
    (AG+GEMM), the rank's segment of the sum over ranks (GEMM+RS), the sum (GEMM+AR), every
    rank's inputs being the same — here against sums and concatenations written out."""
    from jax_triton_dist.bench import overlap

    world, rng = 4, np.random.default_rng(7)
    x, w = rng.standard_normal((8, 6)), rng.standard_normal((6, 5))
    want = overlap._reference(op, world, {"inputs": lambda c, r: [x, w]})
    if op == "all_gather_matmul":
        expected = [np.concatenate([x] * world) @ w] * world
    else:
        total = sum(x @ w for _ in range(world))
        expected = ([total[2 * r:2 * r + 2] for r in range(world)]
                    if op == "matmul_reduce_scatter" else [total] * world)
    assert len(want) == world
    for got, exp in zip(want, expected, strict=True):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)


def test_timeline_summary_skips_an_epoch_whose_events_were_dropped():
    """A later call whose program ends were dropped (past the capacity) is not read as a
    shorter call: the latest complete epoch is; with none, the error counts the events."""
    from jax_triton_dist.bench.overlap import timeline_summary

    def ev(program, t_us, kind, epoch):
        return {"pe": 0, "program": program, "time_ns": int(t_us * 1000), "kind": kind,
                "epoch": epoch}

    complete = [ev(0, 0, "PROGRAM_START", 1), ev(0, 80, "PROGRAM_END", 1),
                ev(1, 5, "PROGRAM_START", 1), ev(1, 90, "PROGRAM_END", 1)]
    cut = [ev(0, 100, "PROGRAM_START", 2), ev(0, 180, "PROGRAM_END", 2),
           ev(1, 105, "PROGRAM_START", 2), ev(1, 110, "WAIT_START", 2)]
    assert timeline_summary(complete + cut)["span_us"] == pytest.approx(90.0)
    with pytest.raises(ValueError, match=r"2: \{'PROGRAM_END': 1, 'PROGRAM_START': 2, "
                                         r"'WAIT_START': 1\}.*JTD_TIMELINE_EVENTS"):
        timeline_summary(cut)


def test_attention_benchmark_on_cpu(tmp_path, monkeypatch, capsys):
    from jax_triton_dist.bench import attention

    monkeypatch.setattr(attention, "HEADS", 2)
    monkeypatch.setattr(attention, "HEAD_DIM", 16)
    path = tmp_path / "attention.json"
    bench.main(["attention", "--seqs", "32", "--iters", "1", "--platform", "cpu", "--causal",
                "--json", str(path)])
    rows = json.loads(path.read_text())["results"]
    prefill, decode = (r for r in rows if r["bench"] == "prefill"), (
        r for r in rows if r["bench"] == "decode")
    (prefill,), (decode,) = list(prefill), list(decode)
    assert prefill["ours_fwd_us"] > 0 and prefill["xla_bwd_us"] > 0 and prefill["causal"]
    assert "cudnn_fwd_us" not in prefill  # no cuDNN on CPU
    assert decode["ours_us"] > 0 and decode["xla_us"] > 0
    assert "fwd vs cudnn" in capsys.readouterr().out


def test_kernel_seconds_groups_events_by_call():
    from jax_triton_dist.bench import device_time

    # Three calls of two kernels each, 1 ms apart; the kernels of a call 10 us apart.
    events = [(call * 1_000_000 + offset, 5_000, name) for call in range(3)
              for offset, name in ((0, "gemm"), (10_000, "epilogue"))]
    groups = device_time._split_calls(events, 3)
    assert [[e[2] for e in g] for g in groups] == [["gemm", "epilogue"]] * 3


def test_single_gpu_fused_part_runs_on_cpu(tmp_path, capsys):
    path = tmp_path / "single.json"
    bench.main(["single-gpu", "--parts", "fused", "--shapes", "32x16x32", "--iters", "1",
                "--platform", "cpu", "--json", str(path)])
    rows = json.loads(path.read_text())["results"]
    assert [r["op"] for r in rows] == ["all_gather_matmul", "matmul_reduce_scatter",
                                       "matmul_all_reduce"] * 3
    assert [r["layout"] for r in rows] == ["kn"] * 3 + ["nk"] * 3 + ["batched"] * 3
    for row in rows:
        assert row["ours_us"] > 0 and row["dot_us"] > 0 and row["rel_err"] < 2e-2
    # each row is also printed as it is measured (a run cut off keeps what it measured)
    progress = [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("fused: ")]
    assert len(progress) == len(rows)
    assert progress[0].startswith("fused: all_gather_matmul 32x16x32 kn: tuned/dot ")


def test_single_gpu_launch_part_needs_a_gpu():
    import pytest

    from jax_triton_dist.bench import single_gpu

    with pytest.raises(RuntimeError, match="need a GPU"):
        single_gpu.run(1, "cpu", parts=("launch",))


def test_plot_of_every_suite(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    from jax_triton_dist.bench import plot

    machine = {"device_kind": "cpu", "device_count": 2, "jax": "x", "date": "2026-12-04"}
    suites = {
        "collectives": [{"op": op, "bytes": b, "ranks": 2, "dtype": "float32", "ours_us": b / 9,
                         "lax_us": b / 10} for op in ("all_gather", "all_reduce")
                        for b in (1024, 4096)],
        "gemm": [{"shape": "64x64x64", "dtype": "bfloat16", "ours_tflops": 1.0,
                  "xla_tflops": 1.2}],
        "single-gpu": [{"bench": "fused", "op": "all_gather_matmul", "shape": "64x64x64",
                        "ours_us": 2.0, "tile_us": 1.9, "dot_us": 2.1},
                       {"bench": "copy", "bytes": 1 << 20, "heap_gbps": 10.0, "d2d_gbps": 11.0},
                       {"bench": "launch", "what": "trivial", "ours_us": 6.0, "bare_us": 4.0}],
    }
    for suite, rows in suites.items():
        path = tmp_path / f"{suite}.json"
        path.write_text(json.dumps({"suite": suite, "machine": machine, "results": rows}))
        out = tmp_path / f"{suite}.png"
        bench.main(["plot", str(path), "--out", str(out)])
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    with pytest.raises(ValueError, match="no plot for suite"):
        plot.plot("unknown", [{}], machine, str(tmp_path / "x.png"))


def test_collectives_benchmark_cli_plots(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    out = tmp_path / "c.png"
    bench.main(["collectives", "--sizes", "512", "2048", "--ranks", "2", "--iters", "1",
                "--json", str(tmp_path / "c.json"), "--platform", "cpu", "--plot", str(out)])
    assert out.stat().st_size > 5000


def test_overlap_bench_tunes_fused_op_and_gemm_alone_over_one_space():
    """The tuned overlap ratio compares like with like: the fused op and the GEMM alone
    choose from the same persistent configs, and neither keeps the fixed tile."""
    from jax_triton_dist.bench import overlap

    for op in overlap.SHAPES:
        for world, form in itertools.product((2, 8), overlap.FORMS[op]):
            fused = overlap._tuned_job(op, world, form)
            gemm = overlap._autotuned(overlap._gemm_job(op), op, world)
            assert fused["kernel"].configs == gemm["kernel"].configs
            assert fused["kwargs"].items() >= overlap.FORMS[op][form].items()
            assert all(c.kwargs["PERSISTENT"] for c in gemm["kernel"].configs)
            assert any(c.kwargs["USE_TMA"] for c in gemm["kernel"].configs)
            for job in (fused, gemm):
                assert not set(overlap.TILE) & set(job["kwargs"])


@pytest.mark.parametrize("world", [1, 2])
def test_overlap_gemm_rs_job_sums_its_segment_as_the_op_does(monkeypatch, world):
    """The proxy times GEMM+RS in the form the op launches: with peers, its own segment
    summed through the slots' descriptor (``SUM_TMA``). It had timed the pointer sums,
    which the op does not run (11% slower on the H100, BENCHMARKS.md)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jax_triton_dist as jtd
    from jax_triton_dist.bench import overlap
    from jax_triton_dist.fused import launch

    class Launched(Exception):
        pass

    seen = {}

    def spy(kernel, *args, **kwargs):
        seen.update(kwargs)
        raise Launched

    monkeypatch.setattr(launch, "triton_call", spy)
    _, n, _ = overlap.SHAPES["matmul_reduce_scatter"]
    mesh = Mesh(np.array(jax.devices("cpu")[:world]), ("x",))
    f = jax.shard_map(lambda a, b: jtd.matmul_reduce_scatter(a, b, "x"), mesh=mesh,
                      in_specs=(P(None, "x"), P("x", None)), out_specs=P("x"))
    with pytest.raises(Launched):
        jax.jit(f).lower(jax.ShapeDtypeStruct((8 * world, 16 * world), jnp.bfloat16),
                         jax.ShapeDtypeStruct((16 * world, n), jnp.bfloat16))
    job = overlap._fused_job("matmul_reduce_scatter", world, "")
    assert seen["SUM_TMA"] == (world > 1)
    assert job["kwargs"]["SUM_TMA"] == seen["SUM_TMA"]
