// nanobind module `jax_triton_dist._cuda`: the XLA FFI handler that launches compiled
// distributed Triton kernels on NVIDIA GPUs, and the few driver calls the Python
// runtime needs to prepare a launch (module loading, device memory).
//
// libcuda is loaded at run time (dlopen), so the module imports on machines without a
// GPU; every entry point then fails with a clear message.
//
// Per call the handler does no allocation and no synchronisation: it writes the call's
// epoch into the rank context with a stream memory operation and launches the kernel on
// XLA's stream. The first call of a (call site, device) asks the Python planner
// (jax_triton_dist/runtime/cuda_dispatch.py) for a launch plan.
#include <cuda.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
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
using cuda_driver::DeviceScope;
using cuda_driver::ErrorText;

const cuda_driver::Table& D() { return cuda_driver::Driver(); }

// ---------------------------------------------------------------------------
// Launch plans
// ---------------------------------------------------------------------------

// One kernel parameter: a buffer of the call (operand / result), a fixed value, or an
// operand staged into one of two symmetric slots (by epoch parity) before the launch.
enum class ParamKind : int { kOperand = 0, kResult = 1, kValue = 2, kStaged = 3 };

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
      nb::object failure = (*g_planner)(
          call_id, device, reinterpret_cast<uintptr_t>(coords->untyped_data()));
      if (!failure.is_none()) return Fail(nb::cast<std::string>(failure));
    } catch (const std::exception& e) {
      return Fail(e.what());
    }
    plan = FindPlan(call_id, device);
    if (plan == nullptr) return Fail("the planner registered no plan");
  }

  std::lock_guard<std::mutex> lock(plan->mu);
  const uint32_t epoch = plan->epoch + 1;
  std::vector<uint64_t> storage(plan->params.size() + 2, 0);
  std::vector<void*> pointers(plan->params.size() + 2);
  for (size_t i = 0; i < plan->params.size(); ++i) {
    const Param& p = plan->params[i];
    if (p.kind == ParamKind::kOperand || p.kind == ParamKind::kStaged) {
      auto buffer = args.get<ffi::AnyBuffer>(p.index);
      if (!buffer.has_value()) return buffer.error();
      storage[i] = reinterpret_cast<uint64_t>(buffer->untyped_data());
      if (p.kind == ParamKind::kStaged) {
        const uint64_t slot = epoch % 2 ? p.alt : p.value;
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
  // Triton's trailing global and profile scratch pointers (unused: size 0).
  pointers[plan->params.size()] = &storage[plan->params.size()];
  pointers[plan->params.size() + 1] = &storage[plan->params.size() + 1];

  CUresult r = D().cuStreamWriteValue32(stream, plan->epoch_addr, epoch, 0);
  if (r != CUDA_SUCCESS) return Fail("cuStreamWriteValue32: " + ErrorText(r));
  r = D().cuLaunchKernel(plan->function, plan->grid[0], plan->grid[1], plan->grid[2],
                         plan->block, 1, 1, plan->shared, stream, pointers.data(), nullptr);
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
  m.def("available", &jtd::cuda_driver::Available);
  m.def("unavailable_reason", &jtd::cuda_driver::UnavailableReason);
  m.def("set_planner", [](nb::object planner) {
    if (g_planner == nullptr) g_planner = new nb::object();
    *g_planner = std::move(planner);
  });
  m.def("device_count", [] {
    int n = 0;
    Check(D().cuDeviceGetCount(&n), "cuDeviceGetCount");
    return n;
  });
  m.def(
      "load_function",
      [](int device, nb::bytes cubin, const std::string& name, int shared) {
        DeviceScope scope(device);
        CUmodule module;
        Check(D().cuModuleLoadData(&module, cubin.c_str()), "cuModuleLoadData");
        CUfunction function;
        Check(D().cuModuleGetFunction(&function, module, name.c_str()), "cuModuleGetFunction");
        if (shared > 48 * 1024) {
          Check(D().cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       shared),
                "cuFuncSetAttribute");
        }
        return std::make_pair(reinterpret_cast<uintptr_t>(module),
                              reinterpret_cast<uintptr_t>(function));
      },
      "device"_a, "cubin"_a, "name"_a, "shared"_a);
  m.def(
      "module_global",
      [](int device, uintptr_t module, const std::string& name) {
        DeviceScope scope(device);
        CUdeviceptr addr;
        size_t size;
        Check(D().cuModuleGetGlobal(&addr, &size, reinterpret_cast<CUmodule>(module),
                                    name.c_str()),
              "cuModuleGetGlobal");
        return std::make_pair(static_cast<uint64_t>(addr), size);
      },
      "device"_a, "module"_a, "name"_a);
  m.def(
      "alloc",
      [](int device, size_t nbytes) {
        DeviceScope scope(device);
        CUdeviceptr addr;
        Check(D().cuMemAlloc(&addr, nbytes), "cuMemAlloc");
        Check(D().cuMemsetD8(addr, 0, nbytes), "cuMemsetD8");
        return static_cast<uint64_t>(addr);
      },
      "device"_a, "nbytes"_a);
  m.def(
      "write",
      [](int device, uint64_t addr, nb::bytes data) {
        DeviceScope scope(device);
        Check(D().cuMemcpyHtoD(addr, data.c_str(), data.size()), "cuMemcpyHtoD");
      },
      "device"_a, "addr"_a, "data"_a);
  m.def(
      "read",
      [](int device, uint64_t addr, size_t nbytes) {
        DeviceScope scope(device);
        std::string out(nbytes, '\0');
        Check(D().cuMemcpyDtoH(out.data(), addr, nbytes), "cuMemcpyDtoH");
        return nb::bytes(out.data(), out.size());
      },
      "device"_a, "addr"_a, "nbytes"_a);
  // Direct launches, for running several ranks on one GPU (jax_triton_dist/one_gpu.py).
  m.def(
      "stream_create",
      [](int device) {
        DeviceScope scope(device);
        CUstream stream;
        Check(D().cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        return reinterpret_cast<uintptr_t>(stream);
      },
      "device"_a);
  m.def(
      "stream_synchronize",
      [](int device, uintptr_t stream) {
        DeviceScope scope(device);
        nb::gil_scoped_release release;
        Check(D().cuStreamSynchronize(reinterpret_cast<CUstream>(stream)),
              "cuStreamSynchronize");
      },
      "device"_a, "stream"_a);
  m.def(
      "free",
      [](int device, uint64_t addr) {
        DeviceScope scope(device);
        Check(D().cuMemFree(addr), "cuMemFree");
      },
      "device"_a, "addr"_a);
  m.def(
      "launch",
      [](int device, uintptr_t function, std::vector<unsigned> grid, unsigned block,
         unsigned shared, std::vector<uint64_t> values, uintptr_t stream, int repeat) {
        DeviceScope scope(device);
        // Each kernel parameter is passed from 8 bytes of storage (little-endian), then
        // Triton's two scratch pointers.
        std::vector<uint64_t> storage(values);
        storage.push_back(0);
        storage.push_back(0);
        std::vector<void*> pointers;
        for (auto& v : storage) pointers.push_back(&v);
        unsigned g[3] = {1, 1, 1};
        for (size_t i = 0; i < grid.size() && i < 3; ++i) g[i] = grid[i];
        for (int i = 0; i < repeat; ++i) {  // back to back (launch-overhead benchmark)
          Check(D().cuLaunchKernel(reinterpret_cast<CUfunction>(function), g[0], g[1], g[2],
                                   block, 1, 1, shared, reinterpret_cast<CUstream>(stream),
                                   pointers.data(), nullptr),
                "cuLaunchKernel");
        }
      },
      "device"_a, "function"_a, "grid"_a, "block"_a, "shared"_a, "values"_a, "stream"_a,
      "repeat"_a = 1);
  m.def(
      "clear_plans",
      [] {
        std::lock_guard<std::mutex> lock(g_plans_mu);
        std::vector<int> devices;
        for (auto& [key, plan] : g_plans) {
          if (devices.empty() || devices.back() != key.second) devices.push_back(key.second);
          g_retired.push_back(std::move(plan));
        }
        g_plans.clear();
        std::sort(devices.begin(), devices.end());
        devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
        return devices;
      },
      "Forgets every launch plan; returns the devices that had one.");
  m.def(
      "device_synchronize",
      [](int device) {
        DeviceScope scope(device);
        nb::gil_scoped_release release;
        Check(D().cuCtxSynchronize(), "cuCtxSynchronize");
      },
      "device"_a);
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
}
