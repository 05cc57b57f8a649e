"""``python -m jax_triton_dist.stress``: passes on the ops, finds a planted bug."""

import json

import pytest

from jax_triton_dist.stress import __main__ as stress
from jax_triton_dist.stress import ops, registry, tolerance


def test_every_public_op_is_registered():
    assert set(registry()) >= {"all_gather", "reduce_scatter", "all_reduce", "all_to_all",
                               "all_gather_matmul", "matmul_reduce_scatter",
                               "matmul_all_reduce", "moe", "sequence_parallel_attention",
                               "flash_decode"}


def test_tolerances():
    assert tolerance("bfloat16", "movement") == (0.0, 0.0)
    assert tolerance("int32", "reduction") == (0.0, 0.0)
    assert tolerance("float32", "reduction")[0] < tolerance("float16", "reduction")[0] < \
        tolerance("bfloat16", "reduction")[0]


@pytest.mark.slow
def test_stress_passes_on_every_op(tmp_path, capsys):
    path = tmp_path / "stress.json"
    names = [op.name for op in ops.BUILT_IN]
    assert stress.main(names + ["--iters", "2", "--seed", "3", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "summary" in out and "FAIL" not in out
    rows = json.loads(path.read_text())
    assert len(rows) == 2 * len(names) and all(r["ok"] for r in rows)
    assert {r["op"] for r in rows} == set(names)
    assert all(r["max_abs"] == 0 for r in rows if r["op"] in ("all_gather", "all_to_all"))


def test_stress_with_a_straggler_and_back_to_back_calls(capsys):
    assert stress.main(["all_gather_matmul", "matmul_reduce_scatter", "--iters", "2",
                        "--ranks", "2,4", "--straggler", "0.02", "--verify-hang", "5"]) == 0
    out = capsys.readouterr().out
    assert "straggler=rank" in out and "5 unchecked calls before each check" in out


def test_stress_finds_the_planted_bug(capsys):
    assert stress.main(["correct_shift", "--iters", "3", "--module", "stress_planted"]) == 0
    capsys.readouterr()
    assert stress.main(["planted_shift", "--iters", "3", "--seed", "5",
                        "--module", "stress_planted"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "wrong on ranks" in out
    assert "reproduce with python -m jax_triton_dist.stress planted_shift --seed 5 --only" in out
    # The reported case reproduces alone.
    line = next(x for x in out.splitlines() if x.startswith("FAILED planted_shift"))
    only = int(line.split("--only ")[1].split()[0])
    assert stress.main(["planted_shift", "--seed", "5", "--only", str(only),
                        "--module", "stress_planted"]) == 1


def test_stress_rejects_unknown_ops(capsys):
    assert stress.main(["all_gather", "no_such_op"]) == 2
    assert "unknown ops ['no_such_op']" in capsys.readouterr().err
