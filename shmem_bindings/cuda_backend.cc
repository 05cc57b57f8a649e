#include "cuda_backend.h"

#include <algorithm>
#include <set>
#include <string>

#include "cuda_driver.h"
#include "cuda_ops.h"

namespace jtd::shmem {
namespace {

using cuda_driver::Check;
using cuda_driver::DeviceScope;
using cuda_driver::ErrorText;

const cuda_driver::Table& D() { return cuda_driver::Driver(); }

// Heaps grow in steps of at least this many bytes (fewer, larger mappings).
constexpr size_t kGrowthStep = size_t{32} << 20;

CUmemAllocationProp PinnedOn(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

size_t Granularity(const std::vector<int>& devices) {
  if (devices.empty()) throw std::invalid_argument("shmem.init: the cuda backend needs >= 1 PE");
  size_t granularity = 1;
  for (int device : std::set<int>(devices.begin(), devices.end())) {
    CUdevice dev;
    Check(D().cuDeviceGet(&dev, device), "cuDeviceGet");
    int vmm = 0;
    Check(D().cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                   dev),
          "cuDeviceGetAttribute");
    if (!vmm) {
      throw ShmemError("shmem.init: GPU " + std::to_string(device) +
                       " does not support CUDA virtual memory management");
    }
    CUmemAllocationProp prop = PinnedOn(device);
    size_t g = 0;
    Check(D().cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
          "cuMemGetAllocationGranularity");
    granularity = std::max(granularity, g);
  }
  return granularity;
}

size_t RoundUp(size_t value, size_t step) { return (value + step - 1) / step * step; }

}  // namespace

CudaBackend::CudaBackend(const std::vector<int>& devices, size_t heap_size)
    : Backend(static_cast<int>(devices.size()), RoundUp(heap_size, Granularity(devices))),
      devices_(devices),
      granularity_(Granularity(devices)) {
  int count = 0;
  Check(D().cuDeviceGetCount(&count), "cuDeviceGetCount");
  std::set<int> distinct(devices.begin(), devices.end());
  for (int device : distinct) {
    if (device < 0 || device >= count) {
      throw ShmemError("shmem.init: GPU " + std::to_string(device) +
                       " does not exist (this "
                       "process sees " +
                       std::to_string(count) + " GPUs)");
    }
    for (int peer : distinct) {
      if (peer == device) continue;
      CUdevice a, b;
      Check(D().cuDeviceGet(&a, device), "cuDeviceGet");
      Check(D().cuDeviceGet(&b, peer), "cuDeviceGet");
      int can = 0;
      Check(D().cuDeviceCanAccessPeer(&can, a, b), "cuDeviceCanAccessPeer");
      if (!can) {
        throw ShmemError("shmem.init: GPU " + std::to_string(device) + " cannot access GPU " +
                         std::to_string(peer) +
                         " (no peer access): the cuda backend needs "
                         "every pair of its GPUs connected (NVLink or PCIe P2P)");
      }
    }
  }
  try {
    for (int pe = 0; pe < n_pes(); ++pe) {
      CUdeviceptr base = 0;
      CUresult r = D().cuMemAddressReserve(&base, this->heap_size(), granularity_, 0, 0);
      if (r != CUDA_SUCCESS) {
        throw ShmemError("shmem.init: cannot reserve " + std::to_string(this->heap_size()) +
                         " bytes of GPU address space for PE " + std::to_string(pe) + ": " +
                         ErrorText(r) + " (lower heap_size / JTD_SHMEM_HEAP_SIZE)");
      }
      bases_.push_back(base);
      DeviceScope scope(devices_[pe]);
      CUstream stream;
      Check(D().cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
      streams_.push_back(stream);
    }
  } catch (...) {
    Unmap();
    throw;
  }
}

CudaBackend::~CudaBackend() { Unmap(); }

void CudaBackend::Unmap() noexcept {
  // Runs from the destructor too, possibly at process exit after the driver has shut
  // down: every error is ignored (the driver frees everything of a dead process).
  for (size_t pe = 0; pe < streams_.size(); ++pe) {
    try {
      DeviceScope scope(devices_[pe]);
      D().cuStreamSynchronize(streams_[pe]);
      D().cuStreamDestroy(streams_[pe]);
    } catch (...) {
    }
  }
  streams_.clear();
  if (cuda_driver::Available()) {
    for (uintptr_t base : bases_) {
      for (const auto& [offset, size] : chunks_) D().cuMemUnmap(base + offset, size);
      D().cuMemAddressFree(base, heap_size());
    }
  }
  bases_.clear();
  chunks_.clear();
  mapped_ = 0;
}

void CudaBackend::reserve(size_t end) {
  if (end <= mapped_) return;
  const size_t target =
      std::min(heap_size(), RoundUp(std::max(end, mapped_ + kGrowthStep), granularity_));
  const size_t size = target - mapped_;
  std::vector<CUmemAccessDesc> access;
  for (int device : std::set<int>(devices_.begin(), devices_.end())) {
    CUmemAccessDesc desc = {};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    access.push_back(desc);
  }
  size_t done = 0;  // PEs whose heap has the new chunk mapped
  auto fail = [&](const char* what, CUresult r) {
    for (size_t pe = 0; pe < done; ++pe) D().cuMemUnmap(bases_[pe] + mapped_, size);
    throw ShmemError(std::string("symmetric heap: cannot map ") + std::to_string(size) +
                     " more bytes on GPU " + std::to_string(devices_[done]) + " (" + what + ": " +
                     ErrorText(r) +
                     "); GPU memory is short: lower "
                     "XLA_PYTHON_CLIENT_MEM_FRACTION or set XLA_PYTHON_CLIENT_PREALLOCATE=false");
  };
  for (; done < bases_.size(); ++done) {
    CUmemAllocationProp prop = PinnedOn(devices_[done]);
    CUmemGenericAllocationHandle handle;
    CUresult r = D().cuMemCreate(&handle, size, &prop, 0);
    if (r != CUDA_SUCCESS) fail("cuMemCreate", r);
    r = D().cuMemMap(bases_[done] + mapped_, size, 0, handle, 0);
    D().cuMemRelease(handle);  // the mapping keeps the memory alive
    if (r != CUDA_SUCCESS) fail("cuMemMap", r);
    r = D().cuMemSetAccess(bases_[done] + mapped_, size, access.data(), access.size());
    if (r != CUDA_SUCCESS) {
      ++done;
      fail("cuMemSetAccess", r);
    }
  }
  chunks_.emplace_back(mapped_, size);
  mapped_ = target;
}

void CudaBackend::copy(int pe, uintptr_t dst, uintptr_t src, size_t nbytes, bool blocking) {
  cuda_ops::Copy(devices_.at(pe), streams_.at(pe), dst, src, nbytes, blocking);
}

void CudaBackend::memset(int pe, uintptr_t addr, int byte, size_t nbytes) {
  cuda_ops::Memset(devices_.at(pe), streams_.at(pe), addr, byte, nbytes);
}

void CudaBackend::signal_op(int pe, uintptr_t addr, uint64_t value, SignalOp op, int itemsize) {
  cuda_ops::Signal(devices_.at(pe), streams_.at(pe), addr, value, op, itemsize);
}

uint64_t CudaBackend::load(int pe, uintptr_t addr, int itemsize) {
  return cuda_ops::Load(devices_.at(pe), streams_.at(pe), addr, itemsize);
}

void CudaBackend::quiet(int pe) { cuda_ops::Quiet(devices_.at(pe), streams_.at(pe)); }

}  // namespace jtd::shmem
