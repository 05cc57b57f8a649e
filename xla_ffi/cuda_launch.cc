// nanobind module `jax_triton_dist._cuda`: the XLA FFI handler that launches compiled
// distributed Triton kernels on NVIDIA GPUs, and its table of launch plans. (The driver
// calls the Python runtime makes to prepare a plan live in `_cuda_driver`.)
//
// libcuda is loaded at run time (dlopen), so the module imports on machines without a
// GPU; a launch then fails with a clear message.
//
// Per call the handler does no allocation and no synchronisation: it writes the call's
// epoch into the rank context with a stream memory operation and launches the kernel on
// XLA's stream. The first call of a (call site, device) asks the Python planner
// (jax_triton_dist/runtime/cuda_dispatch.py) for a launch plan.
//
// The autotuner times a call site's configs through `time_launches` (the same enqueue as
// the handler's) at its first call.
//
// A wait that times out on the GPU writes an error record into host-mapped memory and
// lets the launch finish (no trap: the CUDA context survives); the next call of that call
// site on that device reads the record (no device synchronisation) and fails with it.
#include <cuda.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda_driver.h"
#include "site_uses.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
using namespace nb::literals;

namespace jtd::cuda {
namespace {

using cuda_driver::Check;
using cuda_driver::ErrorText;
using cuda_driver::kTritonScratchParams;

const cuda_driver::Table& D() { return cuda_driver::Driver(); }

// ---------------------------------------------------------------------------
// Launch plans
// ---------------------------------------------------------------------------

// One kernel parameter: a buffer of the call (operand / result), a fixed value, or an
// operand staged into one of two symmetric slots (by epoch parity) before the launch.
// The values are jax_triton_dist/language/device_abi.py's ParamKind (a test checks).
enum class ParamKind : int { kOperand = 0, kResult = 1, kValue = 2, kStaged = 3 };

// device_abi.staging_slot: slot 0 for even epochs, slot 1 for odd ones.
uint64_t StagingSlot(uint32_t epoch, uint64_t even, uint64_t odd) { return epoch % 2 ? odd : even; }

struct Param {
  ParamKind kind;
  int64_t index;   // operand or result index
  uint64_t value;  // kValue: the bytes (little-endian); kStaged: slot 0
  uint64_t alt;    // kStaged: slot 1
  int64_t size;    // bytes of the parameter; kStaged: bytes to copy
};

// device_abi.RECORD: what a wait that timed out leaves for the host (a test checks that
// the layouts agree).
struct ErrorRecord {
  uint32_t status;  // 0 empty, 1 being written, 2 written
  int32_t rank;
  int32_t num_ranks;
  int32_t flag_index;
  int32_t epoch;
  int32_t reserved;
  int64_t site;
  int64_t address;
  int64_t expected;
  int64_t seen;
};
constexpr uint32_t kRecordWritten = 2;

// What one launch needs besides its buffers.
struct LaunchSpec {
  CUfunction function;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  std::vector<Param> params;
  CUdeviceptr epoch_addr;  // the rank context's epoch
  uint64_t scratch;        // Triton's global scratch (device-made TMA descriptors), or 0
};

struct Plan {
  CUmodule module;
  LaunchSpec launch;
  volatile ErrorRecord* record;  // host view of the device's error record
  std::string label;             // the kernel, for the error message
  int log_rank = -1;             // >= 0: JTD_LOG=launch; the launch logger gets each launch
  uint32_t epoch = 0;
  std::mutex mu;  // one device runs one call site's launches in order; guards `epoch`
};

// Enqueues one launch of `spec` in `epoch` on `stream`: the epoch into the rank context,
// symmetric operands into their slot, then the kernel. `args` and `rets` are the call's
// buffer addresses (args[0]: the coordinates). Returns "" or what failed.
std::string Enqueue(const LaunchSpec& spec, uint32_t epoch, const std::vector<uint64_t>& args,
                    const std::vector<uint64_t>& rets, CUstream stream) {
  std::vector<uint64_t> storage(spec.params.size() + kTritonScratchParams, 0);
  std::vector<void*> pointers(storage.size());
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const Param& p = spec.params[i];
    if (p.kind == ParamKind::kOperand || p.kind == ParamKind::kStaged) {
      if (p.index < 0 || static_cast<size_t>(p.index) >= args.size()) return "operand index";
      storage[i] = args[p.index];
      if (p.kind == ParamKind::kStaged) {
        const uint64_t slot = StagingSlot(epoch, p.value, p.alt);
        CUresult r = D().cuMemcpyDtoDAsync(slot, storage[i], p.size, stream);
        if (r != CUDA_SUCCESS) return "staging a symmetric argument: " + ErrorText(r);
        storage[i] = slot;
      }
    } else if (p.kind == ParamKind::kResult) {
      if (p.index < 0 || static_cast<size_t>(p.index) >= rets.size()) return "result index";
      storage[i] = rets[p.index];
    } else {
      storage[i] = p.value;
    }
  }
  storage[spec.params.size()] = spec.scratch;  // then the profile scratch: none
  for (size_t i = 0; i < storage.size(); ++i) pointers[i] = &storage[i];
  CUresult r = D().cuStreamWriteValue32(stream, spec.epoch_addr, epoch, 0);
  if (r != CUDA_SUCCESS) return "cuStreamWriteValue32: " + ErrorText(r);
  r = D().cuLaunchKernel(spec.function, spec.grid[0], spec.grid[1], spec.grid[2], spec.block, 1, 1,
                         spec.shared, stream, pointers.data(), nullptr);
  if (r != CUDA_SUCCESS) return "cuLaunchKernel: " + ErrorText(r);
  return "";
}

LaunchSpec MakeSpec(
    uintptr_t function, const std::vector<unsigned>& grid, unsigned block, unsigned shared,
    const std::vector<std::tuple<int, int64_t, uint64_t, uint64_t, int64_t>>& params,
    uint64_t epoch_addr, uint64_t scratch) {
  LaunchSpec spec;
  spec.function = reinterpret_cast<CUfunction>(function);
  for (int i = 0; i < 3; ++i) spec.grid[i] = i < static_cast<int>(grid.size()) ? grid[i] : 1;
  spec.block = block;
  spec.shared = shared;
  for (const auto& [kind, index, value, alt, size] : params) {
    spec.params.push_back({static_cast<ParamKind>(kind), index, value, alt, size});
  }
  spec.epoch_addr = epoch_addr;
  spec.scratch = scratch;
  return spec;
}

// Launches of a variant the autotuner times: events around each timed launch.
struct TimedLaunches {
  int device;
  std::vector<std::pair<CUevent, CUevent>> events;
};

// The failure recorded in `r` (by a wait of call site `site`, or of any), formatted with the
// kernel's `label`; the record is emptied, so that later failures are recorded too. ""
// when there is none.
std::string TakeFailure(volatile ErrorRecord* r, int64_t site, bool any_site,
                        const std::string& label, int device) {
  if (r == nullptr || r->status != kRecordWritten || (!any_site && r->site != site)) return "";
  std::atomic_thread_fence(std::memory_order_acquire);
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "GPU %d: rank %d of %d, kernel %s: dl.wait timed out in call %d on flag %d "
                "(address 0x%llx): expected %lld, saw %lld (the launch ended without a "
                "trap; later calls run again)",
                device, r->rank, r->num_ranks, label.c_str(), r->epoch, r->flag_index,
                static_cast<unsigned long long>(r->address), static_cast<long long>(r->expected),
                static_cast<long long>(r->seen));
  r->status = 0;
  return buf;
}

