// nanobind module `jax_triton_dist._ffi`: the XLA FFI handler that runs a
// distributed Triton kernel on a JAX CPU device.
//
// The handler is glue only: it hands the device ordinal, the call site and
// the buffer addresses to a Python dispatcher (jax_triton_dist/runtime/
// cpu_dispatch.py), which runs the kernel in Triton's interpreter. XLA runs
// the per-device programs of a shard_map on one thread per virtual device, so
// the ranks of one call run concurrently and may wait on each other.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace jtd::xla_ffi {
namespace {

// The Python dispatcher. Deliberately leaked: it must outlive interpreter
// shutdown, when XLA may still destroy executables.
nb::object* g_dispatcher = nullptr;

ffi::Error CpuDispatchImpl(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                           int64_t call_id) {
  nb::gil_scoped_acquire gil;
  if (g_dispatcher == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_triton_dist: no CPU dispatcher is registered");
  }
  nb::list arg_ptrs, ret_ptrs;
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return buffer.error();
    arg_ptrs.append(reinterpret_cast<uintptr_t>(buffer->untyped_data()));
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return buffer.error();
    ret_ptrs.append(reinterpret_cast<uintptr_t>((*buffer)->untyped_data()));
  }
  try {
    // The dispatcher returns None, or the message of a failure.
    nb::object failure = (*g_dispatcher)(call_id, device_ordinal, arg_ptrs, ret_ptrs);
    if (!failure.is_none()) {
      return ffi::Error(ffi::ErrorCode::kInternal, nb::cast<std::string>(failure));
    }
  } catch (const nb::python_error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuDispatch, CpuDispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()   // device_ordinal
                                  .RemainingArgs()             // kernel inputs
                                  .RemainingRets()             // kernel outputs
                                  .Attr<int64_t>("call_id"));  // call site

}  // namespace jtd::xla_ffi

NB_MODULE(_ffi, m) {
  m.doc() = "XLA FFI handlers of jax_triton_dist (private; use jax_triton_dist.triton_call)";
  m.def("registrations", [] {
    nb::dict targets;
    targets["jtd_triton"] = nb::capsule(reinterpret_cast<void*>(jtd::xla_ffi::kCpuDispatch));
    return targets;
  });
  m.def(
      "set_cpu_dispatcher",
      [](nb::object dispatcher) {
        if (jtd::xla_ffi::g_dispatcher == nullptr) {
          jtd::xla_ffi::g_dispatcher = new nb::object();
        }
        *jtd::xla_ffi::g_dispatcher = std::move(dispatcher);
      },
      nb::arg("dispatcher"));
}
