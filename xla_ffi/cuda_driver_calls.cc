// nanobind module `jax_triton_dist._cuda_driver`: the CUDA driver calls the Python
// runtime makes to prepare a launch plan (module loading, module globals, device memory),
// and the direct launches of jax_triton_dist.one_gpu and the benchmarks. Thin wrappers:
// each call checks its CUresult and raises RuntimeError with the driver's message.
//
// libcuda is loaded at run time (dlopen), so the module imports on machines without a
// GPU; `available()` says whether a driver and a GPU were found.
#include <cuda.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_driver.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using jtd::cuda_driver::Check;
using jtd::cuda_driver::DeviceScope;
using jtd::cuda_driver::kTritonScratchParams;

const jtd::cuda_driver::Table& D() { return jtd::cuda_driver::Driver(); }

}  // namespace

NB_MODULE(_cuda_driver, m) {
  m.doc() = "CUDA driver calls of jax_triton_dist (private; use runtime/cuda_driver.py)";

  m.def("available", &jtd::cuda_driver::Available);
  m.def("unavailable_reason", &jtd::cuda_driver::UnavailableReason);
  m.def("device_count", [] {
    int n = 0;
    Check(D().cuDeviceGetCount(&n), "cuDeviceGetCount");
    return n;
  });
  m.def(
      "load_function",
      [](int device, nb::bytes cubin, const std::string& name, int shared) {
        DeviceScope scope(device);
        if (shared > 48 * 1024) {  // more than the default: the device's opt-in limit holds
          CUdevice dev;
          Check(D().cuDeviceGet(&dev, device), "cuDeviceGet");
          int limit = 0;
          Check(D().cuDeviceGetAttribute(
                    &limit, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev),
                "cuDeviceGetAttribute");
          if (shared > limit) {
            throw std::runtime_error("kernel " + name + " needs " + std::to_string(shared) +
                                     " bytes of shared memory per program; GPU " +
                                     std::to_string(device) + " allows " + std::to_string(limit) +
                                     " (use smaller blocks or fewer num_stages)");
          }
        }
        CUmodule module;
        Check(D().cuModuleLoadData(&module, cubin.c_str()), "cuModuleLoadData");
        // A failure past this point unloads the module before raising.
        auto checked = [&](CUresult result, const char* what) {
          if (result != CUDA_SUCCESS) D().cuModuleUnload(module);
          Check(result, what);
        };
        CUfunction function;
        checked(D().cuModuleGetFunction(&function, module, name.c_str()), "cuModuleGetFunction");
        if (shared > 48 * 1024) {
          checked(D().cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         shared),
                  "cuFuncSetAttribute");
        }
        return std::make_pair(reinterpret_cast<uintptr_t>(module),
                              reinterpret_cast<uintptr_t>(function));
      },
      "device"_a, "cubin"_a, "name"_a, "shared"_a);
  m.def(
      "resident_programs",
      [](int device, uintptr_t function, int block, int shared) {
        // Programs of `function` the device holds at once: multiprocessors times the
        // blocks one multiprocessor takes (its occupancy at `block` threads, `shared` bytes).
        DeviceScope scope(device);
        CUdevice dev;
        Check(D().cuDeviceGet(&dev, device), "cuDeviceGet");
        int sms = 0, per_sm = 0;
        Check(D().cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
              "cuDeviceGetAttribute");
        Check(D().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                  &per_sm, reinterpret_cast<CUfunction>(function), block, shared),
              "cuOccupancyMaxActiveBlocksPerMultiprocessor");
        return sms * per_sm;
      },
      "device"_a, "function"_a, "block"_a, "shared"_a);
  m.def(
      "module_global",
      [](int device, uintptr_t module, const std::string& name) {
        DeviceScope scope(device);
        CUdeviceptr addr;
        size_t size;
        Check(D().cuModuleGetGlobal(&addr, &size, reinterpret_cast<CUmodule>(module), name.c_str()),
              "cuModuleGetGlobal");
        return std::make_pair(static_cast<uint64_t>(addr), size);
      },
      "device"_a, "module"_a, "name"_a);
  m.def(
      "module_unload",
      [](int device, uintptr_t module) {
        DeviceScope scope(device);
        Check(D().cuModuleUnload(reinterpret_cast<CUmodule>(module)), "cuModuleUnload");
      },
      "device"_a, "module"_a);
  m.def(
      "host_alloc_mapped",
      [](int device, size_t nbytes) {
        // Pinned host memory the device reads and writes (zeroed): (host, device) address.
        DeviceScope scope(device);
        void* host = nullptr;
        Check(
            D().cuMemHostAlloc(&host, nbytes, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE),
            "cuMemHostAlloc");
        std::memset(host, 0, nbytes);
        CUdeviceptr dev;
        Check(D().cuMemHostGetDevicePointer(&dev, host, 0), "cuMemHostGetDevicePointer");
        return std::make_pair(reinterpret_cast<uintptr_t>(host), static_cast<uint64_t>(dev));
      },
      "device"_a, "nbytes"_a);
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
      "free",
      [](int device, uint64_t addr) {
        DeviceScope scope(device);
        Check(D().cuMemFree(addr), "cuMemFree");
      },
      "device"_a, "addr"_a);
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
      "stream_destroy",
      [](int device, uintptr_t stream) {
        DeviceScope scope(device);
        // Work queued on it still completes; the handle is released when it has.
        Check(D().cuStreamDestroy(reinterpret_cast<CUstream>(stream)), "cuStreamDestroy");
      },
      "device"_a, "stream"_a);
  m.def(
      "stream_synchronize",
      [](int device, uintptr_t stream) {
        DeviceScope scope(device);
        nb::gil_scoped_release release;
        Check(D().cuStreamSynchronize(reinterpret_cast<CUstream>(stream)), "cuStreamSynchronize");
      },
      "device"_a, "stream"_a);
  m.def(
      "stream_query",
      [](int device, uintptr_t stream) {
        // Whether all work queued on the stream has completed (never blocks).
        DeviceScope scope(device);
        CUresult result = D().cuStreamQuery(reinterpret_cast<CUstream>(stream));
        if (result == CUDA_ERROR_NOT_READY) return false;
        Check(result, "cuStreamQuery");
        return true;
      },
      "device"_a, "stream"_a);
  m.def(
      "event_create",
      [](int device) {
        DeviceScope scope(device);
        CUevent event;
        Check(D().cuEventCreate(&event, CU_EVENT_DEFAULT), "cuEventCreate");
        return reinterpret_cast<uintptr_t>(event);
      },
      "device"_a);
  m.def(
      "event_record",
      [](int device, uintptr_t event, uintptr_t stream) {
        DeviceScope scope(device);
        Check(
            D().cuEventRecord(reinterpret_cast<CUevent>(event), reinterpret_cast<CUstream>(stream)),
            "cuEventRecord");
      },
      "device"_a, "event"_a, "stream"_a);
  m.def(
      "event_elapsed_ms",
      [](int device, uintptr_t start, uintptr_t end) {
        // Waits for `end`; milliseconds from `start` to `end` (events of one device).
        DeviceScope scope(device);
        float ms = 0;
        {
          nb::gil_scoped_release release;
          Check(D().cuEventSynchronize(reinterpret_cast<CUevent>(end)), "cuEventSynchronize");
        }
        Check(D().cuEventElapsedTime(&ms, reinterpret_cast<CUevent>(start),
                                     reinterpret_cast<CUevent>(end)),
              "cuEventElapsedTime");
        return ms;
      },
      "device"_a, "start"_a, "end"_a);
  m.def(
      "event_destroy",
      [](int device, uintptr_t event) {
        DeviceScope scope(device);
        Check(D().cuEventDestroy(reinterpret_cast<CUevent>(event)), "cuEventDestroy");
      },
      "device"_a, "event"_a);
  m.def(
      "stream_wait_value",
      [](int device, uintptr_t stream, uint64_t addr, uint32_t value) {
        DeviceScope scope(device);
        Check(D().cuStreamWaitValue32(reinterpret_cast<CUstream>(stream), addr, value,
                                      CU_STREAM_WAIT_VALUE_GEQ),
              "cuStreamWaitValue32");
      },
      "device"_a, "stream"_a, "addr"_a, "value"_a);
  m.def(
      "copy_async",
      [](int device, uint64_t dst, uint64_t src, size_t nbytes, uintptr_t stream) {
        DeviceScope scope(device);
        Check(D().cuMemcpyDtoDAsync(dst, src, nbytes, reinterpret_cast<CUstream>(stream)),
              "cuMemcpyDtoDAsync");
      },
      "device"_a, "dst"_a, "src"_a, "nbytes"_a, "stream"_a);
  m.def(
      "device_synchronize",
      [](int device) {
        DeviceScope scope(device);
        nb::gil_scoped_release release;
        Check(D().cuCtxSynchronize(), "cuCtxSynchronize");
      },
      "device"_a);
  m.def(
      "launch",
      [](int device, uintptr_t function, std::vector<unsigned> grid, unsigned block,
         unsigned shared, std::vector<uint64_t> values, uintptr_t stream, int repeat,
         uint64_t scratch) {
        DeviceScope scope(device);
        // Each kernel parameter is passed from 8 bytes of storage (little-endian), then
        // Triton's scratch pointers (global: `scratch`; profile: none).
        std::vector<uint64_t> storage(values);
        storage.resize(values.size() + kTritonScratchParams, 0);
        storage[values.size()] = scratch;
        std::vector<void*> pointers;
        for (auto& v : storage) pointers.push_back(&v);
        unsigned g[3] = {1, 1, 1};
        for (size_t i = 0; i < grid.size() && i < 3; ++i) g[i] = grid[i];
        for (int i = 0; i < repeat; ++i) {  // back to back (launch-overhead benchmark)
          Check(D().cuLaunchKernel(reinterpret_cast<CUfunction>(function), g[0], g[1], g[2], block,
                                   1, 1, shared, reinterpret_cast<CUstream>(stream),
                                   pointers.data(), nullptr),
                "cuLaunchKernel");
        }
      },
      "device"_a, "function"_a, "grid"_a, "block"_a, "shared"_a, "values"_a, "stream"_a,
      "repeat"_a = 1, "scratch"_a = 0);
}
