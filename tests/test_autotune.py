"""The distributed autotuner (``jax_triton_dist.autotune``) on simulated CPU devices, with
tuning forced in the interpreter (``JTD_AUTOTUNE=all``): every rank of a team picks the
same config whatever its own timings say, choices are cached on disk and reused by another
process, failing configs are skipped, and tuning can be switched off."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist.runtime import tuning

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
sys.path.insert(0, WORKERS)
import tuned_shift  # noqa: E402
from tuned_shift import BLOCKS, N  # noqa: E402


@pytest.fixture(autouse=True)
def tuning_in_the_interpreter(monkeypatch, tmp_path):
    monkeypatch.setenv("JTD_AUTOTUNE", "all")
    monkeypatch.setenv("JTD_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))


def run_shift(kernel, mesh_shape, axis="x", seed=0):
    """Shifts random data around the ``axis`` ring of a mesh; checks against np.roll."""
    names = ("y", "x")[-len(mesh_shape):]
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(mesh_shape))]).reshape(mesh_shape), names)
    spec = P(*names)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal(mesh_shape + (N,)),
                    jnp.float32)
    f = jax.jit(jax.shard_map(lambda v: tuned_shift.shift(kernel, v.reshape(N), axis)
                              .reshape(v.shape), mesh=mesh, in_specs=spec, out_specs=spec))
    for _ in range(3):  # the tuning launches must not disturb later calls
        out = f(x)
    ring_axis = names.index(axis)
    np.testing.assert_array_equal(np.asarray(out), np.roll(np.asarray(x), 1, ring_axis))


def slowest_rank_choice(times_of):
    """The reference choice: argmin over configs of the max over ranks."""
    worst = [max(ranks) for ranks in times_of]
    return int(np.argmin(worst))


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_that_disagree_pick_the_same_config(ranks):
    # Each rank's own timings favour a different config (rank r: config r % 3).
    def timer(config, rank, seconds):
        index = BLOCKS.index(config.kwargs["BLOCK"])
        return 1.0 if index == rank % 3 else 2.0 + rank * (index + 1)

    kernel = tuned_shift.make(timer)
    run_shift(kernel, (ranks,))
    chosen = {r.rank: r.index for r in kernel.records}
    assert sorted(chosen) == list(range(ranks))
    assert len(set(chosen.values())) == 1, chosen
    want = slowest_rank_choice([[timer(c, r, 0) for r in range(ranks)] for c in
                                [jtd.autotune.Config({"BLOCK": b}) for b in BLOCKS]])
    assert set(chosen.values()) == {want}
    assert all(r.source == "tuned" for r in kernel.records)
    for record in kernel.records:  # every rank saw the slowest rank's time of each config
        assert record.times == kernel.records[0].times


def test_each_team_of_a_two_axis_mesh_chooses_for_itself():
    # Teams along x (rows y=0 and y=1) time different things; within a team all agree.
    def timer(config, rank, seconds):
        return float(config.kwargs["BLOCK"])  # BLOCK=64 wins everywhere

    kernel = tuned_shift.make(timer)
    run_shift(kernel, (2, 4), axis="x")
    assert len(kernel.records) == 8 and {r.index for r in kernel.records} == {0}


def test_the_choice_is_cached_on_disk():
    kernel = tuned_shift.make(lambda config, rank, seconds: -float(config.kwargs["BLOCK"]) + 1e3)
    run_shift(kernel, (4,))
    assert {r.index for r in kernel.records} == {2}
    entries = jtd.autotune.cache_entries()
    assert len(entries) == 1
    (entry,) = entries.values()
    assert entry["config"]["kwargs"] == {"BLOCK": 256}
    assert entry["call"]["num_ranks"] == 4 and entry["call"]["device"] == "cpu"
    assert len(entry["times_us"]) == 3
    # A fresh kernel object (a new process would have one) finds it and times nothing.
    calls = []
    again = tuned_shift.make(lambda config, rank, seconds: calls.append(rank) or 1.0)
    run_shift(again, (4,), seed=1)
    assert not calls and {(r.index, r.source) for r in again.records} == {(2, "cache")}


def test_a_second_process_reuses_the_cache(tmp_path):
    env = dict(os.environ, JTD_AUTOTUNE="all",
               JTD_AUTOTUNE_CACHE=str(tmp_path / "shared.json"),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    script = os.path.join(WORKERS, "tuned_shift.py")
    outs = [subprocess.run([sys.executable, script], capture_output=True, text=True, env=env,
                           timeout=300, cwd=tmp_path) for _ in range(2)]
    for out in outs:
        assert out.returncode == 0, out.stdout + out.stderr
    first, second = (o.stdout.strip().splitlines()[-1] for o in outs)
    assert first == "correct " + str([(r, 0, "tuned") for r in range(4)])
    assert second == "correct " + str([(r, 0, "cache") for r in range(4)])
    assert len(json.loads((tmp_path / "shared.json").read_text())["entries"]) == 1


def test_a_config_that_fails_is_skipped(caplog):
    configs = [jtd.autotune.Config({"BLOCK": 64, "FAIL": True}),
               jtd.autotune.Config({"BLOCK": 128}), jtd.autotune.Config({"BLOCK": 256})]
    kernel = tuned_shift.make(lambda config, rank, seconds: float(config.kwargs["BLOCK"]),
                              configs=configs)
    with caplog.at_level("WARNING"):
        run_shift(kernel, (2,))
    assert {r.index for r in kernel.records} == {1}
    assert kernel.records[0].times[0] is None
    failed = [m for m in caplog.messages if "failed" in m and "FAIL=True" in m]
    assert failed and "this config is meant to fail" in failed[0]


def test_check_skips_a_config_whose_outputs_are_wrong(caplog):
    """``check=True``: a config that runs but computes something else is skipped on every
    rank however fast it is (here the timer makes it the fastest by far)."""
    wrong = {"BLOCK": 128, "WRONG": True}
    configs = [jtd.autotune.Config({"BLOCK": 256}), jtd.autotune.Config(wrong),
               jtd.autotune.Config({"BLOCK": 64})]

    def timer(config, rank, seconds):
        return 1e-3 if config.kwargs.get("WRONG") else float(config.kwargs["BLOCK"])

    kernel = tuned_shift.make(timer, configs=configs, check=True)
    with caplog.at_level("WARNING"):
        run_shift(kernel, (2,))
    assert {r.index for r in kernel.records} == {2}  # BLOCK=64, the fastest right one
    assert kernel.records[0].times[1] is None
    failed = [m for m in caplog.messages if "failed" in m and "WRONG=True" in m]
    assert failed and "differs from the reference config's: relative error" in failed[0]


def test_without_check_the_fastest_config_is_taken_whatever_it_computes():
    configs = [jtd.autotune.Config({"BLOCK": 256}),
               jtd.autotune.Config({"BLOCK": 128, "WRONG": True})]
    kernel = tuned_shift.make(lambda c, r, s: 1e-3 if c.kwargs.get("WRONG") else 1.0,
                              configs=configs)
    with pytest.raises(AssertionError):  # run_shift compares with np.roll
        run_shift(kernel, (2,))
    assert {r.index for r in kernel.records} == {1}


def test_outputs_differ_reads_dtypes_shapes_and_non_finite_values():
    import ml_dtypes

    ref = np.array([1.0, 2.0, np.inf, np.nan], np.float32)
    assert tuning.outputs_differ([ref * (1 + 1e-3)], [ref], 1e-2) is None
    assert "relative error" in tuning.outputs_differ([ref + [0.5, 0, 0, 0]], [ref], 1e-2)
    assert "non-finite" in tuning.outputs_differ([np.array([1, 2, 3, 4.0], np.float32)],
                                                 [ref], 1e-2)
    assert "non-finite values differ" in tuning.outputs_differ(
        [np.array([1, 2, -np.inf, np.nan], np.float32)], [ref], 1e-2)
    assert "shape" in tuning.outputs_differ([ref[:2]], [ref], 1e-2)
    ints = np.arange(6, dtype=np.int32)
    assert tuning.outputs_differ([ints], [ints.copy()], 1e-2) is None
    assert "differs" in tuning.outputs_differ([ints + (ints == 5)], [ints], 0.5)
    bf16 = np.array([1.0, 2.0, 3.0], ml_dtypes.bfloat16)
    assert tuning.outputs_differ([bf16], [bf16.copy()], 1e-2) is None
    assert "relative error" in tuning.outputs_differ([bf16 * 2], [bf16], 1e-2)
    assert tuning.outputs_differ([np.zeros(3)], [np.zeros(3)], 1e-2) is None


def test_a_config_space_may_depend_on_the_call():
    """``configs`` may be a function of the call's keyword arguments (here: of ``n``)."""
    seen = []

    def space(kwargs):
        seen.append(kwargs["n"])
        return [jtd.autotune.Config({"BLOCK": b}) for b in (256, 64) if b <= kwargs["n"]]

    kernel = tuned_shift.make(lambda config, rank, seconds: float(config.kwargs["BLOCK"]),
                              configs=space)
    run_shift(kernel, (2,))
    assert seen and set(seen) == {N}
    assert {r.config.kwargs["BLOCK"] for r in kernel.records} == {64}


