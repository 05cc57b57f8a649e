// The `host` SHMEM backend: one process, N PEs, one PE per JAX CPU device. Each PE's
// symmetric heap is a separate anonymous mapping of the same size (pages are committed
// on first use). Also the host-memory atomics the Triton interpreter's `dl` primitives
// use directly.
#ifndef JAX_TRITON_DIST_SHMEM_HOST_BACKEND_H_
#define JAX_TRITON_DIST_SHMEM_HOST_BACKEND_H_

#include <cstdint>
#include <string>
#include <vector>

#include "backend.h"

namespace jtd::shmem {

class HostBackend final : public Backend {
 public:
  HostBackend(int n_pes, size_t heap_size);
  ~HostBackend() override;

  const char* name() const override { return "host"; }
  void copy(int pe, uintptr_t dst, uintptr_t src, size_t nbytes, bool blocking) override;
  void memset(int pe, uintptr_t addr, int byte, size_t nbytes) override;
  void signal_op(int pe, uintptr_t addr, uint64_t value, SignalOp op, int itemsize) override;
  uint64_t load(int pe, uintptr_t addr, int itemsize) override;
  void quiet(int pe) override;
};

// Atomic operations on host memory (signals are 64-bit, kernel flags 32- or 64-bit): a
// release store (SET) or an acquire-release add (ADD); an acquire load.
void signal_op(uintptr_t addr, uint64_t value, SignalOp op, int itemsize);
uint64_t signal_fetch(uintptr_t addr, int itemsize);

// WaitUntil on host memory (abandoned when the int64 at `abort_addr` reaches
// `abort_epoch`, or the int64 at `run_abort_addr` is nonzero; 0: no such word).
void wait_flags(const std::vector<uintptr_t>& addrs, int itemsize, bool is_signed, Cmp cmp,
                int64_t value, double timeout_s, const std::string& who, uintptr_t abort_addr,
                int64_t abort_epoch, uintptr_t run_abort_addr);

void fence();

}  // namespace jtd::shmem

#endif  // JAX_TRITON_DIST_SHMEM_HOST_BACKEND_H_
