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
#include <cuda.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_driver.h"
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

struct Plan {
  CUfunction function;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  std::vector<Param> params;
  CUdeviceptr epoch_addr;
  uint32_t epoch = 0;
  std::mutex mu;  // one device runs one call site's launches in order; guards `epoch`
};

std::mutex g_plans_mu;
std::map<std::pair<int64_t, int>, std::unique_ptr<Plan>> g_plans;
// Plans dropped by clear_plans stay allocated: a handler may still hold a pointer.
std::vector<std::unique_ptr<Plan>> g_retired;
nb::object* g_planner = nullptr;  // leaked: must outlive interpreter shutdown

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
  Plan* plan = FindPlan(call_id, device);
  if (plan == nullptr) {
    // First call of this call site on this device: the coordinates (operand 0) are
    // needed on the host once, so wait for them; then plan in Python.
    auto coords = args.get<ffi::AnyBuffer>(0);
    if (!coords.has_value()) return coords.error();
    try {
      Check(D().cuStreamSynchronize(stream), "cuStreamSynchronize");
      nb::gil_scoped_acquire gil;
      if (g_planner == nullptr) return Fail("no CUDA planner is registered");
      nb::object failure =
          (*g_planner)(call_id, device, reinterpret_cast<uintptr_t>(coords->untyped_data()));
      if (!failure.is_none()) return Fail(nb::cast<std::string>(failure));
    } catch (const std::exception& e) {
      return Fail(e.what());
    }
    plan = FindPlan(call_id, device);
    if (plan == nullptr) return Fail("the planner registered no plan");
  }

  std::lock_guard<std::mutex> lock(plan->mu);
  const uint32_t epoch = plan->epoch + 1;
  std::vector<uint64_t> storage(plan->params.size() + kTritonScratchParams, 0);
  std::vector<void*> pointers(plan->params.size() + kTritonScratchParams);
  for (size_t i = 0; i < plan->params.size(); ++i) {
    const Param& p = plan->params[i];
    if (p.kind == ParamKind::kOperand || p.kind == ParamKind::kStaged) {
      auto buffer = args.get<ffi::AnyBuffer>(p.index);
      if (!buffer.has_value()) return buffer.error();
      storage[i] = reinterpret_cast<uint64_t>(buffer->untyped_data());
      if (p.kind == ParamKind::kStaged) {
        const uint64_t slot = StagingSlot(epoch, p.value, p.alt);
        CUresult r = D().cuMemcpyDtoDAsync(slot, storage[i], p.size, stream);
        if (r != CUDA_SUCCESS) return Fail("staging a symmetric argument: " + ErrorText(r));
        storage[i] = slot;
      }
    } else if (p.kind == ParamKind::kResult) {
      auto buffer = rets.get<ffi::AnyBuffer>(p.index);
      if (!buffer.has_value()) return buffer.error();
      storage[i] = reinterpret_cast<uint64_t>((*buffer)->untyped_data());
    } else {
      storage[i] = p.value;
    }
    pointers[i] = &storage[i];
  }
  for (size_t i = plan->params.size(); i < storage.size(); ++i) pointers[i] = &storage[i];

  CUresult r = D().cuStreamWriteValue32(stream, plan->epoch_addr, epoch, 0);
  if (r != CUDA_SUCCESS) return Fail("cuStreamWriteValue32: " + ErrorText(r));
  r = D().cuLaunchKernel(plan->function, plan->grid[0], plan->grid[1], plan->grid[2], plan->block,
                         1, 1, plan->shared, stream, pointers.data(), nullptr);
  if (r != CUDA_SUCCESS) return Fail("cuLaunchKernel: " + ErrorText(r));
  plan->epoch = epoch;
  return ffi::Error::Success();
}

}  // namespace

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
    nb::dict targets;
    targets["jtd_triton"] = nb::capsule(reinterpret_cast<void*>(kCudaLaunch));
    return targets;
  });
  m.def(
      "set_planner",
      [](nb::object planner) {
        if (g_planner == nullptr) g_planner = new nb::object();
        *g_planner = std::move(planner);
      },
      "planner"_a, "Sets the Python planner of first calls (runtime/cuda_dispatch.plan).");
  m.def(
      "set_plan",
      [](int64_t call_id, int device, uintptr_t function, std::vector<unsigned> grid,
         unsigned block, unsigned shared,
         std::vector<std::tuple<int, int64_t, uint64_t, uint64_t, int64_t>> params,
         uint64_t epoch_addr) {
        auto plan = std::make_unique<Plan>();
        plan->function = reinterpret_cast<CUfunction>(function);
        for (int i = 0; i < 3; ++i) plan->grid[i] = i < static_cast<int>(grid.size()) ? grid[i] : 1;
        plan->block = block;
        plan->shared = shared;
        for (const auto& [kind, index, value, alt, size] : params) {
          plan->params.push_back({static_cast<ParamKind>(kind), index, value, alt, size});
        }
        plan->epoch_addr = epoch_addr;
        std::lock_guard<std::mutex> lock(g_plans_mu);
        g_plans[{call_id, device}] = std::move(plan);
      },
      "call_id"_a, "device"_a, "function"_a, "grid"_a, "block"_a, "shared"_a, "params"_a,
      "epoch_addr"_a);
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
