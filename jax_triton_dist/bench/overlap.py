"""A one-GPU proxy for overlap: the ranks of a fused op sharing one GPU, against the same
ranks' local GEMMs alone.

Each fused op runs at 2, 4 and 8 ranks concurrently on one GPU
(``one_gpu.time_ranks``: a stream per rank, the persistent variant with ``programs /
ranks`` programs each, so that every rank's programs are resident at once). The baseline
is the same ranks running only their local GEMM (``kernels/gemm.py``, persistent, the same
tiles, grid and operand shapes) the same way. The ratio fused / GEMM-alone is what the
flags, waits and peer reads cost when the ranks share the GPU's SMs and memory; it says
nothing about NVLink. The collectives run the same way against copy-engine copies
(``cuMemcpyDtoDAsync``, a stream per rank) of the bytes each rank gathers.

Each fused op runs with the fixed tiles (*table*, the warps the table gives) against the
GEMM alone with the same tiles, and both autotuned over the same persistent forms of the
op's GEMM configs (*tuned*: the ranks choose together before the timed calls; fused op
and GEMM may settle on different tiles, so the tuned ratio compares the best of each).
Times are makespans: from the moment the ranks are released together (``one_gpu``'s
gate, opened once every rank's launch is enqueued) to the last rank's end.
GEMM+AR runs in both its exchanges (:data:`FORMS`: one-shot and two-shot), a row each.
Before it is timed, each fused kernel (fixed and tuned) runs two calls whose every rank's
result is checked against the float32 product (:func:`_largest_error`): a row whose
kernel computes a wrong result says so (under ``error``), so that no time of a wrong
kernel passes for a time.

The *waits* part splits that ratio (``--parts waits``): one call of each fused op and of
the GEMM alone (fixed tiles) run inside ``jtd.timeline.record``, and the programs' own
clocks give the span from the first program's start to the last one's end, the spread of
the ranks' first starts (launch skew), the mean time a program ran, and the time programs
spent in ``dl.wait`` (mean and max per program) — so a fused op's extra time shows up as
waiting for peers, or as programs that ran longer (peer reads, exchange stores, the ranks'
memory traffic). For the persistent exchanges, which raise their flags after a program's
pushes and sum after its waits, it also splits a program's time: up to its first flag
(its GEMM and pushes) and after its last wait (its sums or copies).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import triton

from jax_triton_dist import autotune, one_gpu, tiles
from jax_triton_dist.bench.accuracy import relative_error
from jax_triton_dist.fused.launch import (
    all_reduce_exchange,
    reduce_scatter_exchange,
    reduce_scatter_sums_tma,
)
from jax_triton_dist.kernels.exchange import push_exchange_kernel
from jax_triton_dist.kernels.gemm import matmul_kernel
from jax_triton_dist.kernels.gemm_allreduce import matmul_all_reduce_kernel
from jax_triton_dist.kernels.gemm_collectives import (
    all_gather_matmul_kernel,
    matmul_reduce_scatter_kernel,
)

# Per-rank GEMMs of a TP8 Llama-style MLP (M, N, K): AG+GEMM gathers M rows, GEMM+RS
# scatters M rows, GEMM+AR is the decode shape.
SHAPES = {"all_gather_matmul": (8192, 1376, 4096), "matmul_reduce_scatter": (8192, 4096, 1376),
          "matmul_all_reduce": (128, 4096, 1376)}
TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}
DECODE_TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}
WARPS = {"all_gather_matmul": 8, "matmul_reduce_scatter": 8, "matmul_all_reduce": 4}
# The exchanges each op runs in (a row each): GEMM+AR one-shot and two-shot
# (``kernels/gemm_allreduce.py``: every rank sums every tile, or each tile's owner does)
FORMS = {"all_gather_matmul": {"": {}},
         "matmul_reduce_scatter": {"": {}},
         "matmul_all_reduce": {"one-shot": {"TWO_SHOT": False},
                               "two-shot": {"TWO_SHOT": True}}}


# The fused kernels' stream-K workspaces, unused here: the GEMM alone has no stream-K form,
# so neither side runs one (like with like)
NO_STREAM_K = [((1,), np.float32), ((1,), np.int32)]

BF16 = np.dtype(jnp.bfloat16)


def _bf16(rng, shape, scale=1.0):
    """Random bfloat16 values (NumPy arrays of ml_dtypes' bfloat16)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF16)


def _fused_job(op: str, world: int, form: str) -> dict[str, Any]:
    """``one_gpu`` arguments of the fused op at ``world`` ranks (bfloat16), in the
    exchange ``form`` (a key of the op's :data:`FORMS`)."""
    m, n, k = SHAPES[op]
    tile = DECODE_TILE if op == "matmul_all_reduce" else TILE
    rng = np.random.default_rng(0)
    common = {**tile, "PERSISTENT": True, **FORMS[op][form]}
    if op == "all_gather_matmul":
        rows = m // world
        x, w, bias = _bf16(rng, (rows, k)), _bf16(rng, (k, n), k ** -0.5), _bf16(rng, (1,))
        return dict(kernel=all_gather_matmul_kernel, inputs=lambda c, r: [x, w, bias],
                    outputs=[((m, n), BF16)],
                    workspaces=[((2, world), np.int32), *NO_STREAM_K],
                    symmetric=[0], kwargs=dict(m=rows, N=n, K=k, R=rows, stride_wk=n,
                                               stride_wn=1, **common))
    if op == "matmul_reduce_scatter":
        seg = m // world
        x, w, bias = _bf16(rng, (m, k)), _bf16(rng, (k, n), k ** -0.5), _bf16(rng, (1,))
        per_segment = triton.cdiv(seg, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"])
        return dict(kernel=matmul_reduce_scatter_kernel, inputs=lambda c, r: [x, w, bias],
                    outputs=[((seg, n), BF16)],
                    workspaces=[*reduce_scatter_exchange(world, seg, n, per_segment, BF16),
                                *NO_STREAM_K],
                    symmetric=[], kwargs=dict(seg=seg, N=n, K=k, R=seg, stride_wk=n,
                                              stride_wn=1,
                                              SUM_TMA=reduce_scatter_sums_tma(world, n, BF16),
                                              **common))
    x, w = _bf16(rng, (m, k)), _bf16(rng, (k, n), k ** -0.5)
    num_tiles = triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"])
    return dict(kernel=matmul_all_reduce_kernel, inputs=lambda c, r: [x, w],
                outputs=[((m, n), BF16)],
                workspaces=[*all_reduce_exchange(world, m, n, num_tiles, BF16), *NO_STREAM_K],
                symmetric=[], kwargs=dict(M=m, N=n, K=k, stride_am=k, stride_ak=1,
                                          stride_bk=n, stride_bn=1, **common))


def _gemm_job(op: str) -> dict[str, Any]:
    """The same ranks' local GEMM alone: ``[M, K] @ [K, N]`` of the op's shape."""
    m, n, k = SHAPES[op]
    tile = DECODE_TILE if op == "matmul_all_reduce" else TILE
    rng = np.random.default_rng(0)
    a, b = _bf16(rng, (m, k)), _bf16(rng, (k, n), k ** -0.5)
    return dict(kernel=matmul_kernel, inputs=lambda c, r: [a, b], outputs=[((m, n), BF16)],
                workspaces=[], symmetric=[],
                kwargs=dict(M=m, N=n, K=k, stride_am=k, stride_ak=1, stride_bk=n, stride_bn=1,
                            stride_cm=n, stride_cn=1, **tile, PERSISTENT=True))


def _local_rows(op: str, world: int) -> int:
    """Rows of one rank's GEMM copy: the whole M for GEMM+AR, M / ranks (a shard or a
    segment) for the others, which make ``world`` such copies in one grid."""
    m = SHAPES[op][0]
    return m if op == "matmul_all_reduce" else m // world


def _persistent_configs(op: str, world: int) -> list[autotune.Config]:
    """The persistent forms of the op's GEMM configs (``tiles.gemm_configs`` with tensor
    descriptors; for AG+GEMM, whose output is local, also storing through one; for AG+GEMM
    and GEMM+RS also flattened), without
    repeats: what the tuned fused op and the tuned GEMM alone both choose from."""
    _, n, k = SHAPES[op]
    copies = 1 if op == "matmul_all_reduce" else world
    configs = []
    for config in tiles.gemm_configs(_local_rows(op, world), n, k, copies, tma=True,
                                     tma_store=op == "all_gather_matmul",
                                     flatten=op != "matmul_all_reduce"):
        tuned = autotune.Config.from_table(dict(config, PERSISTENT=True))
        if tuned not in configs:
            configs.append(tuned)
    return configs


def _autotuned(job: dict[str, Any], op: str, world: int) -> dict[str, Any]:
    """``job`` with its fixed tile taken out and its kernel autotuned over
    :func:`_persistent_configs` (the ranks choose together on the GPU)."""
    for key in (*TILE, "PERSISTENT"):
        job["kwargs"].pop(key)
    job["kernel"] = autotune.autotune(_persistent_configs(op, world))(job["kernel"])
    return job


def _tuned_job(op: str, world: int, form: str) -> dict[str, Any]:
    """:func:`_fused_job`, autotuned (its workspaces sized by the chosen tile)."""
    job = _autotuned(_fused_job(op, world, form), op, world)
    if op != "all_gather_matmul":  # partial slots and flags of one rank's rows' tiles
        rows, n = _local_rows(op, world), SHAPES[op][1]
        exchange = (all_reduce_exchange if op == "matmul_all_reduce"
                    else reduce_scatter_exchange)
        job["workspaces"] = lambda meta: [
            *exchange(world, rows, n, triton.cdiv(rows, meta["BLOCK_M"])
                      * triton.cdiv(n, meta["BLOCK_N"]), BF16), *NO_STREAM_K]
    return job


# Relative error (Frobenius, per rank) a bfloat16 result may have against the float32
# product: its rounding (2^-9 relative) and the partials' (rounded once to bfloat16 each)
TOLERANCE = 2e-2


def _reference(op: str, world: int, job: dict[str, Any]) -> list[np.ndarray]:
    """Each rank's expected result of the fused ``job`` in float32 (every rank's inputs
    are the same arrays: a gathered shard repeats, a sum over ranks is ``world`` times the
    rank's product)."""
    x, w = (a.astype(np.float32) for a in job["inputs"](0, 0)[:2])
    product = x @ w
    if op == "all_gather_matmul":
        return [np.tile(product, (world, 1))] * world
    total = world * product
    if op == "matmul_reduce_scatter":
        seg = total.shape[0] // world
        return [total[r * seg:(r + 1) * seg] for r in range(world)]
    return [total] * world


def _largest_error(job: dict[str, Any], want: list[np.ndarray], world: int, programs: int,
                   num_warps: int | None = None) -> float:
    """The largest relative error (``bench.accuracy``), over ranks and two back-to-back
    calls (the second in the other epoch half of the workspaces), of ``job``'s results
    against ``want`` (:func:`_reference`, a result per rank). Leaves ``job`` as it was."""
    rest = {key: value for key, value in job.items() if key != "kernel"}
    out = one_gpu.run_ranks(job["kernel"], world, grid=(programs,), calls=2,
                            num_warps=num_warps, **rest)
    return max(relative_error(out[c][r][0], want[r]) for c in range(2) for r in range(world))


def _time(job: dict[str, Any], world: int, programs: int, iters: int,
          num_warps: int | None = None) -> float:
    kernel = job.pop("kernel")
    seconds = one_gpu.time_ranks(kernel, world, grid=(programs,), calls=iters,
                                 num_warps=num_warps, **job)
    return statistics.median(seconds)


def fused(worlds: list[int], iters: int, ops: tuple[str, ...] = tuple(SHAPES)
          ) -> list[dict[str, Any]]:
    """Each fused op of ``ops`` vs the local GEMMs alone, at each rank count; each row
    printed as it ends. A row whose run fails carries the reason (under ``error``) and the
    others still run, unless the GPU is stuck (``one_gpu.StuckError``: nothing more can
    run on it)."""
    rows = []
    for op, (m, n, k) in _chosen(ops):
        for world in worlds:
            programs = max(1, tiles.fill_programs() // world)
            gemm = _attempt(_gemm_times, op, world, programs, iters)
            for form in FORMS[op]:
                row = {"bench": "fused", "op": op, "form": form, "ranks": world,
                       "shape": f"{m}x{n}x{k}", "programs": programs}
                timed = gemm if isinstance(gemm, str) else _attempt(
                    _fused_times, op, world, form, programs, iters)
                if isinstance(timed, str):
                    row["error"] = timed
                else:
                    (gemm_s, gemm_tuned_s), (fused_s, tuned_s), errors = gemm, *timed
                    row.update({"fused_us": fused_s * 1e6, "gemm_us": gemm_s * 1e6,
                                "ratio": fused_s / gemm_s, "tuned_us": tuned_s * 1e6,
                                "gemm_tuned_us": gemm_tuned_s * 1e6,
                                "tuned_ratio": tuned_s / gemm_tuned_s,
                                "rel_err": max(errors)})
                    wrong = [f"{which} relative error {e:.2e} > {TOLERANCE}"
                             for which, e in zip(("table", "tuned"), errors, strict=True)
                             if not e <= TOLERANCE]
                    if wrong:
                        row["error"] = "wrong result: " + "; ".join(wrong)
                rows.append(row)
                print(f"fused: {op} {form} at {world} ranks: "
                      + (f"error: {row['error']}" if "error" in row else
                         f"tuned/GEMM tuned {row['tuned_ratio']:.3f} "
                         f"(relative error {row['rel_err']:.1e})"), flush=True)
    return rows


def _gemm_times(op: str, world: int, programs: int, iters: int) -> tuple[float, float]:
    """Seconds of the local GEMMs alone: the fixed table's tile, and tuned."""
    return (_time(_gemm_job(op), world, programs, iters, WARPS[op]),
            _time(_autotuned(_gemm_job(op), op, world), world, programs, iters))


def _fused_times(op: str, world: int, form: str, programs: int,
                 iters: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Seconds of the fused op, the fixed table's tile and tuned, and the relative errors
    of their results (:func:`_largest_error`, checked first; both jobs have the same
    inputs, so one reference serves both)."""
    table, tuned = _fused_job(op, world, form), _tuned_job(op, world, form)
    want = _reference(op, world, table)
    errors = (_largest_error(table, want, world, programs, WARPS[op]),
              _largest_error(tuned, want, world, programs))
    return ((_time(table, world, programs, iters, WARPS[op]),
             _time(tuned, world, programs, iters)), errors)


def _attempt(timings: Callable[..., Any], *args: Any) -> Any:
    """``timings(*args)``, or why it failed (a string); a stuck GPU is raised."""
    try:
        return timings(*args)
    except one_gpu.StuckError:
        raise
    except (RuntimeError, ValueError) as error:
        return str(error)


def collectives(worlds: list[int], sizes: list[int], iters: int) -> list[dict[str, Any]]:
    """all_gather (the push exchange) vs copy-engine copies of the bytes each rank
    gathers, at each rank count and per-rank size (bytes)."""
    from jax_triton_dist.runtime import cuda_driver

    drv = cuda_driver.driver()
    rows = []
    for world in worlds:
        for size in sizes:
            n = size // 4
            block, programs = tiles.exchange_block(n)
            x = np.random.default_rng(world).standard_normal(n).astype(np.float32)
            seconds = one_gpu.time_ranks(
                push_exchange_kernel, world, inputs=lambda c, r, x=x: [x],
                outputs=[((world, n), np.float32)],
                workspaces=[((2, world, n), np.float32), ((2, world, programs), np.int32)],
                grid=(programs,), kwargs=dict(n=n, SEND_CHUNKS=False, REDUCE="none",
                                              BLOCK=block), calls=iters)
            copy_s = _copy_makespan(drv, world, size, iters)
            rows.append({"bench": "collective", "op": "all_gather", "ranks": world,
                         "bytes": size, "ours_us": statistics.median(seconds) * 1e6,
                         "copy_us": copy_s * 1e6,
                         "ratio": statistics.median(seconds) / copy_s})
    return rows


def _copy_makespan(drv, world: int, size: int, iters: int, device: int = 0) -> float:
    """Median makespan of every rank copying ``world`` blocks of ``size`` bytes into its
    output, on a stream per rank."""
    blocks = [drv.alloc(device, size) for _ in range(world)]
    outs = [drv.alloc(device, world * size) for _ in range(world)]
    streams = [drv.stream_create(device) for _ in range(world)]
    start, ends = drv.event_create(device), [drv.event_create(device) for _ in range(world)]
    try:
        samples = []
        for it in range(iters + 2):
            drv.event_record(device, start, streams[0])
            for rank in range(world):
                for src in range(world):
                    drv.copy_async(device, outs[rank] + src * size, blocks[src], size,
                                   streams[rank])
                drv.event_record(device, ends[rank], streams[rank])
            elapsed = max(drv.event_elapsed_ms(device, start, end) for end in ends) / 1e3
            if it >= 2:
                samples.append(elapsed)
        return statistics.median(samples)
    finally:
        for stream in streams:
            drv.stream_synchronize(device, stream)
            drv.stream_destroy(device, stream)
        for event in (start, *ends):
            drv.event_destroy(device, event)
        for buf in blocks + outs:
            drv.free(device, buf)


def timeline_summary(events: list[dict[str, Any]]) -> dict[str, float]:
    """Microseconds read off one call's timeline events (``jtd.timeline.Recording.events``;
    the latest epoch in which every program that started also ended, when there are
    several): ``span_us`` (first program start to last program end, every rank),
    ``skew_us`` (spread of the ranks' first program starts), ``program_us`` (mean program
    run time), ``wait_us`` / ``wait_max_us`` (mean and max over programs of the time spent
    in ``dl.wait``), and where a program's time goes around its exchange:
    ``before_notify_us`` (mean, over the programs that raise a flag, of the time from their
    start to their first ``dl.notify``: a persistent GEMM+AR or GEMM+RS program's GEMM and
    pushes) and ``after_wait_us`` (mean, over the programs that wait, of the time from the
    end of their last ``dl.wait`` to their end: the sums or copies that follow it); None
    where no program raises a flag or waits."""
    if not events:
        raise ValueError("no timeline events: was the launch timed?")
    by_epoch: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_epoch[e["epoch"]].append(e)
    for epoch in sorted(by_epoch, reverse=True):
        summary = _epoch_summary(by_epoch[epoch])
        if summary is not None:
            return summary
    seen = {epoch: dict(sorted(Counter(e["kind"] for e in rows).items()))
            for epoch, rows in sorted(by_epoch.items())}
    raise ValueError(f"no epoch in which every program that started also ended (events "
                     f"by epoch and kind: {seen}; events a program keeps past its capacity "
                     f"are dropped: raise $JTD_TIMELINE_EVENTS)")


def _epoch_summary(events: list[dict[str, Any]]) -> dict[str, float] | None:
    """:func:`timeline_summary` of one epoch's events; None if some program's start or end
    is missing (dropped)."""
    spans: dict[tuple[int, int], dict[str, int]] = defaultdict(dict)
    waited: dict[tuple[int, int], int] = defaultdict(int)
    for e in sorted(events, key=lambda e: e["time_ns"]):
        key = (e["pe"], e["program"])
        if e["kind"] == "PROGRAM_START":
            spans[key]["start"] = e["time_ns"]
        elif e["kind"] == "PROGRAM_END":
            spans[key]["end"] = e["time_ns"]
        elif e["kind"] == "WAIT_START":
            spans[key]["wait"] = e["time_ns"]
        elif e["kind"] == "WAIT_END" and "wait" in spans[key]:
            waited[key] += e["time_ns"] - spans[key].pop("wait")
            spans[key]["waited"] = e["time_ns"]
        elif e["kind"] == "NOTIFY":
            spans[key].setdefault("notify", e["time_ns"])
    if not spans or any("start" not in v or "end" not in v for v in spans.values()):
        return None
    first = defaultdict(lambda: float("inf"))
    for (pe, _), v in spans.items():
        first[pe] = min(first[pe], v["start"])
    waits = [waited[k] for k in spans]
    return {"span_us": (max(v["end"] for v in spans.values())
                        - min(v["start"] for v in spans.values())) / 1e3,
            "skew_us": (max(first.values()) - min(first.values())) / 1e3,
            "program_us": statistics.mean(v["end"] - v["start"] for v in spans.values()) / 1e3,
            "wait_us": statistics.mean(waits) / 1e3, "wait_max_us": max(waits) / 1e3,
            "before_notify_us": _mean_us([v["notify"] - v["start"] for v in spans.values()
                                          if "notify" in v]),
            "after_wait_us": _mean_us([v["end"] - v["waited"] for v in spans.values()
                                       if "waited" in v])}


def _mean_us(durations_ns: list[int]) -> float | None:
    """The mean of ``durations_ns`` in microseconds; None for none."""
    return statistics.mean(durations_ns) / 1e3 if durations_ns else None


def _timeline_of(job: dict[str, Any], world: int, programs: int, num_warps: int
                 ) -> tuple[dict[str, float], int]:
    """:func:`timeline_summary` of the second of two calls of ``job`` (the first warms the
    caches), and the events dropped for lack of room."""
    from jax_triton_dist import timeline

    kernel = job.pop("kernel")
    with timeline.record() as recording:
        one_gpu.run_ranks(kernel, world, grid=(programs,), calls=2, num_warps=num_warps,
                          **job)
    try:
        return timeline_summary(recording.events), recording.dropped
    except ValueError as error:
        raise ValueError(f"{kernel.fn.__name__} at {world} ranks: {error}; "
                         f"{recording.dropped} events dropped") from None


def waits(worlds: list[int], ops: tuple[str, ...] = tuple(SHAPES)) -> list[dict[str, Any]]:
    """Each fused op of ``ops`` and its GEMM alone (fixed tiles) at each rank count, timed
    from the inside (:func:`timeline_summary`). A timeline that cannot be read fails its
    rows (with the reason, under ``error``), not the others."""
    rows = []
    for op, (m, n, k) in _chosen(ops):
        for world in worlds:
            programs = max(1, tiles.fill_programs() // world)
            gemm_read = _read_timeline(_gemm_job(op), world, programs, WARPS[op])
            for form in FORMS[op]:
                row = {"bench": "waits", "op": op, "form": form, "ranks": world,
                       "shape": f"{m}x{n}x{k}"}
                fused_read = _read_timeline(_fused_job(op, world, form), world, programs,
                                            WARPS[op])
                error = next((r for r in (gemm_read, fused_read) if isinstance(r, str)), None)
                if error is not None:
                    rows.append({**row, "error": error})
                    print(f"waits: {op} {form} at {world} ranks: {error}")
                    continue
                (gemm_t, gemm_dropped), (fused_t, dropped) = gemm_read, fused_read
                rows.append({**row, **fused_t, "gemm_span_us": gemm_t["span_us"],
                             "gemm_skew_us": gemm_t["skew_us"],
                             "gemm_program_us": gemm_t["program_us"],
                             "program_ratio": fused_t["program_us"] / gemm_t["program_us"],
                             "dropped_events": dropped + gemm_dropped})
    return rows


def _read_timeline(job: dict[str, Any], world: int, programs: int, num_warps: int
                   ) -> tuple[dict[str, float], int] | str:
    """:func:`_timeline_of`, or why it could not be read (or the job failed; a stuck GPU
    is raised)."""
    return _attempt(_timeline_of, job, world, programs, num_warps)


def _chosen(ops: tuple[str, ...]) -> list[tuple[str, tuple[int, int, int]]]:
    """``(op, shape)`` of each of ``ops`` in :data:`SHAPES`' order; an unknown op is an
    error naming the known ones."""
    unknown = [op for op in ops if op not in SHAPES]
    if unknown:
        raise ValueError(f"unknown fused op(s) {unknown}; expected some of {list(SHAPES)}")
    return [(op, shape) for op, shape in SHAPES.items() if op in ops]


PARTS = ("fused", "collectives", "waits")
DEFAULT_PARTS = ("fused", "collectives")


def run(worlds: list[int], iters: int, sizes: list[int],
        parts: tuple[str, ...] = DEFAULT_PARTS,
        done: Callable[[list[dict[str, Any]]], None] | None = None,
        ops: tuple[str, ...] = tuple(SHAPES)) -> list[dict[str, Any]]:
    """The chosen parts (:data:`PARTS`; by default :data:`DEFAULT_PARTS`), in that order;
    needs a GPU. ``ops``: the fused ops the fused and waits parts run (by default every
    one of :data:`SHAPES`). ``done(rows)``: called after each part with its rows (a later
    part's failure then keeps the earlier parts' results)."""
    runs = {"fused": lambda: fused(worlds, iters, ops),
            "collectives": lambda: collectives(worlds, sizes, iters),
            "waits": lambda: waits(worlds, ops)}
    rows = []
    for part in (p for p in PARTS if p in parts):
        new = runs[part]()
        rows += new
        if done is not None:
            done(new)
    return rows


COLUMNS = {
    "fused": [("op", "op", ""), ("form", "form", ""), ("ranks", "ranks", "d"),
              ("shape", "MxNxK", ""),
              ("programs", "programs", "d"), ("fused_us", "table us", ".1f"),
              ("gemm_us", "GEMM table us", ".1f"), ("ratio", "table/GEMM", ".3f"),
              ("tuned_us", "tuned us", ".1f"), ("gemm_tuned_us", "GEMM tuned us", ".1f"),
              ("tuned_ratio", "tuned/GEMM tuned", ".3f"), ("rel_err", "rel. error", ".1e"),
              ("error", "error", "")],
    "waits": [("op", "op", ""), ("form", "form", ""), ("ranks", "ranks", "d"),
              ("span_us", "span us", ".1f"),
              ("gemm_span_us", "GEMM span us", ".1f"), ("skew_us", "skew us", ".1f"),
              ("gemm_skew_us", "GEMM skew us", ".1f"), ("program_us", "program us", ".1f"),
              ("gemm_program_us", "GEMM program us", ".1f"),
              ("program_ratio", "program/GEMM", ".3f"), ("wait_us", "wait us", ".1f"),
              ("wait_max_us", "wait max us", ".1f"),
              ("before_notify_us", "to 1st notify us", ".1f"),
              ("after_wait_us", "after last wait us", ".1f"),
              ("dropped_events", "dropped", "d"),
              ("error", "error", "")],
    "collective": [("op", "op", ""), ("ranks", "ranks", "d"), ("bytes", "bytes/rank", "d"),
                   ("ours_us", "ours us", ".1f"), ("copy_us", "copies us", ".1f"),
                   ("ratio", "ours/copies", ".3f")],
}