def test_no_config_that_runs_is_a_clear_error():
    configs = [jtd.autotune.Config({"BLOCK": b, "FAIL": True}) for b in (64, 128)]
    kernel = tuned_shift.make(configs=configs)
    with pytest.raises(Exception, match="no config ran on every rank of the team"):
        run_shift(kernel, (2,))


@pytest.mark.parametrize("how", ["environment", "argument"])
def test_tuning_switched_off_uses_the_first_config(monkeypatch, how):
    calls = []

    def timer(config, rank, seconds):
        calls.append(rank)
        return 1.0

    if how == "environment":
        monkeypatch.setenv("JTD_AUTOTUNE", "off")
        kernel = tuned_shift.make(timer)
    else:
        kernel = tuned_shift.make(timer, enabled=False)
    run_shift(kernel, (4,))
    assert not calls
    assert {(r.index, r.source) for r in kernel.records} == {(0, "default")}


def test_without_tuning_a_cached_choice_is_still_used(monkeypatch):
    run_shift(tuned_shift.make(lambda config, rank, seconds: 1e3 - config.kwargs["BLOCK"]),
              (2,))
    monkeypatch.setenv("JTD_AUTOTUNE", "off")
    kernel = tuned_shift.make()
    run_shift(kernel, (2,))
    assert {(r.index, r.source) for r in kernel.records} == {(2, "cache")}


