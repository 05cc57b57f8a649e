#include "nvshmem_backend.h"

#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <string>

// Types and initialisers only: every NVSHMEM function is resolved from the library at run
// time, so the headers must come from the same NVSHMEM release as the library.
#include <bootstrap_device_host/nvshmem_uniqueid.h>
#include <device_host/nvshmem_types.h>
#include <non_abi/nvshmem_version.h>

#include "cuda_driver.h"
#include "cuda_ops.h"

namespace jtd::shmem {
namespace {

using cuda_driver::Check;
using cuda_driver::DeviceScope;

constexpr unsigned kInitWithUniqueId = 1u << 3;  // NVSHMEMX_INIT_WITH_UNIQUEID
constexpr int kStatusNotInitialized = 0;         // NVSHMEM_STATUS_NOT_INITIALIZED

struct Nvshmem {
  std::string path;
  int (*get_uniqueid)(nvshmemx_uniqueid_t*);
  int (*set_attr_uniqueid_args)(int, int, const nvshmemx_uniqueid_t*, nvshmemx_init_attr_t*);
  int (*hostlib_init_attr)(unsigned, nvshmemx_init_attr_t*);
  void (*hostlib_finalize)();
  int (*init_status)();
  int (*my_pe)();
  int (*n_pes)();
  void* (*malloc)(size_t);
  void (*free)(void*);
  void* (*ptr)(const void*, int);
  void (*info_get_version)(int*, int*);
  int (*cumodule_init)(CUmodule);
};

template <typename T>
void Resolve(void* lib, const std::string& path, T*& fn, const char* name) {
  fn = reinterpret_cast<T*>(dlsym(lib, name));
  if (fn == nullptr) {
    throw ShmemError("shmem.init('nvshmem'): " + path + " has no " + name +
                     " (an NVSHMEM release older than this build's headers, " +
                     std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." +
                     std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + "?)");
  }
}

// The host library, loaded once per process (NVSHMEM allows one instance).
const Nvshmem& Library(const std::string& path) {
  static std::mutex mu;
  static Nvshmem* lib = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (lib != nullptr) {
    if (lib->path != path) {
      throw ShmemError("shmem.init('nvshmem'): NVSHMEM was loaded from " + lib->path +
                       "; a process loads one NVSHMEM library (asked for " + path + ")");
    }
    return *lib;
  }
  // RTLD_GLOBAL: NVSHMEM's bootstrap and transport plugins resolve symbols of the host
  // library; they are found next to it (its RPATH is $ORIGIN).
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    throw ShmemError("shmem.init('nvshmem'): cannot load " + path + ": " +
                     (error ? error : "unknown error") +
                     " (install nvidia-nvshmem-cu13, or set JTD_NVSHMEM_LIB)");
  }
  auto* t = new Nvshmem();
  t->path = path;
  Resolve(handle, path, t->get_uniqueid, "nvshmemx_get_uniqueid");
  Resolve(handle, path, t->set_attr_uniqueid_args, "nvshmemx_set_attr_uniqueid_args");
  Resolve(handle, path, t->hostlib_init_attr, "nvshmemx_hostlib_init_attr");
  Resolve(handle, path, t->hostlib_finalize, "nvshmemx_hostlib_finalize");
  Resolve(handle, path, t->init_status, "nvshmemx_init_status");
  Resolve(handle, path, t->my_pe, "nvshmem_my_pe");
  Resolve(handle, path, t->n_pes, "nvshmem_n_pes");
  Resolve(handle, path, t->malloc, "nvshmem_malloc");
  Resolve(handle, path, t->free, "nvshmem_free");
  Resolve(handle, path, t->ptr, "nvshmem_ptr");
  Resolve(handle, path, t->info_get_version, "nvshmem_info_get_version");
  Resolve(handle, path, t->cumodule_init, "nvshmemx_cumodule_init");
  lib = t;
  return *lib;
}

}  // namespace

std::string NvshmemUniqueId(const std::string& library) {
  const Nvshmem& nv = Library(library);
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (int rc = nv.get_uniqueid(&id); rc != 0) {
    throw ShmemError("shmem.init('nvshmem'): nvshmemx_get_uniqueid failed (error " +
                     std::to_string(rc) + ")");
  }
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

std::string NvshmemVersion(const std::string& library) {
  int major = 0, minor = 0;
  Library(library).info_get_version(&major, &minor);
  return std::to_string(major) + "." + std::to_string(minor);
}

NvshmemBackend::NvshmemBackend(const std::string& library, const std::string& unique_id, int my_pe,
                               int n_pes, int device, size_t heap_size)
    : Backend(n_pes, heap_size), my_pe_(my_pe), device_(device) {
  const Nvshmem& nv = Library(library);
  library_ = &nv;
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t)) {
    throw std::invalid_argument("shmem.init('nvshmem'): a unique id has " +
                                std::to_string(sizeof(nvshmemx_uniqueid_t)) + " bytes, got " +
                                std::to_string(unique_id.size()));
  }
  if (my_pe < 0 || my_pe >= n_pes) {
    throw std::invalid_argument("shmem.init('nvshmem'): PE " + std::to_string(my_pe) +
                                " is out of range for " + std::to_string(n_pes) + " PEs");
  }
  if (nv.init_status() != kStatusNotInitialized) {
    throw ShmemError(
        "shmem.init('nvshmem'): NVSHMEM is already running in this process "
        "(it allows one instance)");
  }
  DeviceScope scope(device);  // NVSHMEM binds to the current context's GPU
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
#ifdef NVSHMEM_INIT_ATTR_V2_IDENTIFIER
  attr.args.cuda_device_id = device;
