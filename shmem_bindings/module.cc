// nanobind module `jax_triton_dist._shmem`: a 1:1 binding of the SHMEM
// backends. No SHMEM semantics here; the jax_triton_dist.shmem package holds them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "host_backend.h"
#ifdef JTD_WITH_CUDA
#include "cuda_backend.h"
#endif
#ifdef JTD_WITH_NVSHMEM
#include "nvshmem_backend.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace jtd::shmem {
namespace {

std::unique_ptr<Backend> g_backend;

Backend& Get() {
  if (!g_backend) {
    throw ShmemError("SHMEM is not initialised: call jax_triton_dist.shmem.init() first");
  }
  return *g_backend;
}

// `my_pe`, `unique_id` and `library` are for the nvshmem backend (one PE per process,
// on GPU devices[0]).
void Init(const std::string& backend, int n_pes, size_t heap_size, const std::vector<int>& devices,
          int my_pe, const nb::bytes& unique_id, const std::string& library) {
  if (g_backend) throw ShmemError("SHMEM is already initialised");
  if (backend == "host") {
    g_backend = std::make_unique<HostBackend>(n_pes, heap_size);
    return;
  }
  if (backend == "cuda") {
#ifdef JTD_WITH_CUDA
    if (static_cast<int>(devices.size()) != n_pes) {
      throw std::invalid_argument("shmem.init: the cuda backend needs one device per PE (" +
                                  std::to_string(n_pes) + " PEs, " +
                                  std::to_string(devices.size()) + " devices)");
    }
    g_backend = std::make_unique<CudaBackend>(devices, heap_size);
    return;
#else
    throw ShmemError(
        "this build of jax_triton_dist has no cuda SHMEM backend (it was built "
        "without the CUDA headers)");
#endif
  }
  if (backend == "nvshmem") {
#ifdef JTD_WITH_NVSHMEM
    if (devices.size() != 1) {
      throw std::invalid_argument(
          "shmem.init: the nvshmem backend runs one PE per process, "
          "on one GPU (got " +
          std::to_string(devices.size()) + " devices)");
    }
    std::string id(unique_id.c_str(), unique_id.size());
    g_backend = std::make_unique<NvshmemBackend>(library, id, my_pe, n_pes, devices[0], heap_size);
    return;
#else
    throw ShmemError(
        "this build of jax_triton_dist has no nvshmem SHMEM backend (it was "
        "built without NVSHMEM's headers: build with nvidia-nvshmem-cu13 "
        "installed and --no-build-isolation)");
#endif
  }
  throw std::invalid_argument("unknown SHMEM backend '" + backend + "'");
}

bool HasNvshmem() {
#ifdef JTD_WITH_NVSHMEM
  return true;
#else
  return false;
#endif
}

bool HasCuda() {
#ifdef JTD_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace jtd::shmem

NB_MODULE(_shmem, m) {
  using namespace jtd::shmem;
  m.doc() = "SHMEM backends of jax_triton_dist (private; use jax_triton_dist.shmem)";

  auto shmem_error = nb::exception<ShmemError>(m, "ShmemError", PyExc_RuntimeError);
  nb::exception<ShmemTimeout>(m, "ShmemTimeoutError", shmem_error.ptr());
  nb::exception<ShmemAborted>(m, "ShmemAbortedError", shmem_error.ptr());

  // The C++ side of jax_triton_dist/shmem/signals.py, for the test that checks they agree.
  m.def("enum_values", [] {
    nb::dict cmp, op, both;
    cmp["EQ"] = static_cast<int>(Cmp::kEq);
    cmp["NE"] = static_cast<int>(Cmp::kNe);
    cmp["GT"] = static_cast<int>(Cmp::kGt);
    cmp["GE"] = static_cast<int>(Cmp::kGe);
    cmp["LT"] = static_cast<int>(Cmp::kLt);
    cmp["LE"] = static_cast<int>(Cmp::kLe);
    op["SET"] = static_cast<int>(SignalOp::kSet);
    op["ADD"] = static_cast<int>(SignalOp::kAdd);
    both["Cmp"] = cmp;
    both["SignalOp"] = op;
    return both;
  });

  // Lifetime.
  m.def("init", &Init, "backend"_a, "n_pes"_a, "heap_size"_a, "devices"_a, "my_pe"_a = -1,
        "unique_id"_a = nb::bytes(""), "library"_a = "");
  m.def("has_cuda", &HasCuda);
  m.def("has_nvshmem", &HasNvshmem);
#ifdef JTD_WITH_NVSHMEM
  m.def(
      "nvshmem_unique_id",
      [](const std::string& library) {
        std::string id = NvshmemUniqueId(library);
        return nb::bytes(id.data(), id.size());
      },
      "library"_a);
  m.def("nvshmem_version", &NvshmemVersion, "library"_a);
#endif
  m.def(
      "nvshmem_cumodule_init",
      [](uintptr_t module) {
#ifdef JTD_WITH_NVSHMEM
        if (auto* nv = dynamic_cast<NvshmemBackend*>(&Get())) {
          nv->InitModule(module);
          return;
        }
#endif
        throw ShmemError(
            "a kernel module holds NVSHMEM device code, but SHMEM does not run the "
            "nvshmem backend");
      },
      "module"_a);
  // This process's PE where the backend has one (nvshmem), else -1.
  m.def("process_pe", [] {
#ifdef JTD_WITH_NVSHMEM
    if (auto* nv = dynamic_cast<NvshmemBackend*>(&Get())) return nv->my_pe();
#endif
    return -1;
  });
  m.def("finalize", [] { g_backend.reset(); });
  m.def("initialized", [] { return g_backend != nullptr; });
  m.def("backend_name", [] { return std::string(Get().name()); });

  // Geometry.
  m.def("n_pes", [] { return Get().n_pes(); });
  m.def("heap_size", [] { return Get().heap_size(); });
  m.def("heap_base", [](int pe) { return Get().heap_base(pe); }, "pe"_a);
  m.def("pe_of", [](uintptr_t addr) { return Get().pe_of(addr); }, "addr"_a);
  m.def("device_of", [](int pe) { return Get().device_of(pe); }, "pe"_a);

  // Allocator (offsets shared by all heaps).
  m.def(
      "alloc", [](size_t size, size_t alignment) { return Get().alloc(size, alignment); }, "size"_a,
      "alignment"_a);
  m.def("release", [](size_t offset) { return Get().release(offset); }, "offset"_a);
  m.def("allocated_bytes", [] { return Get().allocated_bytes(); });
  m.def("largest_free_block", [] { return Get().largest_free_block(); });
  m.def("allocation_count", [] { return Get().allocation_count(); });

  // Rendezvous among the PEs of this process (releases the GIL while waiting).
  m.def(
      "rendezvous",
      [](int64_t key, int members, int index, int64_t value, double timeout_s) {
        Backend& backend = Get();
        nb::gil_scoped_release release;
        return backend.rendezvous(key, members, index, value, timeout_s);
      },
      "key"_a, "members"_a, "index"_a, "value"_a, "timeout_s"_a);

  // Memory operations of the active backend, issued by PE `pe`.
  m.def(
      "copy",
      [](int pe, uintptr_t dst, uintptr_t src, size_t nbytes, bool blocking) {
        Backend& backend = Get();
        nb::gil_scoped_release release;
        backend.copy(pe, dst, src, nbytes, blocking);
      },
      "pe"_a, "dst"_a, "src"_a, "nbytes"_a, "blocking"_a = true);
  m.def(
      "memset",
      [](int pe, uintptr_t addr, int byte, size_t nbytes) {
        Backend& backend = Get();
        nb::gil_scoped_release release;
        backend.memset(pe, addr, byte, nbytes);
      },
      "pe"_a, "addr"_a, "byte"_a, "nbytes"_a);
  m.def(
      "signal",
      [](int pe, uintptr_t addr, uint64_t value, int op, int itemsize) {
        Backend& backend = Get();
        nb::gil_scoped_release release;
        backend.signal_op(pe, addr, value, static_cast<SignalOp>(op), itemsize);
      },
      "pe"_a, "addr"_a, "value"_a, "op"_a, "itemsize"_a);
  m.def(
      "load",
      [](int pe, uintptr_t addr, int itemsize) {
        Backend& backend = Get();
        nb::gil_scoped_release release;
        return backend.load(pe, addr, itemsize);
      },
      "pe"_a, "addr"_a, "itemsize"_a);
  m.def(
      "quiet",
      [](int pe) {
        Backend& backend = Get();
        nb::gil_scoped_release release;
        backend.quiet(pe);
      },
      "pe"_a);
  m.def(
      "wait",
      [](int pe, std::vector<uintptr_t> addrs, int itemsize, bool is_signed, int cmp, int64_t value,
         double timeout_s, std::string who) {
        Backend& backend = Get();
        nb::gil_scoped_release release;
        backend.wait(pe, addrs, itemsize, is_signed, static_cast<Cmp>(cmp), value, timeout_s, who);
      },
      "pe"_a, "addrs"_a, "itemsize"_a, "is_signed"_a, "cmp"_a, "value"_a, "timeout_s"_a, "who"_a);

  // Atomics on host memory (the Triton interpreter's `dl` primitives).
  m.def(
      "signal_op",
      [](uintptr_t addr, uint64_t value, int op, int itemsize) {
        signal_op(addr, value, static_cast<SignalOp>(op), itemsize);
      },
      "addr"_a, "value"_a, "op"_a, "itemsize"_a);
  m.def(
      "wait_flags",
      [](std::vector<uintptr_t> addrs, int itemsize, bool is_signed, int cmp, int64_t value,
         double timeout_s, std::string who, uintptr_t abort_addr, int64_t abort_epoch,
         uintptr_t run_abort_addr) {
        nb::gil_scoped_release release;
        wait_flags(addrs, itemsize, is_signed, static_cast<Cmp>(cmp), value, timeout_s, who,
                   abort_addr, abort_epoch, run_abort_addr);
      },
      "addrs"_a, "itemsize"_a, "is_signed"_a, "cmp"_a, "value"_a, "timeout_s"_a, "who"_a,
      "abort_addr"_a = 0, "abort_epoch"_a = 0, "run_abort_addr"_a = 0);
  // Every wait and rendezvous, running or to come, raises ShmemAbortedError (at exit).
  m.def("cancel_waits", &CancelWaits, "reason"_a);
  m.def("fence", &fence);
}