std::mutex g_plans_mu;
std::map<std::pair<int64_t, int>, std::unique_ptr<Plan>> g_plans;
// Plans dropped by clear_plans stay allocated: a handler may still hold a pointer.
std::vector<std::unique_ptr<Plan>> g_retired;
nb::object* g_planner = nullptr;        // leaked: must outlive interpreter shutdown
nb::object* g_launch_logger = nullptr;  // leaked likewise
// At interpreter exit no launch may enter Python (to plan, or to log) (see cpu_dispatch.cc).
std::atomic<int> g_in_python{0};
std::atomic<bool> g_closing{false};

// A launch's call into Python, counted from before its look at g_closing until it has
// left Python: close() waits for it, or it sees closing and stays out.
class PythonEntry {
 public:
  PythonEntry() { g_in_python.fetch_add(1); }
  ~PythonEntry() { g_in_python.fetch_sub(1); }
  PythonEntry(const PythonEntry&) = delete;
  PythonEntry& operator=(const PythonEntry&) = delete;
  bool allowed() const { return !g_closing.load(); }
};

Plan* FindPlan(int64_t call_id, int device) {
  std::lock_guard<std::mutex> lock(g_plans_mu);
  auto it = g_plans.find({call_id, device});
  return it == g_plans.end() ? nullptr : it->second.get();
}