def test_the_default_mode_does_not_tune_on_cpu(monkeypatch):
    monkeypatch.delenv("JTD_AUTOTUNE")
    kernel = tuned_shift.make(lambda config, rank, seconds: pytest.fail("timed on CPU"))
    run_shift(kernel, (2,))
    assert {(r.index, r.source) for r in kernel.records} == {(0, "default")}


def test_progress_is_logged(monkeypatch, caplog):
    monkeypatch.setenv("JTD_LOG", "autotune")
    kernel = tuned_shift.make(lambda config, rank, seconds: float(config.kwargs["BLOCK"]))
    with caplog.at_level("WARNING"):
        run_shift(kernel, (2,))
    lines = [m for m in caplog.messages if m.startswith("jtd autotune")]
    assert any("config=2/3 time_us=128000000.0 best_us=64000000.0 (BLOCK=128)" in m
               for m in lines), lines
    assert any("source=tuned config=1/3 (BLOCK=64)" in m for m in lines), lines


def test_prune_runs_at_trace_time_and_may_reorder():
    seen = []

    def prune(configs, kwargs):
        seen.append(kwargs["n"])
        return [c for c in reversed(configs) if c.kwargs["BLOCK"] <= 128]

    kernel = tuned_shift.make(enabled=False, prune=prune)
    run_shift(kernel, (2,))
    assert seen == [N]
    assert {r.config.kwargs["BLOCK"] for r in kernel.records} == {128}


