#include "backend.h"

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <thread>

namespace jtd::shmem {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point Deadline(double timeout_s) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
}

size_t AlignUp(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

std::atomic<bool> g_cancelled{false};
std::mutex g_cancel_mu;
std::string g_cancel_reason;

// Throws ShmemAborted if waits were cancelled.
void CheckCancelled(const std::string& who) {
  if (!g_cancelled.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(g_cancel_mu);
  throw ShmemAborted(who + ": " + g_cancel_reason);
}

}  // namespace

void CancelWaits(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(g_cancel_mu);
    g_cancel_reason = "wait cancelled: " + reason;
  }
  g_cancelled.store(true, std::memory_order_release);
}

// ---------------------------------------------------------------------------
// Geometry
// ---------------------------------------------------------------------------

Backend::Backend(int n_pes, size_t heap_size) : n_pes_(n_pes), heap_size_(heap_size) {
  free_[0] = heap_size;
}

int Backend::pe_of(uintptr_t addr) const {
  for (int pe = 0; pe < static_cast<int>(bases_.size()); ++pe) {
    if (addr >= bases_[pe] && addr < bases_[pe] + heap_size_) return pe;
  }
  return -1;
}

// ---------------------------------------------------------------------------
// Allocator: first fit over a free list of offsets, shared by all heaps.
// ---------------------------------------------------------------------------

size_t Backend::alloc(size_t size, size_t alignment) {
  std::lock_guard<std::mutex> lock(alloc_mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    size_t start = AlignUp(it->first, alignment);
    size_t end = it->first + it->second;
    if (start + size > end) continue;
    reserve(start + size);  // may throw: the free list is still untouched
    size_t block_start = it->first;
    free_.erase(it);
    if (start > block_start) free_[block_start] = start - block_start;
    if (start + size < end) free_[start + size] = end - (start + size);
    used_[start] = size;
    return start;
  }
  throw ShmemError("heap exhausted");
}

size_t Backend::release(size_t offset) {
  std::lock_guard<std::mutex> lock(alloc_mu_);
  auto it = used_.find(offset);
  if (it == used_.end()) return 0;
  size_t size = it->second;
  used_.erase(it);
  auto [block, inserted] = free_.emplace(offset, size);
  // Merge with the following and the preceding free blocks.
  auto next = std::next(block);
  if (next != free_.end() && block->first + block->second == next->first) {
    block->second += next->second;
    free_.erase(next);
  }
  if (block != free_.begin()) {
    auto prev = std::prev(block);
    if (prev->first + prev->second == block->first) {
      prev->second += block->second;
      free_.erase(block);
    }
  }
  return size;
}

size_t Backend::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(alloc_mu_);
  size_t total = 0;
  for (const auto& [offset, size] : used_) total += size;
  return total;
}

size_t Backend::allocation_count() const {
  std::lock_guard<std::mutex> lock(alloc_mu_);
  return used_.size();
}

size_t Backend::largest_free_block() const {
  std::lock_guard<std::mutex> lock(alloc_mu_);
  size_t best = 0;
  for (const auto& [offset, size] : free_) best = std::max(best, size);
  return best;
}

// ---------------------------------------------------------------------------
// Rendezvous
// ---------------------------------------------------------------------------

std::vector<int64_t> Backend::rendezvous(int64_t key, int members, int index, int64_t value,
                                         double timeout_s) {
  if (members <= 0 || index < 0 || index >= members) {
    throw std::invalid_argument("rendezvous: index " + std::to_string(index) +
                                " out of range for " + std::to_string(members) + " members");
  }
  std::unique_lock<std::mutex> lock(rv_mu_);
  Rendezvous& rv = rendezvous_[key];
  if (rv.members == 0) {
    rv.members = members;
    rv.next_gen.assign(members, 0);
  } else if (rv.members != members) {
    throw ShmemError("rendezvous " + std::to_string(key) + " joined with " +
                     std::to_string(members) + " members, but it has " +
                     std::to_string(rv.members));
  }
  const uint64_t gen = rv.next_gen[index];
  Round& round = rv.rounds[gen];
  if (round.values.empty()) {
    round.values.assign(members, 0);
    round.present.assign(members, false);
  }
  round.values[index] = value;
  round.present[index] = true;
  if (++round.arrived == members) {
    round.complete = true;
    rv_cv_.notify_all();
  }
  auto deadline = Deadline(timeout_s);
  while (!round.complete && !round.failed) {
    if (g_cancelled.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> cancel(g_cancel_mu);
      round.failed = true;
      round.error = "rendezvous " + std::to_string(key) + ": " + g_cancel_reason;
      rv_cv_.notify_all();
      break;
    }
    // Wake up now and then to notice a cancellation (the interpreter exiting).
    auto wake = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
    if (rv_cv_.wait_until(lock, wake) == std::cv_status::timeout && Clock::now() >= deadline &&
        !round.complete && !round.failed) {
      std::string missing;
      for (int i = 0; i < members; ++i) {
        if (!round.present[i]) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(i);
        }
      }
      char buf[160];
      std::snprintf(buf, sizeof(buf),
                    "timed out after %.1f s: %d of %d members arrived, missing: ", timeout_s,
                    round.arrived, members);
      round.failed = true;
      round.error = std::string(buf) + missing;
      rv_cv_.notify_all();
    }
  }
  rv.next_gen[index] = gen + 1;
  if (round.failed) {
    std::string error = round.error;
    if (++round.departed == members) rv.rounds.erase(gen);
    throw ShmemTimeout(error);
  }
  std::vector<int64_t> result = round.values;
  if (++round.departed == members) rv.rounds.erase(gen);
  return result;
}

