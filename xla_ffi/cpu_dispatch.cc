// nanobind module `jax_triton_dist._ffi`: the XLA FFI handler that runs a
// distributed Triton kernel on a JAX CPU device.
//
// The handler is glue only: it hands the device ordinal, the call site and
// the buffer addresses to a Python dispatcher (jax_triton_dist/runtime/
// cpu_dispatch.py), which runs the kernel in Triton's interpreter. XLA runs
// the per-device programs of a shard_map on one thread per virtual device, so
// the ranks of one call run concurrently and may wait on each other.
//
// The handler is asynchronous: each call runs on a thread of its own and XLA
// gets a future. XLA's CPU runtime runs independent custom calls in an order
// of its own (it orders its collectives through a shared resource, custom
// calls only through their buffers), so two ranks may reach two independent
// calls in opposite orders; a handler that blocked XLA's thread (or a worker
// of its small pool) until the peers arrived would then wait forever. With a
// future, every rank reaches every call whatever the order.
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
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

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

// Counts a dispatch from its start until its thread has left Python (movable:
// the handler starts the count, the dispatch's thread ends it).
class InFlight {
 public:
  InFlight() { g_in_flight.fetch_add(1); }
  InFlight(InFlight&& other) noexcept : counted_(other.counted_) { other.counted_ = false; }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
  InFlight& operator=(InFlight&&) = delete;
  ~InFlight() {
    if (counted_) g_in_flight.fetch_sub(1);
  }

 private:
  bool counted_ = true;
};

struct Dispatch {
  int32_t device_ordinal;
  int64_t call_id;
  int64_t instance;  // the HLO custom call (site_uses.h)
  int64_t run_id;    // the execution (shared by the devices of one SPMD execution)
  std::vector<uintptr_t> args, rets;
};

// Calls the Python dispatcher (on the dispatch's own thread); returns its
// failure, if any.
std::optional<ffi::Error> RunDispatch(const Dispatch& d) {
  nb::gil_scoped_acquire gil;
  if (g_dispatcher == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_triton_dist: no CPU dispatcher is registered");
  }
  try {
    nb::list arg_ptrs, ret_ptrs;
    for (uintptr_t p : d.args) arg_ptrs.append(p);
    for (uintptr_t p : d.rets) ret_ptrs.append(p);
    // The dispatcher returns None, or the message of a failure.
    nb::object failure =
        (*g_dispatcher)(d.call_id, d.device_ordinal, arg_ptrs, ret_ptrs, d.instance, d.run_id);
    if (!failure.is_none()) {
      return ffi::Error(ffi::ErrorCode::kInternal, nb::cast<std::string>(failure));
    }
  } catch (const nb::python_error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
  return std::nullopt;
}

ffi::Future CpuDispatchImpl(int32_t device_ordinal, ffi::RunId run_id, site_uses::SiteUse* use,
                            ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t call_id) {
  ffi::Promise promise;
  ffi::Future future(promise);
  InFlight in_flight;  // counted before the check: close() waits for it, or it sees closing
  if (g_closing.load()) {
    promise.SetError(ffi::Error(ffi::ErrorCode::kCancelled,
                                "jax_triton_dist: the interpreter is exiting; the kernel did "
                                "not run"));
    return future;
  }
  Dispatch d{device_ordinal, call_id, use->instance, run_id.run_id, {}, {}};
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) {
      promise.SetError(buffer.error());
      return future;
    }
    d.args.push_back(reinterpret_cast<uintptr_t>(buffer->untyped_data()));
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) {
      promise.SetError(buffer.error());
      return future;
    }
    d.rets.push_back(reinterpret_cast<uintptr_t>((*buffer)->untyped_data()));
  }
  // XLA keeps the buffers alive until the future completes.
  try {
    std::thread([promise, d = std::move(d), in_flight = std::move(in_flight)]() mutable {
      std::optional<ffi::Error> failure = RunDispatch(d);
      if (failure.has_value()) {
        promise.SetError(std::move(*failure));
      } else {
        promise.SetAvailable();
      }
    }).detach();
  } catch (const std::system_error& e) {  // no thread could be made: the call fails
    promise.SetError(ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                std::string("jax_triton_dist: cannot start the kernel's "
                                            "thread: ") +
                                    e.what()));
  }
  return future;
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
                                  .Ctx<ffi::DeviceOrdinal>()              // device_ordinal
                                  .Ctx<ffi::RunId>()                      // the execution
                                  .Ctx<ffi::State<site_uses::SiteUse>>()  // the instance
                                  .RemainingArgs()                        // kernel inputs
                                  .RemainingRets()                        // kernel outputs
                                  .Attr<int64_t>("call_id"));             // call site

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
