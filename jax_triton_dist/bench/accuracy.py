"""How far a benchmarked kernel's result is from its reference: the suites check every
result they time, so that no time of a wrong kernel passes for a time."""

from __future__ import annotations

import numpy as np


def relative_error(out, ref) -> float:
    """``|out - ref| / |ref|`` (Frobenius norms) in float32; NaN where ``out`` holds NaN,
    so a check ``not error <= bound`` fails it."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
