"""``python -m jax_triton_dist doctor``: checks this installation (see ``doctor.py``).

The other tools have their own entry points: ``python -m jax_triton_dist.bench``,
``python -m jax_triton_dist.stress``, ``python -m jax_triton_dist.ascend``,
``python -m jax_triton_dist.multiprocess``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_triton_dist")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor_parser = sub.add_parser(
        "doctor", help="versions, platform, SHMEM backend, libraries; then a small "
        "all_reduce and ring kernel on the local devices")
    doctor_parser.add_argument("--verbose", action="store_true",
                               help="show the traceback of a failed smoke test")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "doctor":
        from jax_triton_dist import doctor

        return doctor.main(args.verbose)
    return 2


if __name__ == "__main__":
    sys.exit(main())
