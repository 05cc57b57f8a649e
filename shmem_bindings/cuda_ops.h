// Host-issued memory operations on one GPU stream, shared by the CUDA-based SHMEM
// backends (cuda, nvshmem): copies are cuMemcpyAsync, signals a one-thread kernel doing a
// release store / release atomic add at system scope (so every GPU and the host observe
// the signal after the data), loads are ordered after the stream's earlier operations.
// Each call makes `device`'s primary context current for its duration.
#ifndef JAX_TRITON_DIST_SHMEM_CUDA_OPS_H_
#define JAX_TRITON_DIST_SHMEM_CUDA_OPS_H_

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "backend.h"

namespace jtd::shmem::cuda_ops {

// Copies `nbytes`; returns once complete if `blocking`, else once queued.
void Copy(int device, CUstream stream, uintptr_t dst, uintptr_t src, size_t nbytes, bool blocking);
void Memset(int device, CUstream stream, uintptr_t addr, int byte, size_t nbytes);
// Returns once the signal is visible.
void Signal(int device, CUstream stream, uintptr_t addr, uint64_t value, SignalOp op, int itemsize);
uint64_t Load(int device, CUstream stream, uintptr_t addr, int itemsize);
void Quiet(int device, CUstream stream);

}  // namespace jtd::shmem::cuda_ops

#endif  // JAX_TRITON_DIST_SHMEM_CUDA_OPS_H_
