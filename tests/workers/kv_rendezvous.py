"""The nvshmem backend's cross-process rendezvous (JAX's key-value store), on CPU."""

from job import start

from jax_triton_dist import shmem
from jax_triton_dist.shmem import nvshmem_bootstrap

me, n = start()
rendezvous = nvshmem_bootstrap.KeyValueRendezvous(generation=7)
for round_ in range(3):  # rounds of one team pair up in order
    assert rendezvous(5, n, me, 100 * round_ + me, 30) == [100 * round_ + p for p in range(n)]
assert rendezvous.gather("named", n, me, -me, 30) == [-p for p in range(n)]
if me == 0:  # a rendezvous that only PE 0 joins times out, naming the missing member
    try:
        rendezvous.gather("alone", n, me, 1, 1)
        raise AssertionError("the rendezvous did not time out")
    except shmem.ShmemTimeoutError as error:
        assert "member 1 of" in str(error) and "'alone'" in str(error), error
rendezvous.gather("done", n, me, 0, 30)
print(f"PE {me} of {n}: ok", flush=True)
