"""SHMEM host API conformance, by the categories of the OpenSHMEM test suites.

Tests that take the ``world`` fixture run on every backend: ``host`` everywhere, ``cuda``
(all PEs' heaps on GPU 0, gpu-marked) where a GPU is present.
"""

import ctypes
import threading
import time

import numpy as np
import pytest
from gpu_support import have_gpu
from spmd import errors_of, run_pes

from jax_triton_dist import shmem
from jax_triton_dist.shmem import heap

HEAP = 8 << 20


@pytest.fixture(params=["host", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs a GPU")])])
def backend(request):
    return request.param


@pytest.fixture
def world(request, backend):
    """SHMEM with ``request.param`` PEs (default 4) on ``backend``, finalised afterwards."""
    n = getattr(request, "param", 4)
    if shmem.init_status() == shmem.InitStatus.INITIALIZED:
        shmem.finalize()
    if backend == "cuda":
        shmem.init(n_pes=n, heap_size=HEAP, backend="cuda", devices=[0] * n)
    else:
        shmem.init(n_pes=n, heap_size=HEAP, backend="host")
    yield n
    shmem.finalize()


def write_local(addr, array):
    """Stores ``array`` at ``addr`` of the calling PE's heap (any backend)."""
    array = np.ascontiguousarray(array)
    shmem.putmem(addr, array.ctypes.data, array.nbytes, shmem.my_pe())


def read_at(addr, shape, dtype):
    """A host copy of the memory at ``addr`` (any heap, any backend)."""
    out = np.empty(shape, dtype)
    heap.copy(shmem.my_pe(), out.ctypes.data, addr, out.nbytes)
    return out


ALL_SIZES = pytest.mark.parametrize("world", [1, 2, 4, 8], indirect=True)


# ---------------------------------------------------------------------------
# Init and info
# ---------------------------------------------------------------------------


def test_init_status_and_info(no_world):
    assert shmem.init_status() == shmem.InitStatus.NOT_INITIALIZED
    shmem.init(n_pes=3, heap_size=1 << 20, backend="host")
    assert shmem.init_status() == shmem.InitStatus.INITIALIZED
    assert shmem.n_pes() == 3
    assert shmem.backend() == "host"
    assert shmem.heap_size() == 1 << 20
    assert run_pes(lambda pe: shmem.my_pe()) == [0, 1, 2]
    shmem.finalize()
    assert shmem.init_status() == shmem.InitStatus.NOT_INITIALIZED


def test_default_pes_are_the_cpu_devices(no_world):
    import jax

    shmem.init(heap_size=1 << 20, backend="host")
    assert shmem.n_pes() == jax.local_device_count("cpu") == 8


def test_heap_size_from_environment(no_world, monkeypatch):
    monkeypatch.setenv(shmem.HEAP_SIZE_ENV, "3M")
    shmem.init(n_pes=2, backend="host")
    assert shmem.heap_size() == 3 << 20


def test_bad_heap_size_environment(no_world, monkeypatch):
    monkeypatch.setenv(shmem.HEAP_SIZE_ENV, "lots")
    with pytest.raises(ValueError, match="JTD_SHMEM_HEAP_SIZE='lots' is not a size"):
        shmem.init(n_pes=2)


def test_backend_from_environment(no_world, monkeypatch):
    monkeypatch.setenv(shmem.BACKEND_ENV, "host")
    shmem.init(n_pes=2, heap_size=1 << 20)
    assert shmem.backend() == "host"
    assert shmem.device_of(1) == -1


def test_backend_argument_errors(no_world):
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        shmem.init(n_pes=2, backend="mpi")
    with pytest.raises(ValueError, match="devices= is for the cuda backend"):
        shmem.init(n_pes=2, backend="host", devices=[0, 1])
    if "cuda" in shmem.available_backends():
        with pytest.raises(ValueError, match="3 devices given for 2 PEs"):
            shmem.init(n_pes=2, backend="cuda", devices=[0, 0, 0])
    else:
        with pytest.raises(shmem.ShmemError, match="no 'cuda' backend"):
            shmem.init(n_pes=2, backend="cuda")
    assert shmem.init_status() == shmem.InitStatus.NOT_INITIALIZED


@pytest.mark.gpu
@pytest.mark.skipif(not have_gpu(), reason="needs a GPU")
def test_cuda_heap_grows_on_demand_and_is_device_memory(no_world):
    shmem.init(n_pes=2, heap_size=256 << 20, backend="cuda", devices=[0, 0])
    assert shmem.backend() == "cuda" and shmem.device_of(1) == 0
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal(10 << 20 >> 2).astype(np.float32) for _ in range(6)]

    def program(pe):
        bufs = [shmem.malloc(b.nbytes) for b in blocks]  # 60 MiB: more than one growth step
        for buf, block in zip(bufs, blocks, strict=True):
            mine = block + pe  # keep the source alive through the copy
            shmem.putmem(buf, mine.ctypes.data, mine.nbytes, 1 - pe)
        shmem.barrier_all()
        ok = all(np.array_equal(read_at(buf, block.shape, block.dtype), block + (1 - pe))
                 for buf, block in zip(bufs, blocks, strict=True))
        with pytest.raises(shmem.ShmemError, match="is GPU memory"):
            shmem.as_array(bufs[0], 4, np.float32)
        shmem.barrier_all()
        for buf in reversed(bufs):
            shmem.free(buf)
        return ok

    assert run_pes(program, 2) == [True, True]


def test_double_init_fails(world):
    with pytest.raises(shmem.ShmemError, match="already initialised"):
        shmem.init(n_pes=2)


@pytest.mark.parametrize("call", [
    lambda: shmem.n_pes(),
    lambda: shmem.my_pe(),
    lambda: shmem.finalize(),
    lambda: shmem.heap_size(),
])
def test_use_before_init_fails(no_world, call):
    with pytest.raises(shmem.ShmemError, match="not initialised"):
        call()


def test_malloc_before_init_fails(no_world):
    with pytest.raises(shmem.ShmemError, match="not initialised"):
        shmem.malloc(64)


def test_zero_heap_or_pes_fail(no_world):
    with pytest.raises(ValueError, match="heap_size must be positive"):
        shmem.init(n_pes=2, heap_size=0)
    with pytest.raises(ValueError, match="n_pes must be positive"):
        shmem.init(n_pes=0, heap_size=1 << 20)


def test_unbound_thread_has_no_pe(world):
    with pytest.raises(shmem.ShmemError, match="not bound to a PE"):
        shmem.my_pe()


def test_bind_out_of_range_pe(world):
    with pytest.raises(ValueError, match="pe 9 is out of range"), shmem.as_pe(9):
        pass


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def _offset(addr, pe):
    return addr - heap.heap_base(pe)


@ALL_SIZES
def test_malloc_is_symmetric(world):
    def program(pe):
        a = shmem.malloc(1000)
        b = shmem.malloc(24)
        result = (_offset(a, pe), _offset(b, pe), shmem.ptr(a, pe) == a,
                  [_offset(shmem.ptr(a, p), p) for p in range(world)])
        shmem.barrier_all()
        shmem.free(b)
        shmem.free(a)
        return result

    results = run_pes(program, world)
    offset_a, offset_b = results[0][:2]
    assert offset_b >= offset_a + 1000
    for a, b, local, translated in results:
        assert (a, b, local) == (offset_a, offset_b, True)
        assert translated == [offset_a] * world


def test_ptr_translates_between_heaps(world):
    def program(pe):
        buf = shmem.malloc(64)
        write_local(buf, pe * 100 + np.arange(8))
        shmem.barrier_all()
        seen = [int(read_at(shmem.ptr(buf, p), 8, np.int64)[3]) for p in range(world)]
        shmem.barrier_all()
        shmem.free(buf)
        return seen

    for seen in run_pes(program, world):
        assert seen == [p * 100 + 3 for p in range(world)]


def test_calloc_is_zero_after_reuse(world):
    def program(pe):
        dirty = shmem.malloc(4096)
        write_local(dirty, np.full(4096, 0xAB, np.uint8))
        shmem.barrier_all()
        shmem.free(dirty)
        clean = shmem.calloc(512, 8)
        values = read_at(clean, 512, np.int64)
        shmem.free(clean)
        return clean == dirty, values

    for reused, values in run_pes(program, world):
        assert reused  # first fit gives the same block back
        assert not values.any()


@pytest.mark.parametrize("alignment", [256, 4096, 65536])
def test_align(world, alignment):
    def program(pe):
        pad = shmem.malloc(100)
        buf = shmem.align(alignment, 300)
        misalignment = buf % alignment
        shmem.free(buf)
        shmem.free(pad)
        return misalignment

    assert run_pes(program, world) == [0] * world


def test_align_rejects_non_power_of_two(world):
    errors = errors_of(lambda pe: shmem.align(48, 64), world)
    assert all(isinstance(e, ValueError) and "power of two" in str(e) for e in errors)


def test_malloc_zero_returns_null_and_free_none_is_noop(world):
    assert run_pes(lambda pe: (shmem.malloc(0), shmem.free(None), shmem.free(0)), world) == [
        (0, None, None)
    ] * world


def test_negative_size_fails(world):
    errors = errors_of(lambda pe: shmem.malloc(-1), world)
    assert all(isinstance(e, ValueError) and "size must be >= 0" in str(e) for e in errors)


def test_asymmetric_sizes_fail_on_every_pe(world):
    errors = errors_of(lambda pe: shmem.malloc(64 * (pe + 1)), world)
    for e in errors:
        assert isinstance(e, shmem.ShmemError)
        assert "PE 0: 64 bytes" in str(e) and "PE 1: 128 bytes" in str(e)


def test_double_free_fails(world):
    def program(pe):
        buf = shmem.malloc(64)
        shmem.free(buf)
        shmem.free(buf)

    errors = errors_of(program, world)
    assert all(isinstance(e, shmem.ShmemError) and "double free" in str(e) for e in errors)


def test_free_of_non_heap_pointer_fails(world):
    local = ctypes.create_string_buffer(64)
    errors = errors_of(lambda pe: shmem.free(ctypes.addressof(local)), world)
    assert all(isinstance(e, shmem.ShmemError) and "not in this PE's symmetric heap" in str(e)
               for e in errors)


def test_free_of_other_pes_pointer_fails(world):
    def program(pe):
        buf = shmem.malloc(64)
        shmem.free(shmem.ptr(buf, (pe + 1) % world))

    errors = errors_of(program, world)
    assert all(isinstance(e, shmem.ShmemError) and "in the heap of PE" in str(e) for e in errors)


def test_heap_exhausted_names_size_and_setting(world):
    def program(pe):
        shmem.malloc(HEAP * 2)

    for e in errors_of(program, world):
        assert isinstance(e, shmem.ShmemError)
        assert f"cannot allocate {HEAP * 2} bytes" in str(e)
        assert shmem.HEAP_SIZE_ENV in str(e)


def test_freed_space_is_reused(world):
    def program(pe):
        for _ in range(20):
            buf = shmem.malloc(HEAP // 2)
            shmem.free(buf)
        return True

    assert all(run_pes(program, world))


def test_ptr_pe_out_of_range(world):
    errors = errors_of(lambda pe: shmem.ptr(shmem.malloc(64), world), world)
    assert all(isinstance(e, ValueError) and f"pe {world} is out of range" in str(e)
               for e in errors)


# ---------------------------------------------------------------------------
# RMA
# ---------------------------------------------------------------------------


@ALL_SIZES
@pytest.mark.parametrize("nbi", [False, True])
def test_putmem_all_to_all(world, nbi):
    rng = np.random.default_rng(world)
    data = rng.standard_normal((world, world, 37)).astype(np.float32)  # [src, dst, n]
    put = shmem.putmem_nbi if nbi else shmem.putmem

    def program(pe):
        dest = shmem.malloc(world * 37 * 4)
        shmem.barrier_all()
        for peer in range(world):
            src = np.ascontiguousarray(data[pe, peer])
            put(dest + pe * 37 * 4, src.ctypes.data, src.nbytes, peer)
        shmem.quiet()
        shmem.barrier_all()
        got = read_at(dest, (world, 37), np.float32)
        shmem.barrier_all()
        shmem.free(dest)
        return got

    for pe, got in enumerate(run_pes(program, world)):
        np.testing.assert_array_equal(got, data[:, pe])


@ALL_SIZES
@pytest.mark.parametrize("nbi", [False, True])
def test_getmem_from_every_pe(world, nbi):
    get = shmem.getmem_nbi if nbi else shmem.getmem
    rng = np.random.default_rng(7)
    data = rng.integers(-1000, 1000, (world, 53)).astype(np.int32)

    def program(pe):
        src = shmem.malloc(53 * 4)
        write_local(src, data[pe])
        shmem.barrier_all()
        out = np.zeros((world, 53), np.int32)
        for peer in range(world):
            get(out[peer].ctypes.data, src, 53 * 4, peer)
        shmem.quiet()
        shmem.barrier_all()
        shmem.free(src)
        return out

    for got in run_pes(program, world):
        np.testing.assert_array_equal(got, data)


def test_put_to_non_symmetric_dest_fails(world):
    local = np.zeros(4, np.int32)
    errors = errors_of(lambda pe: shmem.putmem(local.ctypes.data, local.ctypes.data, 16, 0),
                       world)
    assert all(isinstance(e, shmem.ShmemError) and "putmem: dest" in str(e) for e in errors)


def test_put_pe_out_of_range(world):
    def program(pe):
        buf = shmem.malloc(16)
        shmem.putmem(buf, buf, 16, -1)

    errors = errors_of(program, world)
    assert all(isinstance(e, ValueError) and "pe -1 is out of range" in str(e) for e in errors)


# ---------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------


@ALL_SIZES
def test_signal_set_from_every_pe(world):
    def program(pe):
        sigs = shmem.calloc(world, 8)
        for peer in range(world):
            shmem.signal_op(sigs + 8 * pe, 1000 + pe, shmem.SignalOp.SET, peer)
        for src in range(world):
            shmem.signal_wait_until(sigs + 8 * src, shmem.Cmp.EQ, 1000 + src)
        values = [shmem.signal_fetch(sigs + 8 * s) for s in range(world)]
        shmem.barrier_all()
        shmem.free(sigs)
        return values

    for values in run_pes(program, world):
        assert values == [1000 + s for s in range(world)]


@ALL_SIZES
def test_signal_add_from_every_pe(world):
    def program(pe):
        sig = shmem.calloc(1, 8)
        for peer in range(world):
            for _ in range(10):
                shmem.signal_op(sig, pe + 1, shmem.SignalOp.ADD, peer)
        total = 10 * world * (world + 1) // 2
        value = shmem.signal_wait_until(sig, shmem.Cmp.GE, total)
        shmem.barrier_all()
        shmem.free(sig)
        return value

    total = 10 * world * (world + 1) // 2
    assert run_pes(program, world) == [total] * world


@ALL_SIZES
def test_putmem_signal_orders_data_before_signal(world):
    rng = np.random.default_rng(3)
    data = rng.standard_normal((world, 4096)).astype(np.float64)

    def program(pe):
        buf = shmem.malloc(4096 * 8)
        sig = shmem.calloc(1, 8)
        src = np.ascontiguousarray(data[pe])
        dst = (pe + 1) % world
        for rnd in range(1, 6):
            shmem.putmem_signal(buf, src.ctypes.data, src.nbytes, sig, rnd,
                                shmem.SignalOp.SET, dst)
            shmem.signal_wait_until(sig, shmem.Cmp.GE, rnd)
            got = read_at(buf, 4096, np.float64)
            np.testing.assert_array_equal(got, data[(pe - 1) % world])
            shmem.barrier_all()
        shmem.free(sig)
        shmem.free(buf)
        return True

    assert all(run_pes(program, world))


def test_signal_op_rejects_bad_op(world):
    def program(pe):
        sig = shmem.calloc(1, 8)
        shmem.signal_op(sig, 1, 7, 0)

    errors = errors_of(program, world)
    assert all(isinstance(e, ValueError) and "7 is not a valid SignalOp" in str(e)
               for e in errors)


# ---------------------------------------------------------------------------
# wait_until
# ---------------------------------------------------------------------------

# (cmp, initial, final, cmp_value): the wait must not pass on `initial` and pass on `final`.
CASES = [
    (shmem.Cmp.EQ, 0, 5, 5),
    (shmem.Cmp.NE, 0, 9, 0),
    (shmem.Cmp.GT, 3, 4, 3),
    (shmem.Cmp.GE, 3, 7, 7),
    (shmem.Cmp.LT, 10, 2, 3),
    (shmem.Cmp.LE, 10, 3, 3),
]


@pytest.mark.parametrize("cmp,initial,final,value", CASES, ids=[c[0].name for c in CASES])
def test_wait_until_every_compare(world, cmp, initial, final, value):
    def program(pe):
        sig = shmem.calloc(1, 8)
        shmem.signal_op(sig, initial, shmem.SignalOp.SET, pe)
        shmem.barrier_all()
        if pe == 0:
            time.sleep(0.05)
            for peer in range(1, world):
                shmem.signal_op(sig, final, shmem.SignalOp.SET, peer)
            result = final
        else:
            start = shmem.signal_fetch(sig)
            result = shmem.signal_wait_until(sig, cmp, value)
            assert start in (initial, final)
        shmem.barrier_all()
        shmem.free(sig)
        return result

    assert run_pes(program, world) == [final] * world


def test_wait_until_times_out_with_details(world):
    def program(pe):
        sig = shmem.calloc(1, 8)
        shmem.signal_op(sig, 3, shmem.SignalOp.SET, pe)
        try:
            shmem.signal_wait_until(sig, shmem.Cmp.EQ, 42, timeout=0.2)
        finally:
            shmem.barrier_all()
            shmem.free(sig)

    for pe, e in enumerate(errors_of(program, world)):
        assert isinstance(e, shmem.ShmemTimeoutError)
        text = str(e)
        assert f"PE {pe} signal_wait_until" in text
        assert "expected value == 42, saw 3" in text
        assert "address 0x" in text


# ---------------------------------------------------------------------------
# Barriers
# ---------------------------------------------------------------------------


@ALL_SIZES
def test_repeated_barriers_separate_phases(world):
    phases = [0] * world
    seen_behind = []
    lock = threading.Lock()

    def program(pe):
        for phase in range(1, 51):
            phases[pe] = phase
            shmem.barrier_all()
            with lock:
                if min(phases) < phase:
                    seen_behind.append((pe, phase, list(phases)))
            shmem.barrier_all()
        return True

    assert all(run_pes(program, world))
    assert not seen_behind


def test_barrier_times_out_naming_missing_pes(world, monkeypatch):
    monkeypatch.setenv(shmem.TIMEOUT_ENV, "0.3")

    def program(pe):
        if pe != 1:
            shmem.barrier_all()

    errors = errors_of(program, world)
    assert errors[1] is None
    for pe in (0, 2, 3):
        assert isinstance(errors[pe], shmem.ShmemTimeoutError)
        assert f"PE {pe}: shmem.barrier_all is collective" in str(errors[pe])
        assert "3 of 4 members arrived, missing: 1" in str(errors[pe])


# ---------------------------------------------------------------------------
# Teams
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [8], indirect=True)
def test_team_split_strided(world):
    def program(pe):
        evens = shmem.team_split_strided(shmem.TEAM_WORLD, 0, 2, 4)
        if pe % 2:
            assert evens is None
            return None
        info = (shmem.team_my_pe(evens), shmem.team_n_pes(evens),
                shmem.team_translate_pe(evens, 2, shmem.TEAM_WORLD),
                shmem.team_translate_pe(shmem.TEAM_WORLD, 6, evens),
                shmem.team_translate_pe(shmem.TEAM_WORLD, 3, evens))
        for _ in range(5):
            shmem.team_sync(evens)
        # A team of a team: PEs 0 and 4 (team PEs 0 and 2 of `evens`).
        sub = shmem.team_split_strided(evens, 0, 2, 2)
        sub_info = None if sub is None else (shmem.team_my_pe(sub), sub.pes())
        shmem.team_destroy(evens)
        return info, sub_info

    results = run_pes(program, world)
    for pe in range(0, 8, 2):
        info, sub_info = results[pe]
        assert info == (pe // 2, 4, 4, 3, -1)
        assert sub_info == ((pe // 4, [0, 4]) if pe in (0, 4) else None)


def test_team_errors(world):
    def program(pe):
        with pytest.raises(ValueError, match="does not fit"):
            shmem.team_split_strided(shmem.TEAM_WORLD, 1, 2, 4)
        team = shmem.team_split_strided(shmem.TEAM_WORLD, 0, 1, world)
        shmem.team_destroy(team)
        with pytest.raises(shmem.ShmemError, match="destroyed"):
            shmem.team_my_pe(team)
        with pytest.raises(shmem.ShmemError, match="TEAM_WORLD cannot be destroyed"):
            shmem.team_destroy(shmem.TEAM_WORLD)
        with pytest.raises(ValueError, match="src_pe 9 is out of range"):
            shmem.team_translate_pe(shmem.TEAM_WORLD, 9, shmem.TEAM_WORLD)
        return True

    assert all(run_pes(program, world))
