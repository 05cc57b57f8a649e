// What every SHMEM backend shares: symmetric heaps (one per PE, the same size), a
// first-fit offset allocator over them (one offset is valid in every heap), an in-process
// rendezvous among the PEs, and the memory operations the Python layer needs.
//
// Only memory, atomics and the rendezvous primitive live in C++; the SHMEM semantics
// (collective checks, teams, error wording) live in Python (the jax_triton_dist.shmem
// package).
#ifndef JAX_TRITON_DIST_SHMEM_BACKEND_H_
#define JAX_TRITON_DIST_SHMEM_BACKEND_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
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

// Raised when a wait or a rendezvous is abandoned before its deadline: a peer of the wait
// failed (its abort word reached the waiter's epoch), or every wait was cancelled.
class ShmemAborted : public ShmemError {
 public:
  using ShmemError::ShmemError;
};

// Makes every wait and rendezvous of the process, running or to come, throw ShmemAborted
// with `reason` (the interpreter is exiting: no thread may stay in a spin).
void CancelWaits(const std::string& reason);

// Comparison operators of wait_until (the project's own numbering; backends that wrap
// another SHMEM library translate).
enum class Cmp : int { kEq = 0, kNe = 1, kGt = 2, kGe = 3, kLt = 4, kLe = 5 };

// Signal operations (the project's own numbering).
enum class SignalOp : int { kSet = 0, kAdd = 1 };

// Throws std::invalid_argument unless `itemsize` is 4 or 8.
void CheckItemsize(int itemsize);

// Spins (with back-off) until each of `addrs` compares true against `value`, reading a
// flag with `load(addr)` (`itemsize` bytes, signed or not). On timeout throws
// ShmemTimeout naming `who`, the flag index and address, the expected and the seen value.
// With `abort_addr` (a host int64, 0: none), throws ShmemAborted as soon as the value there
// reaches `abort_epoch` (a peer of this call failed); with `run_abort_addr` (a host int64,
// 0: none), as soon as the value there is nonzero (a call of the same execution failed);
// so do cancelled waits (CancelWaits).
void WaitUntil(const std::function<uint64_t(uintptr_t)>& load, const std::vector<uintptr_t>& addrs,
               int itemsize, bool is_signed, Cmp cmp, int64_t value, double timeout_s,
               const std::string& who, uintptr_t abort_addr = 0, int64_t abort_epoch = 0,
               uintptr_t run_abort_addr = 0);

class Backend {
 public:
  Backend(int n_pes, size_t heap_size);
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual const char* name() const = 0;
  int n_pes() const { return n_pes_; }
  size_t heap_size() const { return heap_size_; }
  uintptr_t heap_base(int pe) const { return bases_.at(pe); }
  // PE whose heap holds `addr`, or -1.
  int pe_of(uintptr_t addr) const;
  // Device of PE `pe` (-1: host memory).
  virtual int device_of(int pe) const { return -1; }

  // Non-collective symmetric allocation: an offset valid in every heap.
  // Throws ShmemError when the heap has no room.
  size_t alloc(size_t size, size_t alignment);
  // Releases an offset returned by alloc; returns its size (0 if unknown).
  size_t release(size_t offset);
  size_t allocated_bytes() const;
  size_t allocation_count() const;
  size_t largest_free_block() const;

  // All-gather of one int64 among `members` participants of rendezvous `key`. Calls pair
  // up in order per (key, index). Throws ShmemTimeout when not all members arrive before
  // `timeout_s`.
  std::vector<int64_t> rendezvous(int64_t key, int members, int index, int64_t value,
                                  double timeout_s);

  // Memory operations issued by PE `pe` (addresses are in any heap or in local memory).
  // Copies `nbytes`; returns once complete unless `blocking` is false (then `quiet`).
  virtual void copy(int pe, uintptr_t dst, uintptr_t src, size_t nbytes, bool blocking) = 0;
  virtual void memset(int pe, uintptr_t addr, int byte, size_t nbytes) = 0;
  // Atomically sets or adds `value` to the `itemsize`-byte word at `addr`, ordered after
  // this PE's earlier copies (release); returns once it is visible.
  virtual void signal_op(int pe, uintptr_t addr, uint64_t value, SignalOp op, int itemsize) = 0;
  // Acquire load of the `itemsize`-byte word at `addr`.
  virtual uint64_t load(int pe, uintptr_t addr, int itemsize) = 0;
  // Completes this PE's outstanding non-blocking operations.
  virtual void quiet(int pe) = 0;

  void wait(int pe, const std::vector<uintptr_t>& addrs, int itemsize, bool is_signed, Cmp cmp,
            int64_t value, double timeout_s, const std::string& who);

 protected:
  // Called with the end offset of every new allocation, before it is handed out (a
  // backend that commits memory lazily maps it here). Throws ShmemError if it cannot.
  virtual void reserve(size_t end) {}
  std::vector<uintptr_t> bases_;

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

  mutable std::mutex alloc_mu_;
  std::map<size_t, size_t> used_;  // offset -> size
  std::map<size_t, size_t> free_;  // offset -> size

  std::mutex rv_mu_;
  std::condition_variable rv_cv_;
  std::map<int64_t, Rendezvous> rendezvous_;
};

}  // namespace jtd::shmem

#endif  // JAX_TRITON_DIST_SHMEM_BACKEND_H_