ffi::Error Fail(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInternal, "jax_triton_dist (CUDA): " + message);
}

ffi::Error CudaLaunchImpl(CUstream stream, int32_t device, ffi::RemainingArgs args,
                          ffi::RemainingRets rets, int64_t call_id) {
  std::vector<uint64_t> arg_addrs(args.size()), ret_addrs(rets.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return buffer.error();
    arg_addrs[i] = reinterpret_cast<uint64_t>(buffer->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return buffer.error();
    ret_addrs[i] = reinterpret_cast<uint64_t>((*buffer)->untyped_data());
  }
  Plan* plan = FindPlan(call_id, device);
  if (plan == nullptr) {
    // First call of this call site on this device: the coordinates (operand 0) are
    // needed on the host once, and an autotuned kernel times its configs on the call's
    // buffers, so wait for them; then plan in Python.
    PythonEntry entry;
    if (!entry.allowed()) return Fail("the interpreter is exiting; the kernel did not run");
    try {
      Check(D().cuStreamSynchronize(stream), "cuStreamSynchronize");
      nb::gil_scoped_acquire gil;
      if (g_planner == nullptr) return Fail("no CUDA planner is registered");
      nb::object failure = (*g_planner)(call_id, device, arg_addrs, ret_addrs);
      if (!failure.is_none()) return Fail(nb::cast<std::string>(failure));
    } catch (const std::exception& e) {
      return Fail(e.what());
    }
    plan = FindPlan(call_id, device);
    if (plan == nullptr) return Fail("the planner registered no plan");
  }

  std::lock_guard<std::mutex> lock(plan->mu);
  if (std::string failure = TakeFailure(plan->record, call_id, false, plan->label, device);
      !failure.empty()) {
    return Fail(failure);
  }
  const uint32_t epoch = plan->epoch + 1;
  if (std::string failure = Enqueue(plan->launch, epoch, arg_addrs, ret_addrs, stream);
      !failure.empty()) {
    return Fail(failure);
  }
  plan->epoch = epoch;
  if (plan->log_rank >= 0 && g_launch_logger != nullptr) {  // counted only when logging
    PythonEntry entry;
    if (entry.allowed()) {
      try {
        nb::gil_scoped_acquire gil;
        (*g_launch_logger)(call_id, device, plan->log_rank, epoch);
      } catch (const std::exception& e) {
        return Fail(std::string("the launch logger failed: ") + e.what());
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaInstantiate, site_uses::Instantiate,
                              ffi::Ffi::BindInstantiate().Attr<int64_t>("call_id"));  // call site

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaLaunch, CudaLaunchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()             // device
                                  .RemainingArgs()                       // coords + inputs
                                  .RemainingRets()                       // results
                                  .Attr<int64_t>("call_id"));            // call site

}  // namespace jtd::cuda

NB_MODULE(_cuda, m) {
  using namespace jtd::cuda;
  m.doc() = "CUDA launcher of jax_triton_dist (private; used by runtime/cuda_dispatch.py)";

  m.def("registrations", [] {
    nb::dict stages, targets;
    stages["instantiate"] = nb::capsule(reinterpret_cast<void*>(kCudaInstantiate));
    stages["execute"] = nb::capsule(reinterpret_cast<void*>(kCudaLaunch));
    targets["jtd_triton"] = stages;
    return targets;
  });
  jtd::site_uses::Bind(m);
  m.def(
      "set_planner",
      [](nb::object planner) {
        if (g_planner == nullptr) g_planner = new nb::object();
        *g_planner = std::move(planner);
      },
      "planner"_a, "Sets the Python planner of first calls (runtime/cuda_dispatch.plan).");
  m.def(
      "set_launch_logger",
      [](nb::object logger) {
        if (g_launch_logger == nullptr) g_launch_logger = new nb::object();
        *g_launch_logger = std::move(logger);
      },
      "logger"_a,
      "Sets what plans registered with a log rank call after each launch, as "
      "logger(call_id, device, rank, epoch) (runtime/cuda_dispatch.log_launch).");
  m.def(
      "set_plan",
      [](int64_t call_id, int device, uintptr_t module, uintptr_t function,
         std::vector<unsigned> grid, unsigned block, unsigned shared,
         std::vector<std::tuple<int, int64_t, uint64_t, uint64_t, int64_t>> params,
         uint64_t epoch_addr, uintptr_t record, std::string label, int log_rank, uint32_t epoch,
         uint64_t scratch) {
        auto plan = std::make_unique<Plan>();
        plan->module = reinterpret_cast<CUmodule>(module);
        plan->launch = MakeSpec(function, grid, block, shared, params, epoch_addr, scratch);
        plan->record = reinterpret_cast<volatile ErrorRecord*>(record);
        plan->label = std::move(label);
        plan->log_rank = log_rank;
        plan->epoch = epoch;
        std::lock_guard<std::mutex> lock(g_plans_mu);
        g_plans[{call_id, device}] = std::move(plan);
      },
      "call_id"_a, "device"_a, "module"_a, "function"_a, "grid"_a, "block"_a, "shared"_a,
      "params"_a, "epoch_addr"_a, "record"_a, "label"_a, "log_rank"_a = -1, "epoch"_a = 0,
      "scratch"_a = 0,
      "Registers the launch plan of (call site, device); `epoch`: launches made already "
      "(the autotuner's), so the next call runs in epoch + 1; `scratch`: the kernel's "
      "global scratch (0: none).");
  m.def(
      "time_launches",
      [](int device, uintptr_t function, std::vector<unsigned> grid, unsigned block,
         unsigned shared, std::vector<std::tuple<int, int64_t, uint64_t, uint64_t, int64_t>> params,
         uint64_t epoch_addr, uint32_t first_epoch, std::vector<uint64_t> args,
         std::vector<uint64_t> rets, int warmup, int rep, uintptr_t stream, uint64_t scratch) {
        jtd::cuda_driver::DeviceScope scope(device);
        const LaunchSpec spec =
            MakeSpec(function, grid, block, shared, params, epoch_addr, scratch);
        auto timed = std::make_unique<TimedLaunches>();
        timed->device = device;
        auto s = reinterpret_cast<CUstream>(stream);
        uint32_t epoch = first_epoch;
        for (int i = 0; i < warmup + rep; ++i, ++epoch) {
          CUevent start = nullptr, end = nullptr;
          if (i >= warmup) {
            Check(D().cuEventCreate(&start, CU_EVENT_DEFAULT), "cuEventCreate");
            Check(D().cuEventCreate(&end, CU_EVENT_DEFAULT), "cuEventCreate");
            timed->events.emplace_back(start, end);
            Check(D().cuEventRecord(start, s), "cuEventRecord");
          }
          std::string failure = Enqueue(spec, epoch, args, rets, s);
          if (!failure.empty()) throw std::runtime_error(failure);
          if (end != nullptr) Check(D().cuEventRecord(end, s), "cuEventRecord");
        }
        return reinterpret_cast<uintptr_t>(timed.release());
      },
      "device"_a, "function"_a, "grid"_a, "block"_a, "shared"_a, "params"_a, "epoch_addr"_a,
      "first_epoch"_a, "args"_a, "rets"_a, "warmup"_a, "rep"_a, "stream"_a, "scratch"_a = 0,
      "Enqueues warmup + rep launches (epochs first_epoch, first_epoch + 1, ...) on `stream` "
      "with events around the timed ones; returns a handle for timed_results.");
  m.def(
      "timed_results",
      [](uintptr_t handle) {
        std::unique_ptr<TimedLaunches> timed(reinterpret_cast<TimedLaunches*>(handle));
        jtd::cuda_driver::DeviceScope scope(timed->device);
        std::vector<float> ms;
        std::string failure;
        {
          nb::gil_scoped_release release;
          for (auto& [start, end] : timed->events) {
            float elapsed = 0;
            CUresult r = D().cuEventSynchronize(end);
            if (r == CUDA_SUCCESS) r = D().cuEventElapsedTime(&elapsed, start, end);
            if (r != CUDA_SUCCESS && failure.empty()) failure = ErrorText(r);
            ms.push_back(elapsed);
            D().cuEventDestroy(start);
            D().cuEventDestroy(end);
          }
        }
        if (!failure.empty()) throw std::runtime_error("timing launches: " + failure);
        return ms;
      },
      "handle"_a,
      "Waits for the launches of a time_launches handle; milliseconds of each timed launch.");
  m.def(
      "close",
      [](double timeout_s) {
        g_closing.store(true);
        nb::gil_scoped_release release;  // a running plan needs the GIL to finish
        const auto deadline = std::chrono::steady_clock::now() +
                              std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                  std::chrono::duration<double>(timeout_s));
        while (g_in_python.load() > 0 && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        return g_in_python.load();
      },
      "timeout_s"_a,
      "Stops launches from entering Python (to plan a first call, or to log) and waits up "
      "to timeout_s for those in it (interpreter exit); returns how many still are.");
  m.def(
      "drop_plans",
      [](int64_t call_id) {
        // No executable uses the call site any more, so no handler holds these plans.
        std::lock_guard<std::mutex> lock(g_plans_mu);
        std::vector<std::pair<int, uintptr_t>> dropped;
        for (auto it = g_plans.begin(); it != g_plans.end();) {
          if (it->first.first == call_id) {
            dropped.emplace_back(it->first.second, reinterpret_cast<uintptr_t>(it->second->module));
            it = g_plans.erase(it);
          } else {
            ++it;
          }
        }
        return dropped;
      },
      "call_id"_a, "Forgets a call site's plans; returns their (device, module) to unload.");
  m.def(
      "take_failure",
      [](uintptr_t record, int device, int64_t site, bool any_site, const std::string& label) {
        return TakeFailure(reinterpret_cast<volatile ErrorRecord*>(record), site, any_site, label,
                           device);
      },
      "record"_a, "device"_a, "site"_a, "any_site"_a, "label"_a,
      "The failure in a host-mapped error record (of `site`, or of any), emptying it; \"\" "
      "if none.");
  m.def("record_layout", [] {
    nb::dict layout;
    layout["size"] = sizeof(ErrorRecord);
    layout["status"] = offsetof(ErrorRecord, status);
    layout["rank"] = offsetof(ErrorRecord, rank);
    layout["flag_index"] = offsetof(ErrorRecord, flag_index);
    layout["epoch"] = offsetof(ErrorRecord, epoch);
    layout["site"] = offsetof(ErrorRecord, site);
    layout["address"] = offsetof(ErrorRecord, address);
    layout["expected"] = offsetof(ErrorRecord, expected);
    layout["seen"] = offsetof(ErrorRecord, seen);
    return layout;
  });
  m.def(
      "clear_plans",
      [] {
        std::lock_guard<std::mutex> lock(g_plans_mu);
        std::vector<int> devices;
        for (auto& [key, plan] : g_plans) {
          devices.push_back(key.second);
          g_retired.push_back(std::move(plan));
        }
        g_plans.clear();
        std::sort(devices.begin(), devices.end());
        devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
        return devices;
      },
      "Forgets every launch plan; returns the devices that had one.");
  // The launcher's side of the device ABI, for the test that checks it against
  // device_abi.py.
  m.def("param_kinds", [] {
    nb::dict kinds;
    kinds["OPERAND"] = static_cast<int>(ParamKind::kOperand);
    kinds["RESULT"] = static_cast<int>(ParamKind::kResult);
    kinds["VALUE"] = static_cast<int>(ParamKind::kValue);
    kinds["STAGED"] = static_cast<int>(ParamKind::kStaged);
    return kinds;
  });
  m.def("staging_slot", &StagingSlot, "epoch"_a, "even"_a, "odd"_a);
}
