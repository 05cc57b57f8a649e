"""jax_triton_dist.multiprocess: local multi-process jobs (CPU-only checks of the launcher)."""

import time

import pytest

from jax_triton_dist import multiprocess

SCRIPT = """
import os, sys, time
me = int(os.environ["JTD_PROCESS_ID"])
print("process", me, "of", os.environ["JTD_NUM_PROCESSES"], "gpu",
      os.environ["CUDA_VISIBLE_DEVICES"], "at", os.environ["JTD_COORDINATOR"], sys.argv[1:])
if sys.argv[1] == "fail" and me == 1:
    sys.exit(3)
if sys.argv[1] in ("fail", "hang"):
    time.sleep(120)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return str(path)


def test_every_process_gets_its_coordinates(script, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    codes, outs = multiprocess.run([script, "ok"], 3, capture=True)
    assert codes == [0, 0, 0]
    coordinators = set()
    for i, out in enumerate(outs):
        assert f"process {i} of 3 gpu {i} at localhost:" in out, out
        coordinators.add(out.split(" at ")[1].split()[0])
    assert len(coordinators) == 1  # one job


def test_shared_gpu_and_visible_devices(script, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    _, outs = multiprocess.run([script, "ok"], 2, capture=True)
    assert ["gpu 5" in outs[0], "gpu 7" in outs[1]] == [True, True]
    _, outs = multiprocess.run([script, "ok"], 3, share_gpu=True, capture=True)
    assert all("gpu 5" in out for out in outs)
    with pytest.raises(ValueError, match="names fewer GPUs"):
        multiprocess.run([script, "ok"], 3)


def test_a_failure_stops_the_others(script):
    start = time.monotonic()
    codes, _ = multiprocess.run([script, "fail"], 3, capture=True)
    assert codes[1] == 3 and codes[0] == codes[2] == -9
    assert time.monotonic() - start < 60


def test_timeout_stops_everyone(script):
    codes, outs = multiprocess.run([script, "hang"], 2, capture=True, timeout=3)
    assert codes == [-9, -9]
    assert "process 0 of 2" in outs[0]


def test_initialize_needs_the_launcher(monkeypatch):
    for var in (multiprocess.COORDINATOR_ENV, multiprocess.PROCESS_ID_ENV,
                multiprocess.NUM_PROCESSES_ENV):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="start this script with python -m"):
        multiprocess.initialize()


def test_command_line(script, capsys):
    assert multiprocess.main(["-n", "2", script, "ok"]) == 0
    out = capsys.readouterr().out
    assert "[0] process 0 of 2" in out and "[1] process 1 of 2" in out
    assert multiprocess.main(["-n", "2", script, "fail"]) == 1
