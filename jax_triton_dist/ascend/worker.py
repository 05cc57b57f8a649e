"""The Ascend lowering's entry point in the triton-ascend environment (a script).

That environment has triton-ascend (which replaces ``triton``) but neither JAX nor the
project's C++ extensions, so the package's ``__init__`` modules (which import them) are
not run: the packages the lowering needs are registered by path, and only the kernel
language, the kernels, the tile choices and this tool are imported.

    <ascend python> worker.py --package DIR --out OUT [--kernels ...] [--ranks ...]
                              [--mapping ...] [--target ARCH] [--markdown PATH --command CMD]
"""

from __future__ import annotations

import argparse
import os
import sys
import types


def _register_packages(package: str) -> None:
    """Registers ``jax_triton_dist`` and the subpackages the lowering imports, by path,
    without running their ``__init__``."""
    kernels = os.path.join(package, "kernels")
    if not os.path.isdir(kernels):  # a source tree: kernels/ beside the package
        kernels = os.path.join(os.path.dirname(package), "kernels")
    for name, path in (("jax_triton_dist", package),
                       ("jax_triton_dist.shmem", os.path.join(package, "shmem")),
                       ("jax_triton_dist.kernels", kernels)):
        module = types.ModuleType(name)
        module.__path__ = [path]
        sys.modules[name] = module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", required=True, help="the jax_triton_dist package folder")
    parser.add_argument("--out", required=True)
    parser.add_argument("--kernels", nargs="+", default=["all"])
    parser.add_argument("--ranks", nargs="+", type=int)
    parser.add_argument("--mapping", nargs="+", default=["args", "aclshmem"])
    parser.add_argument("--target")
    parser.add_argument("--markdown")
    parser.add_argument("--command", default="python -m jax_triton_dist.ascend lower")
    parser.add_argument("--controls", action="store_true",
                        help="also lower the negative controls (the check must fail them)")
    args = parser.parse_args(argv)
    _register_packages(os.path.abspath(args.package))

    import json

    from jax_triton_dist.ascend import catalog, lowering, report

    names = catalog.case_names() if args.kernels == ["all"] else args.kernels
    os.makedirs(args.out, exist_ok=True)
    records = report.run(names, args.ranks or catalog.RANKS, args.mapping, args.out,
                         args.target or lowering.DEFAULT_ARCH)
    print(report.table(records))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report.markdown(records, args.command))
    failed = [r for r in records if r["stage"] != "hivm" or not r["checks"]["passed"]]
    summary = {"kernels": len(records), "failed": len(failed)}
    if args.controls:
        controls = report.run_controls(args.out, args.target or lowering.DEFAULT_ARCH)
        print("negative controls (the check must fail each):")
        print(report.table(controls))
        summary["controls_missed"] = [r["kernel"] for r in controls if not r["control_ok"]]
        failed += [r for r in controls if not r["control_ok"]]
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
