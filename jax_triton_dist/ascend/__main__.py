"""``python -m jax_triton_dist.ascend lower``: compiles every kernel of ``kernels/`` for
Ascend down to HIVM IR and checks that its distributed operations survived.

    python -m jax_triton_dist.ascend lower [--kernels all|NAME ...] [--mapping args|aclshmem ...]
        [--ranks 2 8] [--target Ascend910B3] --out DIR [--python PATH] [--markdown ASCEND.md]

triton-ascend replaces ``triton``, so it lives in its own environment: ``--python``, else
``$JTD_ASCEND_PYTHON``, else ``.venv-ascend/bin/python`` in the current directory, else this
interpreter if it has triton-ascend. Writes, per kernel, ``ttir.mlir``, ``ttadapter.mlir``,
``hivm.mlir`` and ``command.txt`` (the exact ``bishengir-compile`` command) under
``DIR/<mapping>/<kernel>-r<ranks>/``, and ``DIR/report.json``; prints the table. Exit
status 0 only when every kernel reached HIVM IR with its semantics intact.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

PYTHON_ENV = "JTD_ASCEND_PYTHON"
INSTALL_LINE = ("python3 -m venv .venv-ascend && .venv-ascend/bin/pip install "
                "triton-ascend==3.2.0 ascendnpu-ir==1.2.0 pybind11 numpy")

__all__ = ["PYTHON_ENV", "INSTALL_LINE", "ascend_python", "main"]


def _has_triton_ascend(python: str) -> bool:
    probe = "import triton.backends.ascend.compiler, ascendnpuir"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def ascend_python(explicit: str | None = None) -> str | None:
    """The Python of the triton-ascend environment, or None."""
    candidates = [explicit, os.environ.get(PYTHON_ENV),
                  os.path.join(os.getcwd(), ".venv-ascend", "bin", "python"), sys.executable]
    for python in candidates:
        if python and os.path.exists(python) and _has_triton_ascend(python):
            return python
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_triton_dist.ascend",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    lower = sub.add_parser("lower", help="lower the kernels to HIVM IR and check them")
    lower.add_argument("--kernels", nargs="+", default=["all"], help="all, or kernel names")
    lower.add_argument("--mapping", nargs="+", choices=("args", "aclshmem"),
                       default=["args", "aclshmem"])
    lower.add_argument("--ranks", nargs="+", type=int, default=[2, 8])
    lower.add_argument("--target", default="Ascend910B3")
    lower.add_argument("--out", default=None,
                       help="output folder (default: $JTD_DUMP_IR/ascend when JTD_DUMP_IR is "
                            "set)")
    lower.add_argument("--python", help="the triton-ascend environment's Python")
    lower.add_argument("--markdown", help="also write the report as Markdown (ASCEND.md)")
    lower.add_argument("--controls", action="store_true",
                       help="also lower the negative controls: the check must fail them")
    args = parser.parse_args(argv)
    if any(r < 1 for r in args.ranks):
        parser.error(f"--ranks must be positive, got {args.ranks}")
    if args.out is None:
        dump = os.environ.get("JTD_DUMP_IR")
        if not dump:
            parser.error("--out is required (or set JTD_DUMP_IR: the stages then go to "
                         "$JTD_DUMP_IR/ascend)")
        args.out = os.path.join(dump, "ascend")
    python = ascend_python(args.python)
    if python is None:
        print("jax_triton_dist.ascend: no triton-ascend environment found (tried --python, "
              f"${PYTHON_ENV}, ./.venv-ascend). Make one with:\n  {INSTALL_LINE}",
              file=sys.stderr)
        return 2
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    worker = os.path.join(package, "ascend", "worker.py")
    shown = " ".join(["python -m jax_triton_dist.ascend", *(argv if argv is not None
                                                            else sys.argv[1:])])
    command = [python, worker, "--package", package, "--out", os.path.abspath(args.out),
               "--kernels", *args.kernels, "--mapping", *args.mapping,
               "--ranks", *map(str, args.ranks), "--target", args.target, "--command", shown]
    if args.markdown:
        command += ["--markdown", os.path.abspath(args.markdown)]
    if args.controls:
        command.append("--controls")
    env = dict(os.environ, PYTHONPATH="")  # the worker registers the package itself
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
