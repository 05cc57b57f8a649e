// Which call sites live executables use, so that the runtime can release a call site's
// symmetric region and launch plans when no executable uses it any more.
//
// The `jtd_triton` FFI target has an instantiate stage: XLA runs it once per (executable,
// device) and keeps the SiteUse it returns until the executable is destroyed. Both ends
// append an event to a log here; Python drains the log at its own safe points (no Python,
// and no lock Python could hold, is touched when XLA destroys an executable: that may
// happen on any thread, and at interpreter exit).
#ifndef JAX_TRITON_DIST_XLA_FFI_SITE_USES_H_
#define JAX_TRITON_DIST_XLA_FFI_SITE_USES_H_

#include <nanobind/nanobind.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jtd::site_uses {

// (call id, +1 when an executable starts using the site on a device, -1 when it stops, the
// use's instance).
struct Event {
  int64_t call_id;
  int delta;
  int64_t instance;
};
inline std::mutex g_mu;
inline std::atomic<int64_t> g_next_instance{1};
inline std::vector<Event> g_events;

inline void Record(int64_t call_id, int delta, int64_t instance) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_events.push_back(Event{call_id, delta, instance});
}

struct SiteUse {
  static xla::ffi::TypeId id;
  static xla::ffi::TypeInfo info;

  explicit SiteUse(int64_t call_id) : call_id(call_id), instance(g_next_instance.fetch_add(1)) {
    Record(call_id, +1, instance);
  }
  ~SiteUse() { Record(call_id, -1, instance); }
  SiteUse(const SiteUse&) = delete;
  SiteUse& operator=(const SiteUse&) = delete;

  int64_t call_id;
  // This use's number, unique in the process. XLA's CPU runtime makes one use per HLO custom
  // call, shared by every device: the custom calls of one call site (a traced function used
  // twice in a program) tell themselves apart by it, the same way on every rank.
  int64_t instance;
};

inline xla::ffi::TypeId SiteUse::id = {0};  // assigned when Python registers the type
inline xla::ffi::TypeInfo SiteUse::info = xla::ffi::MakeTypeInfo<SiteUse>();

inline xla::ffi::ErrorOr<std::unique_ptr<SiteUse>> Instantiate(int64_t call_id) {
  return std::make_unique<SiteUse>(call_id);
}

// Binds `take_site_events()` (the log since the last call, as (call_id, delta, instance)
// tuples) and
// `site_use_type()` (the registration of SiteUse for jax.ffi.register_ffi_type) into `m`.
inline void Bind(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "take_site_events",
      [] {
        std::vector<Event> events;
        {
          std::lock_guard<std::mutex> lock(g_mu);
          events.swap(g_events);
        }
        nb::list out;
        for (const Event& e : events) out.append(nb::make_tuple(e.call_id, e.delta, e.instance));
        return out;
      },
      "The site-use events since the last call: (call_id, +1 | -1, instance) per use.");
  m.def("site_use_type", [] {
    nb::dict type;
    type["type_id"] = nb::capsule(reinterpret_cast<void*>(&SiteUse::id));
    type["type_info"] = nb::capsule(reinterpret_cast<void*>(&SiteUse::info));
    return type;
  });
}

}  // namespace jtd::site_uses

#endif  // JAX_TRITON_DIST_XLA_FFI_SITE_USES_H_
