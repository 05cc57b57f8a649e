"""A kernel that makes every ``dl`` SHMEM device call, so that the Ascend lowering covers
the calls user kernels make beside the primitives the op kernels use."""

import triton
import triton.language as tl

import jax_triton_dist.language as dl

__all__ = ["device_calls_kernel"]


@triton.jit
def device_calls_kernel(
    x_ptr,  # [n] this rank's data
    out_ptr,  # [n] data got back from the successor
    buf_ptr,  # symmetric [n]
    sig_ptr,  # symmetric int32 [1]
    n,
    BLOCK: tl.constexpr,
):
    """Puts ``x`` to the successor with a signal, waits for the predecessor's, gets the
    successor's buffer back, then meets every rank at a barrier."""
    me = dl.my_pe()
    peer = (me + 1) % dl.n_pes()
    epoch = dl.epoch()
    dl.putmem_signal(buf_ptr, x_ptr, n, sig_ptr, epoch, "set", peer, BLOCK)
    dl.signal_wait_until(sig_ptr, "ge", epoch)
    dl.fence("sys")
    dl.getmem(out_ptr, buf_ptr, n, peer, BLOCK)
    dl.quiet()
    dl.barrier_all()
