// The CUDA driver API, loaded at run time (dlopen of libcuda.so.1), shared by the CUDA
// SHMEM backend (shmem_bindings/cuda_backend.cc), the CUDA FFI launcher
// (xla_ffi/cuda_launch.cc) and the driver calls module (xla_ffi/cuda_driver_calls.cc).
// Each extension module holds its own copy of the table.
//
// Nothing here needs a GPU at import time: `Driver()` loads the library on first use
// and throws a clear error on machines without an NVIDIA driver.
#ifndef JAX_TRITON_DIST_SHMEM_CUDA_DRIVER_H_
#define JAX_TRITON_DIST_SHMEM_CUDA_DRIVER_H_

#include <cuda.h>
#include <dlfcn.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

namespace jtd::cuda_driver {

// Triton kernels take two trailing pointers after their parameters (global and profile
// scratch); launches pass null for both (size 0).
constexpr size_t kTritonScratchParams = 2;

struct Table {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*cuDeviceCanAccessPeer)(int*, CUdevice, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuCtxEnablePeerAccess)(CUcontext, unsigned);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuModuleGetGlobal)(CUdeviceptr*, size_t*, CUmodule, const char*);
  CUresult (*cuFuncSetAttribute)(CUfunction, CUfunction_attribute, int);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t);
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t);
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned);
  CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr*, void*, unsigned);
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamQuery)(CUstream);
  CUresult (*cuStreamWriteValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned);
  CUresult (*cuStreamWaitValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void**, void**);
  CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
  // Events (the autotuner's launch timing).
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent);
  CUresult (*cuEventDestroy)(CUevent);
  // Virtual memory management (symmetric heaps).
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*,
                                            CUmemAllocationGranularity_flags);
};

