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
