"""Test configuration: 8 simulated CPU devices, bounded waits."""

import os

# Must happen before JAX initialises its CPU backend.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JTD_WAIT_TIMEOUT", "60")