#endif
  if (int rc = nv.set_attr_uniqueid_args(my_pe, n_pes, &id, &attr); rc != 0) {
    throw ShmemError("shmem.init('nvshmem'): nvshmemx_set_attr_uniqueid_args failed (error " +
                     std::to_string(rc) + ")");
  }
  if (int rc = nv.hostlib_init_attr(kInitWithUniqueId, &attr); rc != 0) {
    throw ShmemError("shmem.init('nvshmem'): PE " + std::to_string(my_pe) + " of " +
                     std::to_string(n_pes) + ": nvshmemx_hostlib_init_attr failed (error " +
                     std::to_string(rc) + "); run with NVSHMEM_DEBUG=INFO for NVSHMEM's reason");
  }
  started_ = true;
  try {
    if (nv.my_pe() != my_pe || nv.n_pes() != n_pes) {
      throw ShmemError("shmem.init('nvshmem'): NVSHMEM started as PE " +
                       std::to_string(nv.my_pe()) + " of " + std::to_string(nv.n_pes()) +
                       ", expected PE " + std::to_string(my_pe) + " of " + std::to_string(n_pes));
    }
    heap_ = nv.malloc(this->heap_size());
    if (heap_ == nullptr) {
      throw ShmemError("shmem.init('nvshmem'): nvshmem_malloc of a " +
                       std::to_string(this->heap_size()) +
                       "-byte heap failed (raise "
                       "NVSHMEM_SYMMETRIC_SIZE above the heap, or lower heap_size)");
    }
    bases_.assign(n_pes, 0);
    for (int pe = 0; pe < n_pes; ++pe) {
      bases_[pe] = reinterpret_cast<uintptr_t>(nv.ptr(heap_, pe));  // null: not reachable
    }
    bases_[my_pe] = reinterpret_cast<uintptr_t>(heap_);
    Check(cuda_driver::Driver().cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  } catch (...) {
    Shutdown();
    throw;
  }
}

NvshmemBackend::~NvshmemBackend() { Shutdown(); }

void NvshmemBackend::Shutdown() noexcept {
  if (!started_) return;
  started_ = false;
  const auto& nv = *static_cast<const Nvshmem*>(library_);
  // Collective (nvshmem_free and finalize synchronise the PEs). Skipped once the CUDA
  // driver is gone (process exit): the driver releases a dead process's memory.
  try {
    DeviceScope scope(device_);
    if (stream_ != nullptr) {
      cuda_driver::Driver().cuStreamSynchronize(stream_);
      cuda_driver::Driver().cuStreamDestroy(stream_);
      stream_ = nullptr;
    }
    if (heap_ != nullptr) nv.free(heap_);
    heap_ = nullptr;
    nv.hostlib_finalize();
  } catch (...) {
  }
}

void NvshmemBackend::InitModule(uintptr_t module) {
  const auto& nv = *static_cast<const Nvshmem*>(library_);
  DeviceScope scope(device_);
  if (int rc = nv.cumodule_init(reinterpret_cast<CUmodule>(module)); rc != 0) {
    throw ShmemError("nvshmemx_cumodule_init failed (error " + std::to_string(rc) +
                     ") on a kernel module of PE " + std::to_string(my_pe_));
  }
}

void NvshmemBackend::CheckLocal(int pe, const char* what) const {
  if (pe != my_pe_) {
    throw ShmemError(std::string("nvshmem backend: ") + what + " issued as PE " +
                     std::to_string(pe) + ", but this process is PE " + std::to_string(my_pe_));
  }
}

void NvshmemBackend::copy(int pe, uintptr_t dst, uintptr_t src, size_t nbytes, bool blocking) {
  CheckLocal(pe, "copy");
  cuda_ops::Copy(device_, stream_, dst, src, nbytes, blocking);
}

void NvshmemBackend::memset(int pe, uintptr_t addr, int byte, size_t nbytes) {
  CheckLocal(pe, "memset");
  cuda_ops::Memset(device_, stream_, addr, byte, nbytes);
}

void NvshmemBackend::signal_op(int pe, uintptr_t addr, uint64_t value, SignalOp op, int itemsize) {
  CheckLocal(pe, "signal");
  cuda_ops::Signal(device_, stream_, addr, value, op, itemsize);
}

uint64_t NvshmemBackend::load(int pe, uintptr_t addr, int itemsize) {
  CheckLocal(pe, "load");
  return cuda_ops::Load(device_, stream_, addr, itemsize);
}

void NvshmemBackend::quiet(int pe) {
  CheckLocal(pe, "quiet");
  cuda_ops::Quiet(device_, stream_);
}

}  // namespace jtd::shmem
