"""``python -m jax_triton_dist.bench {collectives,gemm,single-gpu,overlap} [options]
[--json PATH] [--plot PNG]``, and ``python -m jax_triton_dist.bench plot RESULTS.json --out
PNG``.

Without a GPU the suite runs on 8 simulated CPU devices (Triton's interpreter): a smoke
test of the benchmark, not a performance record. With ``--platform gpu`` (or a GPU as
JAX's default backend) it times the compiled kernels on the GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse(argv: list[str]) -> argparse.Namespace:
    from jax_triton_dist.bench.overlap import DEFAULT_PARTS, PARTS
    from jax_triton_dist.bench.overlap import SHAPES as OVERLAP_SHAPES
    from jax_triton_dist.bench.single_gpu import LAYOUTS

    parser = argparse.ArgumentParser(prog="python -m jax_triton_dist.bench")
    sub = parser.add_subparsers(dest="suite", required=True)
    coll = sub.add_parser("collectives", help="collectives vs jax.lax")
    coll.add_argument("--sizes", type=int, nargs="+", default=None,
                      help="message sizes in bytes (default: 1 KiB, 16 KiB, 256 KiB on CPU)")
    coll.add_argument("--ranks", type=int, default=None, help="devices (default: all)")
    coll.add_argument("--dtype", default="float32")
    coll.add_argument("--iters", type=int, default=5)
    coll.add_argument("--platform", default=None, help="cpu, gpu (default: JAX's default)")
    coll.add_argument("--json", default="bench_collectives.json", help="output JSON path")
    coll.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw the results (needs matplotlib: pip install '.[plot]')")
    gemm = sub.add_parser("gemm", help="the GEMM tiles vs jnp.dot (one device)")
    gemm.add_argument("--shapes", nargs="+", default=None, help="MxNxK (default: the TP8 set)")
    gemm.add_argument("--iters", type=int, default=5)
    gemm.add_argument("--dtype", default="bfloat16")
    gemm.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                      help="time only the configs whose description (as the table prints "
                           "it) contains one of these texts, and the fixed table's config")
    gemm.add_argument("--platform", default=None)
    gemm.add_argument("--json", default="bench_gemm.json", help="output JSON path")
    gemm.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw the results (needs matplotlib: pip install '.[plot]')")
    single = sub.add_parser("single-gpu", help="triton_call launch overhead, copies into the "
                            "symmetric heap, fused ops at world size 1 (one GPU)")
    single.add_argument("--parts", nargs="+", default=["launch", "copy", "fused"],
                        choices=["launch", "copy", "fused"])
    single.add_argument("--shapes", nargs="+", default=None,
                        help="MxNxK of the fused part (default: the TP8 set)")
    single.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS,
                        help="layouts of the fused part: weight [K, N] (kn) or [N, K] (nk); "
                             "batched: x [8, M/8, K] gathered/scattered along axis 1")
    single.add_argument("--iters", type=int, default=10)
    single.add_argument("--platform", default=None)
    single.add_argument("--json", default="bench_single_gpu.json", help="output JSON path")
    single.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw the results (needs matplotlib: pip install '.[plot]')")
    overlap = sub.add_parser("overlap", help="one-GPU proxy for overlap: fused ops at 2-8 "
                             "ranks sharing the GPU vs their local GEMMs alone (needs a GPU)")
    overlap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    overlap.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 20, 4 << 20],
                         help="bytes per rank of the all_gather part")
    overlap.add_argument("--iters", type=int, default=10)
    overlap.add_argument("--parts", nargs="+", default=list(DEFAULT_PARTS), choices=PARTS,
                         help="waits: the fused ops and their GEMMs timed from the inside "
                         "(intra-kernel timeline: spans, launch skew, program times, waits)")
    overlap.add_argument("--ops", nargs="+", default=list(OVERLAP_SHAPES),
                         choices=list(OVERLAP_SHAPES),
                         help="the fused ops of the fused and waits parts (default: all)")
    overlap.add_argument("--json", default="bench_overlap.json", help="output JSON path")
    att = sub.add_parser("attention", help="sequence-parallel attention and flash-decode at "
                         "world size 1 vs jax.nn.dot_product_attention (XLA, cuDNN)")
    att.add_argument("--seqs", type=int, nargs="+", default=None,
                     help="sequence lengths (default: 4k 16k 32k on GPU, 256 on CPU)")
    att.add_argument("--causal", action="store_true")
    att.add_argument("--iters", type=int, default=10)
    att.add_argument("--platform", default=None)
    att.add_argument("--json", default="bench_attention.json", help="output JSON path")
    draw = sub.add_parser("plot", help="draw a results JSON written by a suite")
    draw.add_argument("results", help="a JSON file written with --json")
    draw.add_argument("--out", required=True, metavar="PNG", help="image to write")
    return parser.parse_args(argv)


def _finish(args: argparse.Namespace, suite: str, rows: list) -> None:
    from jax_triton_dist.bench import plot, timing

    timing.write_json(args.json, suite, rows)
    if args.plot:
        plot.plot(suite, rows, timing.machine(), args.plot)


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.suite == "plot":
        from jax_triton_dist.bench import plot

        plot.plot_file(args.results, args.out)
        return
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()

    import jax

    from jax_triton_dist.bench import collectives, gemm, single_gpu, timing

    if args.suite == "single-gpu":
        shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes
                  else None)
        device = jax.devices(args.platform)[0]
        print(f"single-GPU costs on {device.device_kind} ({device.platform}), median of "
              f"{args.iters}")
        results = single_gpu.run(args.iters, args.platform, args.parts, shapes, args.layouts)
        rows = [r for part in results.values() for r in part]
        timing.print_parts(rows, single_gpu.COLUMNS)
        _finish(args, "single-gpu", rows)
        return

    if args.suite == "overlap":
        from jax_triton_dist.bench import overlap

        device = jax.devices("gpu")[0]
        print(f"one-GPU overlap proxy on {device.device_kind}: ranks share the GPU (not "
              f"NVLink), median makespan of {args.iters}")
        rows: list = []

        def part_done(new: list) -> None:  # each part's table and the JSON so far at once
            rows.extend(new)
            timing.print_parts(new, overlap.COLUMNS)
            timing.write_json(args.json, "overlap", rows)

        overlap.run(args.ranks, args.iters, args.sizes, tuple(args.parts), done=part_done,
                    ops=tuple(args.ops))
        return

    if args.suite == "attention":
        from jax_triton_dist.bench import attention

        device = jax.devices(args.platform)[0]
        seqs = args.seqs or (attention.SEQS if device.platform == "gpu" else [256])
        print(f"attention on {device.device_kind} ({device.platform}), {attention.HEADS} heads, "
              f"head_dim {attention.HEAD_DIM}, bf16, causal={args.causal}, kernel time")
        rows = attention.run(seqs, args.iters, args.causal, args.platform)
        timing.print_parts(rows, attention.COLUMNS)
        timing.write_json(args.json, "attention", rows)
        return

    if args.suite == "gemm":
        shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes
                  else gemm.SHAPES)
        device = jax.devices(args.platform)[0]
        print(f"GEMM tiles vs jnp.dot on {device.device_kind} ({device.platform}), {args.dtype}")
        rows = gemm.run(shapes, args.iters, args.dtype, args.platform, only=args.only)
        timing.print_table(rows, gemm.COLUMNS)
        _finish(args, "gemm", rows)
        return

    devices = jax.devices(args.platform)
    ranks = args.ranks or len(devices)
    default_sizes = [1 << 10, 16 << 10, 256 << 10]
    if devices[0].platform != "cpu":
        default_sizes = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
    sizes = args.sizes or default_sizes
    print(f"collectives on {ranks} x {devices[0].device_kind} ({devices[0].platform}), "
          f"{args.dtype}, median of {args.iters}")
    rows = collectives.run(sizes, ranks, args.dtype, args.iters, args.platform)
    timing.print_table(rows, collectives.COLUMNS)
    _finish(args, "collectives", rows)


if __name__ == "__main__":
    main()
