// Host SHMEM backend: one process, N processing elements (PEs), one PE per
// JAX CPU device. Each PE's symmetric heap is a separate anonymous mapping of
// the same size; a symmetric allocation is one offset valid in every heap.
//
// Only memory, atomics and the rendezvous primitive live here; the SHMEM
// semantics (collective checks, teams, error wording) live in Python
// (jax_triton_dist/shmem.py).
#ifndef JAX_TRITON_DIST_SHMEM_HOST_BACKEND_H_
#define JAX_TRITON_DIST_SHMEM_HOST_BACKEND_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace jtd::shmem {

// Raised for SHMEM misuse (maps to jax_triton_dist.shmem.ShmemError).
class ShmemError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Raised when a wait or a rendezvous passes its deadline.
class ShmemTimeout : public ShmemError {
 public:
  using ShmemError::ShmemError;
};

// Comparison operators of wait_until (the project's own numbering; other
// backends translate).
enum class Cmp : int { kEq = 0, kNe = 1, kGt = 2, kGe = 3, kLt = 4, kLe = 5 };

// Signal operations (the project's own numbering).
enum class SignalOp : int { kSet = 0, kAdd = 1 };

// What every SHMEM backend provides to the Python layer: symmetric heaps,
// an offset allocator over them, and a rendezvous among the PEs of a process.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual int n_pes() const = 0;
  virtual size_t heap_size() const = 0;
  virtual uintptr_t heap_base(int pe) const = 0;
  // PE whose heap holds `addr`, or -1.
  virtual int pe_of(uintptr_t addr) const = 0;
  // Non-collective symmetric allocation: an offset valid in every heap.
  // Throws ShmemError when the heap has no room.
  virtual size_t alloc(size_t size, size_t alignment) = 0;
  // Releases an offset returned by alloc; returns its size (0 if unknown).
  virtual size_t release(size_t offset) = 0;
  virtual size_t allocated_bytes() const = 0;
  virtual size_t largest_free_block() const = 0;
  // All-gather of one int64 among `members` participants of rendezvous
  // `key`. Calls pair up in order per (key, index). Throws ShmemTimeout when
  // not all members arrive before `timeout_s`.
  virtual std::vector<int64_t> exchange(int64_t key, int members, int index,
                                        int64_t value, double timeout_s) = 0;
};

// The `host` backend.
class HostBackend final : public Backend {
 public:
  HostBackend(int n_pes, size_t heap_size);
  ~HostBackend() override;
  HostBackend(const HostBackend&) = delete;
  HostBackend& operator=(const HostBackend&) = delete;

  const char* name() const override { return "host"; }
  int n_pes() const override { return n_pes_; }
  size_t heap_size() const override { return heap_size_; }
  uintptr_t heap_base(int pe) const override;
  int pe_of(uintptr_t addr) const override;
  size_t alloc(size_t size, size_t alignment) override;
  size_t release(size_t offset) override;
  size_t allocated_bytes() const override;
  size_t largest_free_block() const override;
  std::vector<int64_t> exchange(int64_t key, int members, int index,
                                int64_t value, double timeout_s) override;

 private:
  struct Round {
    std::vector<int64_t> values;
    std::vector<bool> present;
    int arrived = 0;
    int departed = 0;
    bool complete = false;
    bool failed = false;  // a member timed out; everyone leaves with `error`
    std::string error;
  };
  struct Rendezvous {
    int members = 0;
    std::vector<uint64_t> next_gen;  // per member
    std::map<uint64_t, Round> rounds;
  };

  int n_pes_;
  size_t heap_size_;
  std::vector<void*> heaps_;

  mutable std::mutex alloc_mu_;
  std::map<size_t, size_t> used_;  // offset -> size
  std::map<size_t, size_t> free_;  // offset -> size

  std::mutex rv_mu_;
  std::condition_variable rv_cv_;
  std::map<int64_t, Rendezvous> rendezvous_;
};

// Atomic operations on host memory (signals are 64-bit, kernel flags 32- or
// 64-bit): a release store (SET) or an acquire-release add (ADD); an acquire
// load.
void signal_op(uintptr_t addr, uint64_t value, SignalOp op, int itemsize);
uint64_t signal_fetch(uintptr_t addr, int itemsize);

// Spins (with back-off) until every flag at `addrs` compares true against
// `value`. Flags are `itemsize` bytes wide (4 or 8), signed or not. On
// timeout throws ShmemTimeout naming `who`, the flag index and address, the
// expected and the seen value.
void wait_flags(const std::vector<uintptr_t>& addrs, int itemsize,
                bool is_signed, Cmp cmp, int64_t value, double timeout_s,
                const std::string& who);

void fence();

}  // namespace jtd::shmem

#endif  // JAX_TRITON_DIST_SHMEM_HOST_BACKEND_H_
