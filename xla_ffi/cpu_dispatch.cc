// nanobind module `jax_triton_dist._ffi`: the XLA FFI handler that runs a
// distributed Triton kernel on a JAX CPU device.
//
// The handler is glue only: it hands the device ordinal, the call site and
// the buffer addresses to a Python dispatcher (jax_triton_dist/runtime/
// cpu_dispatch.py), which runs the kernel in Triton's interpreter. XLA runs
// the per-device programs of a shard_map on one thread per virtual device, so
// the ranks of one call run concurrently and may wait on each other.
//
// At interpreter exit (close()) no device thread may be inside Python or enter it: a
// thread taking the GIL after finalisation began is ended by the interpreter, through C++
// frames, which aborts the process. close() stops new dispatches and waits until the
// running ones have left.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "site_uses.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace jtd::xla_ffi {
namespace {

// The Python dispatcher. Deliberately leaked: it must outlive interpreter
// shutdown, when XLA may still destroy executables.
nb::object* g_dispatcher = nullptr;

std::atomic<int> g_in_flight{0};     // dispatches between their start and their return
std::atomic<bool> g_closing{false};  // close() was called: no dispatch enters Python

struct InFlight {
  InFlight() { g_in_flight.fetch_add(1); }
  ~InFlight() { g_in_flight.fetch_sub(1); }
};

ffi::Error CpuDispatchImpl(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                           int64_t call_id) {
  InFlight in_flight;  // counted before the check: close() waits for it, or it sees closing
  if (g_closing.load()) {
    return ffi::Error(ffi::ErrorCode::kCancelled,
                      "jax_triton_dist: the interpreter is exiting; the kernel did not run");
  }
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

// Waits up to `timeout_s` for the running dispatches; returns how many still run.
int Close(double timeout_s) {
  g_closing.store(true);
  nb::gil_scoped_release release;  // running dispatches need the GIL to finish
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  while (g_in_flight.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return g_in_flight.load();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuInstantiate, site_uses::Instantiate,
                              ffi::Ffi::BindInstantiate().Attr<int64_t>("call_id"));  // call site

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
    nb::dict stages, targets;
    stages["instantiate"] = nb::capsule(reinterpret_cast<void*>(jtd::xla_ffi::kCpuInstantiate));
    stages["execute"] = nb::capsule(reinterpret_cast<void*>(jtd::xla_ffi::kCpuDispatch));
    targets["jtd_triton"] = stages;
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
  m.def("close", &jtd::xla_ffi::Close, nb::arg("timeout_s"),
        "Stops new dispatches and waits up to timeout_s for the running ones (interpreter "
        "exit); returns how many still run.");
  jtd::site_uses::Bind(m);
}
