"""``python -m jax_triton_dist.stress OP [OP ...] [options]``: see ``stress/__init__.py``.

Examples::

    python -m jax_triton_dist.stress all --iters 20              # every op, 8 CPU devices
    python -m jax_triton_dist.stress all_gather_matmul --straggler --verify-hang 50
    python -m jax_triton_dist.stress all --seed 7 --only 13      # reproduce one case

Exit status 0 when every case passed, 1 when one failed (its seed and iteration are
printed), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jax_triton_dist.stress",
        description="Random shapes, dtypes and rank counts for the public ops, checked "
                    "against jax.lax / jnp in float32.")
    parser.add_argument("ops", nargs="+", help="op names, or 'all'")
    parser.add_argument("--iters", type=int, default=10, help="cases per op (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    parser.add_argument("--only", type=int, default=None, metavar="I",
                        help="run only iteration I (reproduces a reported case)")
    parser.add_argument("--ranks", default=None,
                        help="comma-separated rank counts to draw from (default: 1,2,4,8 "
                             "that fit the devices)")
    parser.add_argument("--dtypes", default=None, help="comma-separated dtypes (default: "
                        "each op's own list)")
    parser.add_argument("--straggler", nargs="?", type=float, const=0.05, default=None,
                        metavar="SECONDS", help="delay a random rank by SECONDS (default "
                        "0.05) every iteration (CPU devices)")
    parser.add_argument("--verify-hang", type=int, default=0, metavar="N",
                        help="N back-to-back calls without checks before the checked one")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a wait may take (JTD_WAIT_TIMEOUT; default 60)")
    parser.add_argument("--platform", default=None, help="cpu or gpu (default: JAX's)")
    parser.add_argument("--scale", type=int, default=None,
                        help="shape multiplier (default 1 on CPU, 16 on GPUs)")
    parser.add_argument("--module", action="append", default=[],
                        help="import MODULE first (it may register more ops)")
    parser.add_argument("--json", default=None, help="write every case's result here")
    parser.add_argument("--cpu-devices", type=int, default=8,
                        help="simulated CPU devices (default 8)")
    return parser.parse_args(argv)


def _setup_environment(args: argparse.Namespace) -> None:
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" {flag}={args.cpu_devices}").strip()
    if args.timeout is not None:
        os.environ["JTD_WAIT_TIMEOUT"] = str(args.timeout)


def _run_case(case, mesh, dtype: str, args, rng) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_triton_dist.stress import tolerance
    from jax_triton_dist.testing import delayed_device
    from jax_triton_dist.testing.reference import compare

    fn = jax.jit(jax.shard_map(case.body, mesh=mesh, in_specs=case.in_specs,
                               out_specs=case.out_specs))
    ref = jax.jit(jax.shard_map(case.reference, mesh=mesh, in_specs=case.in_specs,
                                out_specs=case.out_specs))
    inputs = [jnp.asarray(x) for x in case.inputs]
    wide = [x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
            for x in inputs]
    straggler = None
    if args.straggler is not None and mesh.size > 1:
        straggler = int(rng.integers(mesh.size))
    start = time.perf_counter()
    if straggler is not None:
        with delayed_device(mesh.devices.flat[straggler].id, args.straggler):
            got = _calls(fn, inputs, args.verify_hang)
    else:
        got = _calls(fn, inputs, args.verify_hang)
    seconds = time.perf_counter() - start
    want = jax.block_until_ready(ref(*wide))
    rtol, scale = tolerance(dtype, case.kind)
    got_f = got.astype(want.dtype) if got.dtype != want.dtype else got
    peak = float(np.max(np.abs(np.asarray(want, np.float64)), initial=0.0))
    rows = compare("out", got_f, want, mesh, scale * peak, rtol)
    return {"ok": all(r.ok for r in rows), "max_abs": max(r.max_abs for r in rows),
            "max_rel": max(r.max_rel for r in rows), "seconds": seconds,
            "straggler": straggler,
            "bad_ranks": [r.rank["x"] for r in rows if not r.ok]}


def _calls(fn, inputs, back_to_back: int):
    import jax

    for _ in range(back_to_back):
        fn(*inputs)  # not checked: queued back to back, as a training loop would
    return jax.block_until_ready(fn(*inputs))


def _ranks(text: str | None, devices: int) -> list[int]:
    wanted = [1, 2, 4, 8] if text is None else [int(v) for v in text.split(",")]
    fits = [r for r in wanted if r <= devices]
    if not fits:
        raise SystemExit(f"stress: no rank count of {wanted} fits the {devices} devices")
    return fits


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    _setup_environment(args)
    for module in args.module:
        importlib.import_module(module)

    import jax
    import numpy as np

    from jax_triton_dist.stress import registry

    ops = registry()
    names = list(ops) if args.ops == ["all"] else args.ops
    unknown = [n for n in names if n not in ops]
    if unknown:
        print(f"stress: unknown ops {unknown}; known: {', '.join(ops)}", file=sys.stderr)
        return 2
    devices = jax.devices(args.platform)
    rank_counts = _ranks(args.ranks, len(devices))
    scale = args.scale or (1 if devices[0].platform == "cpu" else 16)
    if args.straggler is not None and devices[0].platform != "cpu":
        print("stress: --straggler delays CPU devices only (GPU launches do not pass "
              "through Python)", file=sys.stderr)
        return 2
    print(f"stress: {', '.join(names)} on {len(devices)} {devices[0].platform} devices, ranks "
          f"{rank_counts}, seed {args.seed}, {args.iters} iterations"
          + (f", straggler {args.straggler} s" if args.straggler is not None else "")
          + (f", {args.verify_hang} unchecked calls before each check" if args.verify_hang
             else ""))
    results = []
    iterations = [args.only] if args.only is not None else range(args.iters)
    for name in names:
        op = ops[name]
        dtypes = args.dtypes.split(",") if args.dtypes else list(op.dtypes)
        for i in iterations:
            rng = np.random.default_rng([args.seed, i, sum(map(ord, name))])
            n = int(rng.choice([r for r in rank_counts if r >= op.min_ranks]))
            dtype = str(rng.choice(dtypes))
            mesh = jax.sharding.Mesh(np.array(devices[:n]), ("x",))
            row = {"op": name, "iter": i, "ranks": n, "dtype": dtype, "seed": args.seed}
            try:
                case = op.draw(rng, n, dtype, scale)
                row["case"] = case.description
                row.update(_run_case(case, mesh, dtype, args, rng))
            except Exception as error:  # a failed case is reported, the run goes on
                row.update(ok=False, error=f"{type(error).__name__}: {error}".splitlines()[0],
                           trace=traceback.format_exc())
            results.append(row)
            _print_case(row)
    _print_summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "trace"} for r in results], f,
                      indent=1)
    failed = [r for r in results if not r["ok"]]
    for row in failed:
        print(f"FAILED {row['op']} iteration {row['iter']}: reproduce with python -m "
              f"jax_triton_dist.stress {row['op']} --seed {row['seed']} --only {row['iter']}"
              + "".join(f" --module {m}" for m in args.module))
    return 1 if failed else 0


def _print_case(row: dict[str, Any]) -> None:
    status = "ok" if row["ok"] else "FAIL"
    head = (f"{row['op']:<22} it={row['iter']:<3} ranks={row['ranks']} {row['dtype']:<14} "
            f"{row.get('case', ''):<30}")
    if "error" in row:
        print(f"{head} {status}: {row['error']}", flush=True)
        return
    extra = f" straggler=rank{row['straggler']}" if row.get("straggler") is not None else ""
    bad = f" wrong on ranks {row['bad_ranks']}" if row["bad_ranks"] else ""
    print(f"{head} max_abs={row['max_abs']:.2e} max_rel={row['max_rel']:.2e} "
          f"{row['seconds'] * 1e3:7.1f} ms {status}{extra}{bad}", flush=True)


def _print_summary(results: list[dict[str, Any]]) -> None:
    print("\nsummary")
    print(f"{'op':<22} {'cases':>5} {'passed':>6} {'failed':>6} {'max_rel':>9}")
    for name in dict.fromkeys(r["op"] for r in results):
        rows = [r for r in results if r["op"] == name]
        passed = sum(r["ok"] for r in rows)
        rel = max((r.get("max_rel", 0.0) for r in rows), default=0.0)
        print(f"{name:<22} {len(rows):>5} {passed:>6} {len(rows) - passed:>6} {rel:>9.2e}")


if __name__ == "__main__":
    sys.exit(main())