// ---------------------------------------------------------------------------
// Waits
// ---------------------------------------------------------------------------

void CheckItemsize(int itemsize) {
  if (itemsize != 4 && itemsize != 8) {
    throw std::invalid_argument("signals and flags must be 32- or 64-bit integers, got " +
                                std::to_string(itemsize) + " bytes");
  }
}

namespace {

int64_t AsSigned(uint64_t raw, int itemsize, bool is_signed) {
  if (itemsize == 8) return static_cast<int64_t>(raw);
  uint32_t v = static_cast<uint32_t>(raw);
  return is_signed ? static_cast<int64_t>(static_cast<int32_t>(v)) : static_cast<int64_t>(v);
}

bool Compare(int64_t seen, Cmp cmp, int64_t value, bool is_signed) {
  if (!is_signed) {
    uint64_t s = static_cast<uint64_t>(seen), v = static_cast<uint64_t>(value);
    switch (cmp) {
      case Cmp::kEq:
        return s == v;
      case Cmp::kNe:
        return s != v;
      case Cmp::kGt:
        return s > v;
      case Cmp::kGe:
        return s >= v;
      case Cmp::kLt:
        return s < v;
      case Cmp::kLe:
        return s <= v;
    }
  }
  switch (cmp) {
    case Cmp::kEq:
      return seen == value;
    case Cmp::kNe:
      return seen != value;
    case Cmp::kGt:
      return seen > value;
    case Cmp::kGe:
      return seen >= value;
    case Cmp::kLt:
      return seen < value;
    case Cmp::kLe:
      return seen <= value;
  }
  return false;
}

const char* CmpName(Cmp cmp) {
  static const char* names[] = {"==", "!=", ">", ">=", "<", "<="};
  return names[static_cast<int>(cmp)];
}

}  // namespace

void WaitUntil(const std::function<uint64_t(uintptr_t)>& load, const std::vector<uintptr_t>& addrs,
               int itemsize, bool is_signed, Cmp cmp, int64_t value, double timeout_s,
               const std::string& who, uintptr_t abort_addr, int64_t abort_epoch,
               uintptr_t run_abort_addr) {
  CheckItemsize(itemsize);
  const auto deadline = Deadline(timeout_s);
  const auto* abort_word = reinterpret_cast<const std::atomic<int64_t>*>(abort_addr);
  const auto* run_abort_word = reinterpret_cast<const std::atomic<int64_t>*>(run_abort_addr);
  for (size_t i = 0; i < addrs.size(); ++i) {
    int spins = 0;
    while (true) {
      int64_t seen = AsSigned(load(addrs[i]), itemsize, is_signed);
      if (Compare(seen, cmp, value, is_signed)) break;
      if (++spins < 64) continue;
      CheckCancelled(who);
      if (abort_word != nullptr && abort_word->load(std::memory_order_acquire) >= abort_epoch) {
        throw ShmemAborted(who + ": wait abandoned on flag " + std::to_string(i) +
                           ": a peer rank of this call failed");
      }
      if (run_abort_word != nullptr && run_abort_word->load(std::memory_order_acquire) != 0) {
        throw ShmemAborted(who + ": wait abandoned on flag " + std::to_string(i) +
                           ": a call of this execution failed");
      }
      if (Clock::now() > deadline) {
        char buf[512];
        std::snprintf(buf, sizeof(buf),
                      "%s: wait timed out after %.1f s on flag %zu of %zu "
                      "(address 0x%" PRIxPTR "): expected value %s %" PRId64 ", saw %" PRId64,
                      who.c_str(), timeout_s, i, addrs.size(), addrs[i], CmpName(cmp), value, seen);
        throw ShmemTimeout(buf);
      }
      // Back off: other PEs may be threads of this process and need the cores.
      if (spins < 256) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }
}

void Backend::wait(int pe, const std::vector<uintptr_t>& addrs, int itemsize, bool is_signed,
                   Cmp cmp, int64_t value, double timeout_s, const std::string& who) {
  WaitUntil([&](uintptr_t addr) { return load(pe, addr, itemsize); }, addrs, itemsize, is_signed,
            cmp, value, timeout_s, who);
}

}  // namespace jtd::shmem