namespace detail {

inline std::string& LoadError() {
  static std::string error;
  return error;
}

template <typename T>
bool Resolve(void* lib, T*& fn, const char* name, const char* alt = nullptr) {
  void* sym = dlsym(lib, name);
  if (sym == nullptr && alt != nullptr) sym = dlsym(lib, alt);
  fn = reinterpret_cast<T*>(sym);
  if (sym == nullptr) LoadError() = std::string("libcuda has no ") + name;
  return sym != nullptr;
}

inline const Table* Load() {
  static const Table* table = []() -> const Table* {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      LoadError() = "libcuda.so.1 not found (no NVIDIA driver on this machine)";
      return nullptr;
    }
    auto* t = new Table();
    bool ok =
        Resolve(lib, t->cuInit, "cuInit") &&
        Resolve(lib, t->cuGetErrorString, "cuGetErrorString") &&
        Resolve(lib, t->cuDeviceGet, "cuDeviceGet") &&
        Resolve(lib, t->cuDeviceGetCount, "cuDeviceGetCount") &&
        Resolve(lib, t->cuDeviceGetAttribute, "cuDeviceGetAttribute") &&
        Resolve(lib, t->cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer") &&
        Resolve(lib, t->cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain") &&
        Resolve(lib, t->cuCtxPushCurrent, "cuCtxPushCurrent_v2", "cuCtxPushCurrent") &&
        Resolve(lib, t->cuCtxPopCurrent, "cuCtxPopCurrent_v2", "cuCtxPopCurrent") &&
        Resolve(lib, t->cuCtxSynchronize, "cuCtxSynchronize") &&
        Resolve(lib, t->cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess") &&
        Resolve(lib, t->cuModuleLoadData, "cuModuleLoadData") &&
        Resolve(lib, t->cuModuleUnload, "cuModuleUnload") &&
        Resolve(lib, t->cuModuleGetFunction, "cuModuleGetFunction") &&
        Resolve(lib, t->cuModuleGetGlobal, "cuModuleGetGlobal_v2", "cuModuleGetGlobal") &&
        Resolve(lib, t->cuFuncSetAttribute, "cuFuncSetAttribute") &&
        Resolve(lib, t->cuMemAlloc, "cuMemAlloc_v2", "cuMemAlloc") &&
        Resolve(lib, t->cuMemFree, "cuMemFree_v2", "cuMemFree") &&
        Resolve(lib, t->cuMemcpyHtoD, "cuMemcpyHtoD_v2", "cuMemcpyHtoD") &&
        Resolve(lib, t->cuMemcpyDtoH, "cuMemcpyDtoH_v2", "cuMemcpyDtoH") &&
        Resolve(lib, t->cuMemsetD8, "cuMemsetD8_v2", "cuMemsetD8") &&
        Resolve(lib, t->cuMemHostAlloc, "cuMemHostAlloc") &&
        Resolve(lib, t->cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2",
                "cuMemHostGetDevicePointer") &&
        Resolve(lib, t->cuMemcpyAsync, "cuMemcpyAsync") &&
        Resolve(lib, t->cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync") &&
        Resolve(lib, t->cuMemsetD8Async, "cuMemsetD8Async") &&
        Resolve(lib, t->cuStreamCreate, "cuStreamCreate") &&
        Resolve(lib, t->cuStreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy") &&
        Resolve(lib, t->cuStreamSynchronize, "cuStreamSynchronize") &&
        Resolve(lib, t->cuStreamQuery, "cuStreamQuery") &&
        Resolve(lib, t->cuStreamWriteValue32, "cuStreamWriteValue32_v2", "cuStreamWriteValue32") &&
        Resolve(lib, t->cuStreamWaitValue32, "cuStreamWaitValue32_v2", "cuStreamWaitValue32") &&
        Resolve(lib, t->cuLaunchKernel, "cuLaunchKernel") &&
        Resolve(lib, t->cuOccupancyMaxActiveBlocksPerMultiprocessor,
                "cuOccupancyMaxActiveBlocksPerMultiprocessor") &&
        Resolve(lib, t->cuEventCreate, "cuEventCreate") &&
        Resolve(lib, t->cuEventRecord, "cuEventRecord") &&
        Resolve(lib, t->cuEventSynchronize, "cuEventSynchronize") &&
        Resolve(lib, t->cuEventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime") &&
        Resolve(lib, t->cuEventDestroy, "cuEventDestroy_v2", "cuEventDestroy") &&
        Resolve(lib, t->cuMemAddressReserve, "cuMemAddressReserve") &&
        Resolve(lib, t->cuMemAddressFree, "cuMemAddressFree") &&
        Resolve(lib, t->cuMemCreate, "cuMemCreate") &&
        Resolve(lib, t->cuMemRelease, "cuMemRelease") && Resolve(lib, t->cuMemMap, "cuMemMap") &&
        Resolve(lib, t->cuMemUnmap, "cuMemUnmap") &&
        Resolve(lib, t->cuMemSetAccess, "cuMemSetAccess") &&
        Resolve(lib, t->cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
    if (!ok) return nullptr;
    if (t->cuInit(0) != CUDA_SUCCESS) {
      LoadError() = "cuInit failed (no usable NVIDIA GPU)";
      return nullptr;
    }
    return t;
  }();
  return table;
}

}  // namespace detail

// Whether the driver could be loaded and initialised; `UnavailableReason` says why not.
inline bool Available() { return detail::Load() != nullptr; }
inline std::string UnavailableReason() {
  detail::Load();
  return detail::LoadError();
}

// The driver table; throws std::runtime_error without a usable driver.
inline const Table& Driver() {
  const Table* t = detail::Load();
  if (t == nullptr) throw std::runtime_error("jax_triton_dist CUDA: " + detail::LoadError());
  return *t;
}

inline std::string ErrorText(CUresult r) {
  const char* text = nullptr;
  if (Available()) Driver().cuGetErrorString(r, &text);
  return text ? text : ("CUDA error " + std::to_string(static_cast<int>(r)));
}

inline void Check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) throw std::runtime_error(std::string(what) + ": " + ErrorText(r));
}

// Device `ordinal`'s primary context, retained once per process (the retain is never
// released: JAX holds the same context for the life of the process).
inline CUcontext PrimaryContext(int ordinal) {
  static std::mutex mu;
  static std::map<int, CUcontext> contexts;
  std::lock_guard<std::mutex> lock(mu);
  auto it = contexts.find(ordinal);
  if (it != contexts.end()) return it->second;
  CUdevice dev;
  Check(Driver().cuDeviceGet(&dev, ordinal), "cuDeviceGet");
  CUcontext ctx;
  Check(Driver().cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  contexts.emplace(ordinal, ctx);
  return ctx;
}

// Makes device `ordinal`'s primary context current for the scope.
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) : ctx_(PrimaryContext(ordinal)) {
    Check(Driver().cuCtxPushCurrent(ctx_), "cuCtxPushCurrent");
  }
  ~DeviceScope() {
    CUcontext popped;
    Driver().cuCtxPopCurrent(&popped);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  CUcontext ctx() const { return ctx_; }

 private:
  CUcontext ctx_ = nullptr;
};

}  // namespace jtd::cuda_driver

#endif  // JAX_TRITON_DIST_SHMEM_CUDA_DRIVER_H_
