#include "cuda_ops.h"

#include <map>
#include <mutex>

#include "cuda_driver.h"

namespace jtd::shmem::cuda_ops {
namespace {

using cuda_driver::Check;
using cuda_driver::DeviceScope;

const cuda_driver::Table& D() { return cuda_driver::Driver(); }

// One thread: a release store (op 0) or a release atomic add (op 1) of a 32- or 64-bit
// word, at system scope so that every GPU and the host observe it after the data.
constexpr char kSignalPtx[] = R"(
.version 7.0
.target sm_70
.address_size 64
.visible .entry jtd_signal_op(.param .u64 addr, .param .u64 value, .param .u32 op,
                              .param .u32 itemsize)
{
  .reg .pred %p<3>;
  .reg .b32 %r<4>;
  .reg .b64 %rd<3>;
  ld.param.u64 %rd1, [addr];
  ld.param.u64 %rd2, [value];
  ld.param.u32 %r1, [op];
  ld.param.u32 %r2, [itemsize];
  setp.eq.u32 %p1, %r2, 8;
  setp.eq.u32 %p2, %r1, 0;
  @%p1 bra WIDE;
  cvt.u32.u64 %r3, %rd2;
  @%p2 bra SET32;
  red.release.sys.global.add.u32 [%rd1], %r3;
  ret;
SET32:
  st.release.sys.global.u32 [%rd1], %r3;
  ret;
WIDE:
  @%p2 bra SET64;
  red.release.sys.global.add.u64 [%rd1], %rd2;
  ret;
SET64:
  st.release.sys.global.u64 [%rd1], %rd2;
  ret;
}
)";

// The signal kernel, loaded once per device.
CUfunction SignalFunction(int device) {
  static std::mutex mu;
  static std::map<int, CUfunction> functions;
  std::lock_guard<std::mutex> lock(mu);
  auto it = functions.find(device);
  if (it != functions.end()) return it->second;
  CUmodule module;
  Check(D().cuModuleLoadData(&module, kSignalPtx), "cuModuleLoadData (signal kernel)");
  CUfunction fn;
  Check(D().cuModuleGetFunction(&fn, module, "jtd_signal_op"), "cuModuleGetFunction");
  functions[device] = fn;
  return fn;
}

}  // namespace

void Copy(int device, CUstream stream, uintptr_t dst, uintptr_t src, size_t nbytes, bool blocking) {
  if (nbytes == 0) return;
  DeviceScope scope(device);
  Check(D().cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync");
  if (blocking) Check(D().cuStreamSynchronize(stream), "cuStreamSynchronize");
}

void Memset(int device, CUstream stream, uintptr_t addr, int byte, size_t nbytes) {
  if (nbytes == 0) return;
  DeviceScope scope(device);
  Check(D().cuMemsetD8Async(addr, static_cast<unsigned char>(byte), nbytes, stream),
        "cuMemsetD8Async");
  Check(D().cuStreamSynchronize(stream), "cuStreamSynchronize");
}

void Signal(int device, CUstream stream, uintptr_t addr, uint64_t value, SignalOp op,
            int itemsize) {
  CheckItemsize(itemsize);
  DeviceScope scope(device);
  CUfunction fn = SignalFunction(device);
  uint64_t a = addr;
  uint32_t o = static_cast<uint32_t>(op), s = static_cast<uint32_t>(itemsize);
  void* params[] = {&a, &value, &o, &s};
  Check(D().cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, params, nullptr),
        "cuLaunchKernel (signal)");
  Check(D().cuStreamSynchronize(stream), "cuStreamSynchronize");
}

uint64_t Load(int device, CUstream stream, uintptr_t addr, int itemsize) {
  CheckItemsize(itemsize);
  DeviceScope scope(device);
  uint64_t value = 0;
  Check(D().cuMemcpyAsync(reinterpret_cast<uintptr_t>(&value), addr, itemsize, stream),
        "cuMemcpyAsync");
  Check(D().cuStreamSynchronize(stream), "cuStreamSynchronize");
  return value;
}

void Quiet(int device, CUstream stream) {
  DeviceScope scope(device);
  Check(D().cuStreamSynchronize(stream), "cuStreamSynchronize");
}

}  // namespace jtd::shmem::cuda_ops
