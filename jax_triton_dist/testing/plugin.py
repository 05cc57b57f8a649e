"""The pytest hooks and fixtures of ``jax_triton_dist.testing`` (see its docstring)."""

from __future__ import annotations

import os
import sys

import pytest

__all__ = ["pytest_addoption", "pytest_load_initial_conftests", "pytest_configure",
           "pytest_report_header", "pytest_generate_tests", "pytest_collection_modifyitems",
           "jtd_ranks", "jtd_mesh", "straggler", "DEFAULT_RANKS", "MESH_AXIS"]

DEFAULT_RANKS = (1, 2, 4, 8)
MESH_AXIS = "x"
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_note: list[str] = []  # what the plugin did before JAX started, for the header


def pytest_addoption(parser) -> None:
    group = parser.getgroup("jax_triton_dist", "distributed kernels (jax_triton_dist.testing)")
    group.addoption("--jtd-ranks", default=None, metavar="N,N,...",
                    help="rank counts for tests taking jtd_ranks / jtd_mesh (default: "
                         + ",".join(map(str, DEFAULT_RANKS)) + ")")
    group.addoption("--jtd-cpu-devices", type=int, default=None, metavar="N",
                    help="simulated CPU devices (default: the largest rank count)")
    parser.addini("jtd_ranks", "rank counts (like --jtd-ranks)", default="")
    parser.addini("jtd_cpu_devices", "simulated CPU devices (like --jtd-cpu-devices)",
                  default="")


def _ranks(value: str | None) -> tuple[int, ...]:
    if not value:
        return DEFAULT_RANKS
    try:
        ranks = tuple(int(part) for part in str(value).split(",") if part.strip())
    except ValueError:
        raise pytest.UsageError(f"--jtd-ranks {value!r}: expected comma-separated positive "
                                "integers, e.g. 1,2,4,8") from None
    if not ranks or any(r < 1 for r in ranks):
        raise pytest.UsageError(f"--jtd-ranks {value!r}: rank counts must be positive")
    return ranks


def _option(config, name: str):
    """A command-line option, also before the command line is fully parsed (early hooks
    see only ``known_args_namespace``)."""
    value = getattr(config.known_args_namespace, name, None)
    return value if value is not None else config.getoption(name, None)


def _config_ranks(config) -> tuple[int, ...]:
    return _ranks(_option(config, "jtd_ranks") or config.getini("jtd_ranks"))


def _asked_for(config) -> bool:
    named = getattr(config.known_args_namespace, "plugins", None) or []
    return bool("jax_triton_dist.testing" in named or _option(config, "jtd_ranks")
                or _option(config, "jtd_cpu_devices") or config.getini("jtd_ranks")
                or config.getini("jtd_cpu_devices"))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args) -> None:
    """Sets the simulated CPU device count before any test module imports JAX."""
    if not _asked_for(early_config):
        return
    devices = (_option(early_config, "jtd_cpu_devices")
               or early_config.getini("jtd_cpu_devices"))
    count = int(devices) if devices else max(_config_ranks(early_config))
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG in flags:
        _note.append(f"XLA_FLAGS already sets the CPU device count ({flags.strip()})")
        return
    if _jax_started():
        _note.append("JAX's backends started before the plugin could set the CPU device "
                     f"count: simulated devices stay as they are (set {_DEVICE_FLAG}={count} "
                     "in XLA_FLAGS)")
        return
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count}".strip()
    _note.append(f"set XLA_FLAGS={_DEVICE_FLAG}={count} before JAX started ({count} "
                 "simulated CPU devices)")


def _jax_started() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(bridge is not None and getattr(bridge, "_backends", None))


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "jtd_gpu: needs an NVIDIA GPU (skipped elsewhere)")


def pytest_report_header(config) -> list[str]:
    if not _asked_for(config):
        return []
    ranks = ",".join(map(str, _config_ranks(config)))
    return [f"jax_triton_dist.testing: ranks {ranks}"] + [
        f"jax_triton_dist.testing: {note}" for note in _note]


def pytest_generate_tests(metafunc) -> None:
    if "jtd_ranks" in metafunc.fixturenames:
        ranks = _config_ranks(metafunc.config)
        metafunc.parametrize("jtd_ranks", ranks, indirect=True,
                             ids=[f"ranks{r}" for r in ranks])


def _gpus() -> list:
    import jax

    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def pytest_collection_modifyitems(config, items) -> None:
    marked = [item for item in items if item.get_closest_marker("jtd_gpu")]
    if marked and not _gpus():
        skip = pytest.mark.skip(reason="jtd_gpu: no NVIDIA GPU visible to JAX")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture
def jtd_ranks(request) -> int:
    """The rank count of this run of the test (from ``--jtd-ranks``)."""
    return int(getattr(request, "param", max(_config_ranks(request.config))))


@pytest.fixture
def jtd_mesh(jtd_ranks):
    """A one-axis mesh (axis ``"x"``) of ``jtd_ranks`` devices: GPUs where there are any,
    else CPU devices."""
    import jax
    import numpy as np

    devices = _gpus() or jax.devices("cpu")
    if len(devices) < jtd_ranks:
        kind = devices[0].platform if devices else "cpu"
        pytest.skip(f"jtd_mesh: {jtd_ranks} ranks need {jtd_ranks} {kind} devices; this host "
                    f"has {len(devices)} (more simulated CPU devices: --jtd-cpu-devices)")
    return jax.sharding.Mesh(np.array(devices[:jtd_ranks]), (MESH_AXIS,))


@pytest.fixture
def straggler():
    """``straggler(pe, seconds)``: CPU device ``pe`` starts every kernel ``seconds`` late,
    until the test ends."""
    from contextlib import ExitStack

    from jax_triton_dist.testing.stragglers import delayed_device

    with ExitStack() as stack:
        yield lambda pe, seconds: stack.enter_context(delayed_device(pe, seconds))
