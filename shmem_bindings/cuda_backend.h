// The `cuda` SHMEM backend: one process driving its local GPUs (the usual single-host
// JAX setup). PE i's heap lives on GPU devices[i]; several PEs may share a GPU (to test
// distributed kernels on one GPU). Each heap is a reserved virtual address range whose
// physical memory (cuMemCreate) is mapped on demand as the allocator's high-water mark
// grows, readable and writable from every GPU of the job (cuMemSetAccess), so a kernel on
// any GPU loads and stores any PE's heap directly.
//
// Host-side operations run on one stream per PE (cuda_ops.h).
#ifndef JAX_TRITON_DIST_SHMEM_CUDA_BACKEND_H_
#define JAX_TRITON_DIST_SHMEM_CUDA_BACKEND_H_

#include <cuda.h>

#include <utility>
#include <vector>

#include "backend.h"

namespace jtd::shmem {

class CudaBackend final : public Backend {
 public:
  CudaBackend(const std::vector<int>& devices, size_t heap_size);
  ~CudaBackend() override;

  const char* name() const override { return "cuda"; }
  int device_of(int pe) const override { return devices_.at(pe); }
  void copy(int pe, uintptr_t dst, uintptr_t src, size_t nbytes, bool blocking) override;
  void memset(int pe, uintptr_t addr, int byte, size_t nbytes) override;
  void signal_op(int pe, uintptr_t addr, uint64_t value, SignalOp op, int itemsize) override;
  uint64_t load(int pe, uintptr_t addr, int itemsize) override;
  void quiet(int pe) override;

 protected:
  void reserve(size_t end) override;

 private:
  void Unmap() noexcept;

  std::vector<int> devices_;
  size_t granularity_;
  size_t mapped_ = 0;                              // bytes of physical memory mapped per heap
  std::vector<std::pair<size_t, size_t>> chunks_;  // (offset, size), mapped in every heap
  std::vector<CUstream> streams_;                  // per PE
};

}  // namespace jtd::shmem

#endif  // JAX_TRITON_DIST_SHMEM_CUDA_BACKEND_H_
