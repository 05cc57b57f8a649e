"""The benchmark suites run (smoke test; speed is never asserted)."""

import json

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


def test_single_gpu_fused_part_runs_on_cpu(tmp_path, capsys):
    path = tmp_path / "single.json"
    bench.main(["single-gpu", "--parts", "fused", "--shapes", "32x16x32", "--iters", "1",
                "--platform", "cpu", "--json", str(path)])
    rows = json.loads(path.read_text())["results"]
    assert [r["op"] for r in rows] == ["all_gather_matmul", "matmul_reduce_scatter",
                                       "matmul_all_reduce"]
    for row in rows:
        assert row["ours_us"] > 0 and row["dot_us"] > 0 and row["rel_err"] < 2e-2


def test_single_gpu_launch_part_needs_a_gpu():
    import pytest

    from jax_triton_dist.bench import single_gpu

    with pytest.raises(RuntimeError, match="need a GPU"):
        single_gpu.run(1, "cpu", parts=("launch",))
