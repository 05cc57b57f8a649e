"""How ``one_gpu`` waits for its ranks' work, with a scripted driver (no GPU needed): it
polls instead of blocking, so a stuck GPU becomes an error that says what was stuck."""

import pytest

from jax_triton_dist import one_gpu


class _Streams:
    """A driver whose streams finish after a scripted number of queries (None: never)."""

    def __init__(self, finish_after):
        self.finish_after = list(finish_after)
        self.queries = [0] * len(finish_after)

    def stream_query(self, device, stream):
        assert device == 3
        self.queries[stream] += 1
        after = self.finish_after[stream]
        return after is not None and self.queries[stream] > after


class _Clock:
    def __init__(self):
        self.now = 100.0
        self.pauses = []

    def __call__(self):
        return self.now

    def pause(self, seconds):
        self.pauses.append(seconds)
        self.now += seconds


def test_wait_streams_returns_once_every_stream_is_done():
    drv, clock = _Streams([0, 5, 2]), _Clock()
    assert one_gpu.wait_streams(drv, 3, [0, 1, 2], 10.0, clock, clock.pause) == []
    assert drv.queries == [1, 6, 3]  # a finished stream is not asked again
    # the pauses grow from 10 us and stay at most 1 ms
    assert clock.pauses[0] == pytest.approx(1e-5) and max(clock.pauses) <= 1e-3
    assert clock.pauses == sorted(clock.pauses)


def test_wait_streams_gives_up_at_the_deadline_naming_the_pending_streams():
    drv, clock = _Streams([1, None, None]), _Clock()
    assert one_gpu.wait_streams(drv, 3, [0, 1, 2], 0.5, clock, clock.pause) == [1, 2]
    assert 100.5 <= clock.now < 100.5 + 2e-3  # polled up to the deadline, no longer


def test_finish_seconds_follow_the_wait_timeout(monkeypatch):
    monkeypatch.setenv("JTD_WAIT_TIMEOUT", "20")
    assert one_gpu.finish_seconds() == 2 * 20 + one_gpu.FINISH_GRACE_S
    monkeypatch.setenv("JTD_WAIT_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="JTD_WAIT_TIMEOUT"):
        one_gpu.finish_seconds()


@pytest.mark.parametrize("gate, expected", [
    (7, "start gate is open (7, awaited 7): the launches themselves are stuck"),
    (6, "start gate is still closed (6, awaited 7): the host never opened it")])
def test_stuck_message_says_which_ranks_how_long_and_the_gate(monkeypatch, gate, expected):
    monkeypatch.setenv("JTD_WAIT_TIMEOUT", "20")
    text = one_gpu.stuck_message("one_gpu.time_ranks", 4, [1, 3], 70.0, gate, 7)
    assert text.startswith("one_gpu.time_ranks, call 4: rank(s) [1, 3] did not finish "
                           "within 70 s, though every wait gives up after 20 s "
                           "(JTD_WAIT_TIMEOUT)")
    assert expected in text and "restart the process" in text


def test_gate_is_a_host_word_whose_releases_only_grow(monkeypatch):
    """The start gate: a word of host-mapped memory the host opens with a store (no
    stream that could queue behind the waits it ends), shared by the process's jobs on
    a device, its release numbers growing across them."""
    import ctypes

    from jax_triton_dist.runtime import cuda_driver

    words = []

    class _Driver:
        def host_alloc_mapped(self, device, nbytes):
            assert nbytes == 4
            words.append(ctypes.c_uint32(0))
            return ctypes.addressof(words[-1]), 0xD000 + device

    monkeypatch.setattr(cuda_driver, "driver", _Driver)
    monkeypatch.setattr(one_gpu._Gate, "_gates", {})
    gate = one_gpu._Gate.of(5)
    assert gate is one_gpu._Gate.of(5) and gate.device_address == 0xD005
    assert one_gpu._Gate.of(6) is not gate and len(words) == 2
    first = gate.next_release()
    assert first == 1 and gate.value() == 0  # streams enqueued now wait for 1
    gate.open(first)
    assert gate.value() == words[0].value == 1
    assert gate.next_release() == 2  # the next job on the device goes on from there
    gate.open(1)  # a late, lower opening never closes it again
    assert gate.value() == 1
