"""``jax_triton_dist.testing``: pytest support for distributed kernels, and a pytest plugin.

The plugin (``-p jax_triton_dist.testing``; installed as a ``pytest11`` entry point, so its
options are always listed) gives a test suite what this project's own suite uses:

* ``--jtd-ranks 1,2,4,8``: the rank counts; a test that takes the ``jtd_ranks`` or
  ``jtd_mesh`` fixture runs once per count;
* ``jtd_mesh``: a one-axis mesh (axis ``"x"``) of that many devices — real GPUs where the
  host has them, else simulated CPU devices; a count beyond the devices there are is
  skipped with the reason;
* the ``jtd_gpu`` marker: the test is skipped cleanly (with the reason) without an
  NVIDIA GPU;
* ``straggler(pe, seconds)``: CPU device ``pe`` starts every kernel ``seconds`` late;
* :func:`assert_matches_reference`: runs a function and its reference under ``shard_map``
  and reports each rank's largest error.

Simulated CPU devices must be set up before JAX starts its backend: when the plugin is
asked for (``-p``, ``--jtd-ranks``, ``--jtd-cpu-devices`` or the ``jtd_cpu_devices`` ini
option) it adds ``--xla_force_host_platform_device_count`` to ``XLA_FLAGS`` itself, before
test modules are imported, and says so in pytest's header.
"""

from jax_triton_dist.testing.plugin import (
    jtd_mesh,
    jtd_ranks,
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_generate_tests,
    pytest_load_initial_conftests,
    pytest_report_header,
    straggler,
)
from jax_triton_dist.testing.reference import assert_matches_reference, default_tolerance
from jax_triton_dist.testing.stragglers import delayed_device

__all__ = ["assert_matches_reference", "default_tolerance", "delayed_device", "jtd_mesh",
           "jtd_ranks", "straggler", "pytest_addoption", "pytest_collection_modifyitems",
           "pytest_configure", "pytest_generate_tests", "pytest_load_initial_conftests",
           "pytest_report_header"]
