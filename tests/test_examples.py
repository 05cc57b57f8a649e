"""The examples run and check themselves (they assert against their references)."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart.py", "tp_mlp.py", "moe_layer.py",
                                  "long_context_attention.py"])
def test_example_runs(name):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True,
                            text=True, timeout=600, env=env, cwd=EXAMPLES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "relative error" in result.stdout or "== jax.lax" in result.stdout
