#include "host_backend.h"

#include <sys/mman.h>

#include <atomic>
#include <cstring>

namespace jtd::shmem {

HostBackend::HostBackend(int n_pes, size_t heap_size) : Backend(n_pes, heap_size) {
  for (int pe = 0; pe < n_pes; ++pe) {
    void* heap = mmap(nullptr, heap_size, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (heap == MAP_FAILED) {
      for (uintptr_t base : bases_) munmap(reinterpret_cast<void*>(base), heap_size);
      throw ShmemError("shmem.init: could not map a heap of " + std::to_string(heap_size) +
                       " bytes for PE " + std::to_string(pe) +
                       " (lower heap_size / JTD_SHMEM_HEAP_SIZE)");
    }
    bases_.push_back(reinterpret_cast<uintptr_t>(heap));
  }
}

HostBackend::~HostBackend() {
  for (uintptr_t base : bases_) munmap(reinterpret_cast<void*>(base), heap_size());
}

void HostBackend::copy(int, uintptr_t dst, uintptr_t src, size_t nbytes, bool) {
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
}

void HostBackend::memset(int, uintptr_t addr, int byte, size_t nbytes) {
  std::memset(reinterpret_cast<void*>(addr), byte, nbytes);
}

void HostBackend::signal_op(int, uintptr_t addr, uint64_t value, SignalOp op, int itemsize) {
  fence();  // ordered after this PE's earlier copies
  jtd::shmem::signal_op(addr, value, op, itemsize);
}

uint64_t HostBackend::load(int, uintptr_t addr, int itemsize) {
  return signal_fetch(addr, itemsize);
}

void HostBackend::quiet(int) { fence(); }

namespace {

template <typename T>
void AtomicSignal(uintptr_t addr, T value, SignalOp op) {
  auto* word = reinterpret_cast<std::atomic<T>*>(addr);
  if (op == SignalOp::kSet) {
    word->store(value, std::memory_order_release);
  } else {
    word->fetch_add(value, std::memory_order_acq_rel);
  }
}

}  // namespace

void signal_op(uintptr_t addr, uint64_t value, SignalOp op, int itemsize) {
  CheckItemsize(itemsize);
  if (itemsize == 8) {
    AtomicSignal<uint64_t>(addr, value, op);
  } else {
    AtomicSignal<uint32_t>(addr, static_cast<uint32_t>(value), op);
  }
}

uint64_t signal_fetch(uintptr_t addr, int itemsize) {
  CheckItemsize(itemsize);
  if (itemsize == 8) {
    return reinterpret_cast<std::atomic<uint64_t>*>(addr)->load(std::memory_order_acquire);
  }
  return reinterpret_cast<std::atomic<uint32_t>*>(addr)->load(std::memory_order_acquire);
}

void wait_flags(const std::vector<uintptr_t>& addrs, int itemsize, bool is_signed, Cmp cmp,
                int64_t value, double timeout_s, const std::string& who, uintptr_t abort_addr,
                int64_t abort_epoch, uintptr_t run_abort_addr) {
  WaitUntil([itemsize](uintptr_t addr) { return signal_fetch(addr, itemsize); }, addrs, itemsize,
            is_signed, cmp, value, timeout_s, who, abort_addr, abort_epoch, run_abort_addr);
}

void fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

}  // namespace jtd::shmem
