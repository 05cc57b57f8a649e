"""SHMEM host API across processes (the nvshmem backend, chosen by default)."""

import numpy as np
from job import start

from jax_triton_dist import shmem

me, n = start()
shmem.init(heap_size=64 << 20)
assert shmem.backend() == "nvshmem" and (shmem.my_pe(), shmem.n_pes()) == (me, n)

rng = np.random.default_rng(11)
blocks = rng.standard_normal((n, 4096)).astype(np.float32)  # every PE knows every block
nbytes = blocks[0].nbytes
src = shmem.malloc(nbytes)
inbox = shmem.malloc(n * nbytes)  # slot s: PE s's block
flags = shmem.calloc(n, 8)
shmem.putmem(src, blocks[me].ctypes.data, nbytes, me)
shmem.barrier_all()
for step in range(1, n):  # ring order: every PE puts to every other PE
    peer = (me + step) % n
    shmem.putmem_signal_nbi(inbox + me * nbytes, src, nbytes, flags + 8 * me, 1,
                            shmem.SignalOp.SET, peer)
shmem.quiet()
for src_pe in range(n):
    if src_pe != me:
        shmem.signal_wait_until(flags + 8 * src_pe, shmem.Cmp.EQ, 1, timeout=60)
        got = np.empty(4096, np.float32)
        shmem.getmem(got.ctypes.data, inbox + src_pe * nbytes, nbytes, me)
        assert np.array_equal(got, blocks[src_pe]), (me, src_pe)

# Gets from every peer, signal adds, and a strided team.
for peer in range(n):
    got = np.empty(4096, np.float32)
    shmem.getmem(got.ctypes.data, src, nbytes, peer)
    assert np.array_equal(got, blocks[peer])
counter = shmem.calloc(1, 8)
for peer in range(n):
    shmem.signal_op(counter, me + 1, shmem.SignalOp.ADD, peer)
shmem.signal_wait_until(counter, shmem.Cmp.EQ, n * (n + 1) // 2, timeout=60)
evens = shmem.team_split_strided(shmem.TEAM_WORLD, 0, 2, (n + 1) // 2)
if me % 2 == 0:
    assert shmem.team_my_pe(evens) == me // 2
    shmem.team_sync(evens)
shmem.barrier_all()
for addr in (counter, flags, inbox, src):
    shmem.free(addr)
shmem.finalize()
print(f"PE {me} of {n}: ok")
