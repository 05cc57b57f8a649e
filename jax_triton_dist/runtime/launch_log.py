"""``JTD_LOG``: a line per call-site plan, launch and compile, through absl logging.

Lines have one form on every backend, ``jtd <event> kernel=... site=... device=...``,
followed by ``key=value`` fields, so they can be grepped and parsed.
"""

from __future__ import annotations

from typing import Any

from absl import logging

from jax_triton_dist.runtime import debug_settings

__all__ = ["enabled", "line", "emit", "plan", "launch", "compiled"]


def enabled(category: str) -> bool:
    """Whether ``$JTD_LOG`` asks for ``category`` (``plan``, ``launch``, ``compile``)."""
    return debug_settings.logs(category)


def line(event: str, **fields: Any) -> str:
    """``jtd <event> k=v ...`` (the form of every line)."""
    return " ".join([f"jtd {event}"] + [f"{k}={_text(v)}" for k, v in fields.items()])


def _text(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(map(str, value)) + ")"
    return str(value)


def emit(text: str) -> None:
    """Writes one line through absl logging, shown whatever absl's threshold (outside
    ``absl.app`` it is WARNING): these lines were asked for."""
    logging.log(logging.WARNING if logging.get_verbosity() < logging.INFO else logging.INFO,
                "%s", text)


def _emit(event: str, **fields: Any) -> None:
    emit(line(event, **fields))


def plan(site: Any, variant: Any, device: int, rank: int, team: Any, backend: str) -> None:
    """A call site's first run on ``device`` (which runs ``variant``)."""
    if enabled("plan"):
        _emit("plan", kernel=site.label, site=site.call_id, device=device, rank=rank,
              num_ranks=site.num_ranks, team=tuple(team.pes), grid=variant.grid,
              backend=backend, timeline=int(bool(site.timeline)))


def launch(label: str, call_id: int, device: int, rank: int, num_ranks: int, team: Any,
           epoch: int, grid: Any) -> None:
    """One launch of a call site on ``device``."""
    if enabled("launch"):
        _emit("launch", kernel=label, site=call_id, device=device, rank=rank,
              num_ranks=num_ranks, team=team, epoch=epoch, grid=grid)


def compiled(site: Any, seconds: float, target: str) -> None:
    """A call site's kernel compiled for ``target``."""
    if enabled("compile"):
        _emit("compile", kernel=site.label, site=site.call_id, target=target,
              seconds=f"{seconds:.3f}")
