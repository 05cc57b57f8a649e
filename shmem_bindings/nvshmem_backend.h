// The `nvshmem` SHMEM backend: one process per GPU (JAX multi-process jobs started with
// jax.distributed.initialize, on one or many nodes).
//
// NVSHMEM's host library is loaded at run time from the path Python passes (the
// nvidia-nvshmem wheel's libnvshmem_host.so.3) and started from a unique id that PE 0
// creates and every PE receives (Python moves it through JAX's distributed key-value
// store: no MPI, no torch). The heap is one nvshmem_malloc block, carved by the shared
// offset allocator. Peers that nvshmem_ptr reaches (same node: NVLink or PCIe P2P) get a
// heap base, so kernels and host copies address their heaps directly; the others have base
// 0 (not reachable by load/store). Host memory operations run on this PE's own stream
// (cuda_ops.h); only this process's PE issues them.
#ifndef JAX_TRITON_DIST_SHMEM_NVSHMEM_BACKEND_H_
#define JAX_TRITON_DIST_SHMEM_NVSHMEM_BACKEND_H_

#include <cuda.h>

#include <string>

#include "backend.h"

namespace jtd::shmem {

// A fresh unique id, made by the NVSHMEM host library at `library`.
std::string NvshmemUniqueId(const std::string& library);

// The library's version, "major.minor.patch" (loads it).
std::string NvshmemVersion(const std::string& library);

class NvshmemBackend final : public Backend {
 public:
  // Starts NVSHMEM as PE `my_pe` of `n_pes` on GPU `device` with `unique_id` (from PE 0's
  // NvshmemUniqueId) and allocates a `heap_size`-byte symmetric heap.
  NvshmemBackend(const std::string& library, const std::string& unique_id, int my_pe, int n_pes,
                 int device, size_t heap_size);
  ~NvshmemBackend() override;

  const char* name() const override { return "nvshmem"; }
  int my_pe() const { return my_pe_; }
  int device_of(int pe) const override { return pe == my_pe_ ? device_ : -1; }
  void copy(int pe, uintptr_t dst, uintptr_t src, size_t nbytes, bool blocking) override;
  void memset(int pe, uintptr_t addr, int byte, size_t nbytes) override;
  void signal_op(int pe, uintptr_t addr, uint64_t value, SignalOp op, int itemsize) override;
  uint64_t load(int pe, uintptr_t addr, int itemsize) override;
  void quiet(int pe) override;
  // Binds a loaded kernel module that holds NVSHMEM device code to this NVSHMEM instance
  // (nvshmemx_cumodule_init).
  void InitModule(uintptr_t module);

 private:
  void CheckLocal(int pe, const char* what) const;
  void Shutdown() noexcept;

  const void* library_ = nullptr;  // the loaded library's function table
  int my_pe_;
  int device_;
  void* heap_ = nullptr;
  CUstream stream_ = nullptr;
  bool started_ = false;
};

}  // namespace jtd::shmem

#endif  // JAX_TRITON_DIST_SHMEM_NVSHMEM_BACKEND_H_
