"""The pytest plugin jax_triton_dist.testing, run through pytest's own pytester."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist.testing import assert_matches_reference, default_tolerance

pytest_plugins = ["pytester"]

USER_TESTS = '''
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist.testing import assert_matches_reference


def test_all_reduce(jtd_mesh, jtd_ranks):
    assert jtd_mesh.devices.size == jtd_ranks and jtd_mesh.axis_names == ("x",)
    x = jnp.asarray(np.random.default_rng(jtd_ranks).standard_normal((jtd_ranks * 4, 8)),
                    jnp.float32)
    rows = assert_matches_reference(lambda v: jtd.all_reduce(v, "x"),
                                    lambda v: jax.lax.psum(v, "x"), x, mesh=jtd_mesh,
                                    in_specs=P("x"), out_specs=P())
    assert len(rows) == jtd_ranks


def test_straggler(jtd_mesh, straggler):
    if jtd_mesh.devices.size < 2:
        pytest.skip("one rank")
    straggler(jtd_mesh.devices.flat[1].id, 0.05)
    x = jnp.ones((jtd_mesh.devices.size * 2, 8))
    assert_matches_reference(lambda v: jtd.all_gather(v, "x", tiled=True),
                             lambda v: jax.lax.all_gather(v, "x", tiled=True), x,
                             mesh=jtd_mesh, in_specs=P("x"), out_specs=P("x"))


@pytest.mark.jtd_gpu
def test_needs_a_gpu():
    raise AssertionError("must be skipped without a GPU")
'''


def _clean_env(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)


def test_plugin_parametrizes_ranks_sets_devices_and_skips_gpu_tests(pytester, monkeypatch):
    _clean_env(monkeypatch)
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "jax_triton_dist.testing", "--jtd-ranks",
                                           "1,2,4", "-v", "-rs")
    result.assert_outcomes(passed=5, skipped=2)
    result.stdout.fnmatch_lines([
        "*jax_triton_dist.testing: ranks 1,2,4*",
        "*set XLA_FLAGS=--xla_force_host_platform_device_count=4 before JAX started*",
        "*test_all_reduce?ranks1?*PASSED*",
        "*test_all_reduce?ranks4?*PASSED*",
        "*jtd_gpu: no NVIDIA GPU visible to JAX*",
    ])


def test_plugin_skips_rank_counts_beyond_the_devices(pytester, monkeypatch):
    _clean_env(monkeypatch)
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "jax_triton_dist.testing", "--jtd-ranks",
                                           "2,8", "--jtd-cpu-devices", "4", "-rs",
                                           "-k", "all_reduce")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*8 ranks need 8 cpu devices; this host has 4*"])


def test_plugin_leaves_other_suites_alone(pytester, monkeypatch):
    _clean_env(monkeypatch)
    pytester.makepyfile(test_other="import os\n\ndef test_flags():\n"
                                   "    flags = os.environ.get('XLA_FLAGS', '')\n"
                                   "    assert 'device_count' not in flags\n")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)


def test_plugin_rejects_bad_rank_lists(pytester, monkeypatch):
    _clean_env(monkeypatch)
    pytester.makepyfile(test_user="def test_x(jtd_ranks):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "jax_triton_dist.testing", "--jtd-ranks", "2,x")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--jtd-ranks '2,x': expected comma-separated*"])


def test_assert_matches_reference_names_the_wrong_rank():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    x = jnp.arange(32.0).reshape(8, 4)

    def wrong_on_rank_2(v):
        out = jtd.all_gather(v, "x", tiled=True)
        return jnp.where(jax.lax.axis_index("x") == 2, out + 1.0, out)

    with pytest.raises(AssertionError) as info:
        assert_matches_reference(wrong_on_rank_2, lambda v: jax.lax.all_gather(v, "x",
                                                                                tiled=True),
                                 x, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    message = str(info.value)
    assert "differs from the reference on rank(s) {'x': 2}" in message
    assert message.count("FAIL") == 1 and message.count(" ok") == 3
    assert "1.000e+00" in message


def test_default_tolerances():
    assert default_tolerance(jnp.int32) == (0.0, 0.0)
    assert default_tolerance(jnp.bool_) == (0.0, 0.0)
    assert default_tolerance(jnp.bfloat16)[0] > default_tolerance(jnp.float16)[0] > \
        default_tolerance(jnp.float32)[0]
