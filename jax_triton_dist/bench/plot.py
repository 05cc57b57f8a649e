"""Plots of benchmark results (the JSON the suites write): ours against the baseline.

* ``collectives``: time against message size per op (log-log), ours vs ``jax.lax``;
* ``gemm``: TFLOP/s per shape, ours vs ``jnp.dot``;
* ``single-gpu``: fused ops' time per shape (ours, the GEMM tile, ``jnp.dot``), the heap
  copies' bandwidth against size, the launch overhead.

matplotlib is an optional extra (``pip install '.[plot]'``).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["plot", "plot_file"]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install '.[plot]' (or pip install "
                         "matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(machine: dict[str, Any], what: str) -> str:
    return (f"{what} — {machine.get('device_count', '?')} x {machine.get('device_kind', '?')}"
            f", jax {machine.get('jax', '?')}, {machine.get('date', '')[:10]}")


def _collectives(plt, rows, machine):
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.6), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
        sizes = [r["bytes"] for r in mine]
        ax.loglog(sizes, [r["ours_us"] for r in mine], "o-", label="jax_triton_dist")
        ax.loglog(sizes, [r["lax_us"] for r in mine], "s--", label="jax.lax")
        ax.set_title(f"{op} ({mine[0]['ranks']} ranks, {mine[0]['dtype']})", fontsize=9)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("µs")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(machine, "collectives"), fontsize=10)
    return fig


def _bars(ax, labels, series: dict[str, list[float]], ylabel: str):
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def _gemm(plt, rows, machine):
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 3, 3.8))
    # best_tflops: the tuned tile (kernel-alone timing); ours_tflops: results written before
    # the autotuner (best of a fixed search, scan harness).
    _bars(ax, [r["shape"] for r in rows], {
        "jax_triton_dist tile": [r.get("best_tflops", r.get("ours_tflops")) for r in rows],
        "jnp.dot": [r["xla_tflops"] for r in rows]}, "TFLOP/s")
    ax.set_title(_title(machine, f"GEMM ({rows[0].get('dtype', '')})"), fontsize=10)
    return fig


def _single_gpu(plt, rows, machine):
    parts = [p for p in ("fused", "copy", "launch") if any(r.get("bench") == p for r in rows)]
    widths = [2.5 if p == "fused" else 1 for p in parts]
    fig, axes = plt.subplots(1, len(parts), figsize=(4.5 * sum(widths), 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, part in zip(axes[0], parts, strict=True):
        mine = [r for r in rows if r.get("bench") == part]
        if part == "fused":
            short = {"all_gather_matmul": "AG+MM", "matmul_reduce_scatter": "MM+RS",
                     "matmul_all_reduce": "MM+AR"}
            _bars(ax, [f"{short.get(r['op'], r['op'])} {r['shape']} {r.get('layout', 'kn')}"
                       for r in mine],
                  {"fused op": [r["ours_us"] / r["dot_us"] for r in mine],
                   "GEMM tile": [r["tile_us"] / r["dot_us"] for r in mine]},
                  "time / jnp.dot time")
            ax.axhline(1.0, color="gray", lw=1)
            ax.set_title("fused ops at world size 1 (below 1: faster than jnp.dot)", fontsize=9)
        elif part == "copy":
            mine.sort(key=lambda r: r["bytes"])
            sizes = [r["bytes"] for r in mine]
            ax.semilogx(sizes, [r["heap_gbps"] for r in mine], "o-", label="into the heap")
            ax.semilogx(sizes, [r["d2d_gbps"] for r in mine], "s--", label="cuMemcpyDtoD")
            ax.set_xlabel("bytes")
            ax.set_ylabel("GB/s")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            ax.set_title("symmetric-heap copies", fontsize=9)
        else:
            _bars(ax, [r["what"][:40] for r in mine],
                  {"triton_call": [r["ours_us"] for r in mine],
                   "bare launch": [r["bare_us"] for r in mine]}, "µs per call")
            ax.set_title("launch overhead", fontsize=9)
    fig.suptitle(_title(machine, "single GPU"), fontsize=10)
    return fig


_PLOTTERS = {"collectives": _collectives, "gemm": _gemm, "single-gpu": _single_gpu}


def plot(suite: str, rows: list[dict[str, Any]], machine: dict[str, Any], out: str) -> str:
    """Draws ``rows`` of ``suite`` into the image ``out``; returns ``out``."""
    if suite not in _PLOTTERS:
        raise ValueError(f"no plot for suite {suite!r} (known: {', '.join(_PLOTTERS)})")
    if not rows:
        raise ValueError(f"no {suite} results to plot")
    plt = _pyplot()
    fig = _PLOTTERS[suite](plt, rows, machine)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")
    return out


def plot_file(path: str, out: str) -> str:
    """Plots a results file written by ``python -m jax_triton_dist.bench``."""
    with open(path) as f:
        data = json.load(f)
    return plot(data["suite"], data["results"], data.get("machine", {}), out)