def test_bad_input_is_refused_clearly(monkeypatch):
    with pytest.raises(ValueError, match="configs must be a non-empty sequence"):
        jtd.autotune.autotune([])(tuned_shift.make().kernel)
    with pytest.raises(TypeError, match="expected a @triton.jit kernel"):
        jtd.autotune.autotune([jtd.autotune.Config({})])(lambda: None)
    with pytest.raises(ValueError, match="num_warps must be a positive int"):
        jtd.autotune.Config({"BLOCK": 64}, num_warps=0)
    with pytest.raises(TypeError, match="kwargs must be a mapping"):
        jtd.autotune.Config([("BLOCK", 64)])
    with pytest.raises(ValueError, match="need warmup >= 0 and rep >= 1"):
        tuned_shift.make(rep=0)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x = jnp.zeros((2 * N,), jnp.float32)

    def call(kernel, **kw):
        return jax.jit(jax.shard_map(lambda v: tuned_shift.shift(kernel, v, "x", **kw),
                                     mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)

    bad_key = jtd.autotune.autotune([jtd.autotune.Config({"BLOCK": 64})], key=["m"])(
        tuned_shift.make().kernel)
    with pytest.raises(ValueError, match=r"key names \['m'\] are not keyword arguments"):
        call(bad_key)
    empty = tuned_shift.make(prune=lambda configs, kwargs: [])
    with pytest.raises(ValueError, match="prune left no config"):
        call(empty)
    unknown = tuned_shift.make(configs=[jtd.autotune.Config({"BLOCK": 64, "BLOKC": 1})])
    with pytest.raises(TypeError, match=r"no parameters \['BLOKC'\]"):
        call(unknown)
    monkeypatch.setenv("JTD_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="JTD_AUTOTUNE='sometimes': expected one of off, gpu"):
        call(tuned_shift.make())
    monkeypatch.setenv("JTD_AUTOTUNE", "all")
    monkeypatch.setenv("JTD_AUTOTUNE_CACHE", os.getcwd())
    with pytest.raises(ValueError, match="is a directory; expected the path of a JSON file"):
        call(tuned_shift.make())


def test_select_reduces_by_the_slowest_rank(monkeypatch):
    """The choice itself, with a scripted team: ranks' votes and times as gathered."""
    variants = tuning.variants_of([tuning.Config({"B": b}) for b in (1, 2, 3)], {}, {},
                                  lambda meta: (1,))
    times = {0: [3.0, 1.0, 2.0], 1: [1.0, 4.0, 2.5]}  # max: 3, 4, 2.5 -> config 2
    tuner = tuning.Autotuned(tuned_shift.make().kernel, tuple(v.config for v in variants))
    gathered = {}

    def gather_for(rank):
        def gather(tag, value):
            gathered.setdefault(tag, {})[rank] = value
            if tag == "tune/plan":
                return [2 * 0 + 1, 2 * 0 + 1]  # nobody cached, everyone may tune
            if tag.endswith("/start"):
                return [0, 0]
            index = int(tag.split("/")[1])
            return [round(times[r][index] * 1e9) for r in (0, 1)]
        return gather

    class Trial(tuning.Trial):
        def __init__(self, rank, index):
            self.seconds = times[rank][index]

        def run(self):
            return self.seconds

    monkeypatch.setenv("JTD_AUTOTUNE_CACHE", "")  # the ranks run one after another here
    for rank in (0, 1):
        chosen = tuning.select(tuner, variants, "k", rank, {"case": "scripted"}, "cpu",
                               gather_for(rank), lambda index, r=rank: Trial(r, index))
        assert chosen == 2
    assert gathered["tune/1"] == {0: round(1e9), 1: round(4e9)}


def test_select_for_a_team_driven_by_one_thread(monkeypatch):
    """one_gpu's choice: every rank timed at once; a variant failing on one rank is out."""
    monkeypatch.setenv("JTD_AUTOTUNE_CACHE", "")
    variants = tuning.variants_of([tuning.Config({"B": b}) for b in (1, 2, 3)], {}, {},
                                  lambda meta: (1,))
    tuner = tuning.Autotuned(tuned_shift.make().kernel, tuple(v.config for v in variants))
    per_rank = {0: [1.0, 5.0, None], 1: [3.0, 2.0, 0.5], 2: [2.0, 2.5, 0.5]}  # max: 3, 5, -
    chosen = tuning.select_for_team(tuner, variants, "k", 3, {"case": "team"}, "gpu",
                                    lambda index: [per_rank[r][index] for r in range(3)])
    assert chosen == 0
    assert [(r.rank, r.index, r.source) for r in tuner.records] == [
        (0, 0, "tuned"), (1, 0, "tuned"), (2, 0, "tuned")]
    assert tuner.records[0].times == (3.0, 5.0, None)
    monkeypatch.setenv("JTD_AUTOTUNE", "off")
    assert tuning.select_for_team(tuner, variants, "k", 3, {"case": "team"}, "gpu",
                                  lambda index: pytest.fail("timed with tuning off")) == 0


def test_select_for_a_team_checks_every_ranks_outputs(monkeypatch, caplog):
    """With ``check``, a variant whose outputs differ on one rank is out for the team."""
    monkeypatch.setenv("JTD_AUTOTUNE_CACHE", "")
    variants = tuning.variants_of([tuning.Config({"B": b}) for b in (1, 2, 3)], {}, {},
                                  lambda meta: (1,))
    tuner = tuning.Autotuned(tuned_shift.make().kernel, tuple(v.config for v in variants),
                             check=True)
    right = [[np.arange(4.0)], [np.arange(4.0) * 2]]  # each rank's own (right) outputs
    last = []

    def measure(index):
        last[:] = [index]
        return [3.0 - index, 3.0 - index]  # later variants are faster

    def read():
        if last[0] == 2:  # variant 2: rank 1's output is wrong
            return [right[0], [right[1][0] + 1]]
        return right

    with caplog.at_level("WARNING"):
        chosen = tuning.select_for_team(tuner, variants, "k", 2, {"case": "check"}, "gpu",
                                        measure, read)
    assert chosen == 1 and tuner.records[0].times == (3.0, 2.0, None)
    assert any("rank=1 config=3/3 failed" in m and "relative error" in m
               for m in caplog.messages)


def test_the_ops_config_spaces_start_with_the_fixed_table():
    """What runs on CPU and with tuning off is the table's choice; the spaces have more."""
    from jax_triton_dist import tiles

    for m, n, k in ((8192, 1376, 4096), (128, 1376, 4096), (30, 40, 50)):
        configs = tiles.gemm_configs(m, n, k)
        table = tiles.gemm_tiles(m, n, k)
        assert {key: configs[0][key] for key in table} == table
        assert not configs[0]["PERSISTENT"] and not configs[0]["USE_TMA"]
        assert len(configs) == len({tuple(sorted(c.items())) for c in configs})  # no repeats
    assert len(tiles.gemm_configs(8192, 8192, 8192)) > 1
    assert any(c["PERSISTENT"] for c in tiles.gemm_configs(8192, 8192, 8192))
    assert tiles.gemm_configs(64, 64, 64, target="ascend") == [
        {**tiles.gemm_tiles(64, 64, 64, target="ascend"), "num_stages": 3, "PERSISTENT": False,
         "USE_TMA": False}]
    for seq, d in ((4096, 128), (40, 64), (8, 16)):
        configs = tiles.attention_configs(seq, d, forward=True)
        assert {key: configs[0][key] for key in ("BLOCK_M", "BLOCK_N")} == \
            tiles.attention_blocks(seq)
        assert not configs[0]["USE_TMA"] and configs[0]["SPLIT_MASKED"]
        assert len(configs) == len({tuple(sorted(c.items())) for c in configs})  # no repeats
        assert all(16 <= c["BLOCK_M"] <= max(16, triton.next_power_of_2(seq)) for c in configs)
    assert any(c["USE_TMA"] for c in tiles.attention_configs(4096, 128, forward=True))
    assert not any("USE_TMA" in c for c in tiles.attention_configs(4096, 128))  # backward
    ascend = tiles.attention_configs(4096, 128, target="ascend", forward=True)
    assert len(ascend) == 1 and not ascend[0]["USE_TMA"] and not ascend[0]["SPLIT_MASKED"]
    for n in (10, 5000, 1 << 20):
        configs = tiles.exchange_configs(n)
        assert configs[0] == {"BLOCK": tiles.exchange_block(n)[0], "num_warps": 4}
        assert all(c["BLOCK"] <= configs[0]["BLOCK"] for c in configs)
    assert len(tiles.exchange_configs(1 << 20)) == 6


def test_the_ops_check_every_config_while_tuning():
    from jax_triton_dist import attention
    from jax_triton_dist.collectives import launch as collectives_launch
    from jax_triton_dist.fused import launch as fused_launch
    from jax_triton_dist.kernels.attention import sequence_parallel_attention_kernel
    from jax_triton_dist.kernels.exchange import push_exchange_kernel
    from jax_triton_dist.kernels.gemm_collectives import all_gather_matmul_kernel

    assert fused_launch._tuned(all_gather_matmul_kernel, 8192, 1376, 4096, 8).check
    assert collectives_launch._tuned(push_exchange_kernel, 1 << 20).check
    assert attention._tuned(sequence_parallel_attention_kernel, 4096, 128, True).check


def test_config_from_a_table_entry():
    """``tiles`` entries carry their compile options; persistent ones are co-resident."""
    from jax_triton_dist import tiles

    entry = tiles.gemm_configs(8192, 8192, 8192)[0]
    config = jtd.autotune.Config.from_table(entry)
    assert config.num_warps == entry["num_warps"] and config.num_stages == entry["num_stages"]
    assert "num_warps" not in config.kwargs and config.kwargs["BLOCK_M"] == entry["BLOCK_M"]
    assert not config.co_resident
    assert jtd.autotune.Config.from_table(dict(entry, PERSISTENT=True)).co_resident
    exchange = jtd.autotune.Config.from_table(tiles.exchange_configs(1000)[0])
    assert exchange.num_stages is None and exchange.kwargs == {"BLOCK": 1024}
    assert "num_warps" in entry  # the entry itself is left as it was
