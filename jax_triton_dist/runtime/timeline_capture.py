"""Collects timed launches' events (``language/timeline.py``) and writes Chrome traces.

A call site is timed when it is traced while a recording is open (``jtd.timeline.record``)
or ``$JTD_TIMELINE`` is set. The CPU dispatcher hands each timed launch's events over when
the launch ends; compiled launches leave theirs in the site's timeline area, read here when
the recording closes, when the site is released, and at exit — after the GPUs finished.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from typing import Any

from jax_triton_dist.language import timeline
from jax_triton_dist.runtime import call_site, debug_settings
from jax_triton_dist.shmem import heap, lifetime

__all__ = ["capacity", "start", "stop", "add_events", "planned_on_gpu", "harvest", "collect",
           "chrome_trace", "write"]

_lock = threading.Lock()
_open = 0  # recordings open now
_rows: list[dict[str, Any]] = []
_dropped = 0
_kept: dict[tuple[int, int, int], int] = {}  # (site, pe, program) -> CPU events kept
_exit_hook = threading.Event()
_gpu_sites: dict[int, call_site.CallSite] = {}  # timed sites planned on GPUs


def capacity() -> int:
    """Events per program for a call site traced now; 0: not timed."""
    if _open == 0 and debug_settings.timeline_path() is None:
        return 0
    if _open == 0 and not _exit_hook.is_set():
        _exit_hook.set()
        atexit.register(_write_at_exit)
    return debug_settings.timeline_events()


def start() -> None:
    """Opens a recording: sites traced from now on are timed; events are kept."""
    global _open
    with _lock:
        _open += 1


def stop() -> None:
    """Closes a recording."""
    global _open
    with _lock:
        _open -= 1


def _row(site: call_site.CallSite, device: int, pe: int, rank: int, clock: str,
         event: tuple[int, int, int, int, int]) -> dict[str, Any]:
    program, time_ns, kind, epoch, arg = event
    return {"kernel": site.label, "site": site.call_id, "device": device, "pe": pe,
            "rank": rank, "num_ranks": site.num_ranks, "program": program,
            "time_ns": time_ns, "kind": timeline.Kind(kind).name, "epoch": epoch, "arg": arg,
            "clock": clock}


def add_events(site: call_site.CallSite, device: int, pe: int, rank: int,
               events: list[tuple[int, int, int, int, int]]) -> None:
    """A CPU launch's events (host clock). As on GPUs, a program keeps at most the site's
    capacity of events until they are collected; later ones are counted as dropped."""
    global _dropped
    with _lock:
        for event in events:
            key = (site.call_id, pe, event[0])
            kept = _kept.get(key, 0)
            if kept >= site.timeline:
                _dropped += 1
                continue
            _kept[key] = kept + 1
            _rows.append(_row(site, device, pe, rank, "host", event))


def planned_on_gpu(site: call_site.CallSite) -> None:
    """A timed site was planned on a GPU: its timeline area is read later."""
    with _lock:
        _gpu_sites[site.call_id] = site


def harvest(site: call_site.CallSite) -> None:
    """Reads (and empties) the timeline areas of a site's ranks in this process."""
    global _dropped
    from jax_triton_dist.runtime import cuda_driver

    if not cuda_driver.available() or heap.running_backend() not in ("cuda", "nvshmem"):
        return
    drv = cuda_driver.driver()
    layout = site.region_layout
    nbytes = timeline.area_bytes(site.programs, site.timeline)
    for team in site.teams.values():
        if not team.ready or team.generation != lifetime.generation():
            continue
        for pe in call_site.local_pes(team):
            rank = team.pes.index(pe)
            device = lifetime.device_of(pe)
            address = team.region[rank][0] + layout.timeline
            drv.device_synchronize(device)
            events, dropped = timeline.decode(drv.read(device, address, nbytes),
                                              site.programs, site.timeline)
            heap.memset(pe, address, 0, nbytes)
            rows = [_row(site, device, pe, rank, "gpu globaltimer", e) for e in events]
            with _lock:
                _rows.extend(rows)
                _dropped += dropped


def _released(call_id: int, site: call_site.CallSite) -> None:
    with _lock:
        timed = _gpu_sites.pop(call_id, None)
    if timed is not None:
        harvest(timed)


call_site.on_release(_released)


def collect() -> tuple[list[dict[str, Any]], int]:
    """Every event so far (GPU areas read after the GPUs finished), and how many events
    were dropped for lack of room; both are emptied."""
    global _dropped
    with _lock:
        sites = list(_gpu_sites.values())
    for site in sites:
        harvest(site)
    with _lock:
        rows, dropped = list(_rows), _dropped
        _rows.clear()
        _kept.clear()
        _dropped = 0
    return rows, dropped


def chrome_trace(rows: list[dict[str, Any]], dropped: int = 0) -> dict[str, Any]:
    """A Chrome/Perfetto trace (the JSON object format): one process per PE (its device
    and rank), one thread per program; programs and waits are complete events, notifies
    instant events. Times are microseconds from the first event, per clock."""
    origin: dict[str, int] = {}
    for row in rows:
        origin[row["clock"]] = min(origin.get(row["clock"], row["time_ns"]), row["time_ns"])
    events: list[dict[str, Any]] = []
    named: set[tuple[int, int]] = set()
    open_: dict[tuple, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: (r["pe"], r["program"], r["time_ns"])):
        pid, tid = row["pe"], row["program"]
        ts = (row["time_ns"] - origin[row["clock"]]) / 1e3
        if (pid, -1) not in named:
            named.add((pid, -1))
            events.append({"ph": "M", "name": "process_name", "pid": pid,
                           "args": {"name": f"PE {pid} (device {row['device']})"}})
        if (pid, tid) not in named:
            named.add((pid, tid))
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": f"program {tid}"}})
        args = {"kernel": row["kernel"], "site": row["site"], "rank": row["rank"],
                "num_ranks": row["num_ranks"], "epoch": row["epoch"]}
        kind = row["kind"]
        if kind in ("PROGRAM_START", "WAIT_START"):
            open_[(pid, tid, kind[:-6])] = {"ts": ts, "args": args}
        elif kind in ("PROGRAM_END", "WAIT_END"):
            begin = open_.pop((pid, tid, kind[:-4]), None)
            if begin is not None:
                name = row["kernel"] if kind == "PROGRAM_END" else "wait"
                events.append({"ph": "X", "name": name, "cat": kind[:-4].lower(), "pid": pid,
                               "tid": tid, "ts": begin["ts"], "dur": max(ts - begin["ts"], 0),
                               "args": args})
        else:
            events.append({"ph": "i", "s": "t", "name": f"notify rank {row['arg']}",
                           "cat": "notify", "pid": pid, "tid": tid, "ts": ts,
                           "args": dict(args, peer=row["arg"])})
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"producer": "jax_triton_dist", "clocks": sorted(origin),
                          "dropped_events": dropped}}


def write(path: str, rows: list[dict[str, Any]], dropped: int = 0) -> None:
    """Writes :func:`chrome_trace` of ``rows`` to ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(rows, dropped), f)


def _write_at_exit() -> None:
    path = debug_settings.timeline_path()
    if path is None:
        return
    rows, dropped = collect()
    if rows:
        write(path, rows, dropped)
