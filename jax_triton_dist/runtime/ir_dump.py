"""``JTD_DUMP_IR=DIR``: every compiled kernel's stages, one folder per call site and device.

``DIR/<kernel>.site<id>.device<d>/`` holds ``kernel.ttir``, ``kernel.ttgir``, ``kernel.llir``,
``kernel.ptx``, ``kernel.cubin`` (the stages Triton kept) and ``metadata.json`` (what was
compiled: signature, constexprs, ranks, compile options, Triton's metadata). On the CPU
backend, which interprets kernels, the first run of a site on a device compiles it for
CUDA (``sm_90``, no GPU needed) to dump what the GPU would run. The Ascend lane
(``python -m jax_triton_dist.ascend lower``) writes its stages to ``DIR/ascend/`` when it
has no ``--out``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jax_triton_dist.runtime import call_site, debug_settings, tuning

__all__ = ["folder", "dump"]


def folder(root: str, site: call_site.CallSite, device: int) -> str:
    """The folder of ``site`` on ``device`` under ``root``."""
    return os.path.join(root, f"{site.label}.site{site.call_id}.device{device}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def dump(site: call_site.CallSite, variant: tuning.Variant, device: int, kernel: Any,
         signature: dict[str, str], target: str) -> str | None:
    """Writes the compiled ``kernel`` (``variant`` of ``site``)'s stages for (``site``,
    ``device``) when ``$JTD_DUMP_IR`` is set; returns the folder, or None."""
    root = debug_settings.dump_ir_dir()
    if root is None:
        return None
    path = folder(root, site, device)
    os.makedirs(path, exist_ok=True)
    for stage, text in kernel.asm.items():
        mode = "wb" if isinstance(text, bytes) else "w"
        with open(os.path.join(path, f"kernel.{stage}"), mode) as f:
            f.write(text)
    metadata = {
        "kernel": site.label, "site": site.call_id, "device": device, "target": target,
        "num_ranks": site.num_ranks, "grid": list(variant.grid), "signature": signature,
        "constexprs": {k: v for k, v in variant.kwargs.items()
                       if signature.get(k) == "constexpr"},
        "options": variant.options, "timeline_events": site.timeline,
        "autotune_config": None if variant.config is None else variant.config.as_dict(),
        "triton_metadata": _jsonable(getattr(kernel.metadata, "_asdict", lambda: {})()),
    }
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
    return path
