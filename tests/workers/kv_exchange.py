"""The nvshmem backend's cross-process rendezvous (JAX's key-value store), on CPU."""

from job import start

from jax_triton_dist import _shmem, nvshmem_bootstrap

me, n = start()
exchange = nvshmem_bootstrap.Exchange(generation=7)
for round_ in range(3):  # rounds of one team pair up in order
    assert exchange(5, n, me, 100 * round_ + me, 30) == [100 * round_ + p for p in range(n)]
assert exchange.gather("named", n, me, -me, 30) == [-p for p in range(n)]
if me == 0:  # a rendezvous that only PE 0 joins times out, naming the missing member
    try:
        exchange.gather("alone", n, me, 1, 1)
        raise AssertionError("the rendezvous did not time out")
    except _shmem.ShmemTimeoutError as error:
        assert "member 1 of" in str(error) and "'alone'" in str(error), error
exchange.gather("done", n, me, 0, 30)
print(f"PE {me} of {n}: ok", flush=True)
