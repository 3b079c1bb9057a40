// fxstar._C: the compiled core. It works on raw buffers and never links libtorch, so it builds
// fast and does not depend on torch's ABI.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "adam_8bit.hpp"
#include "arena.hpp"
#include "cpu_adam.hpp"
#include "disk_io_bindings.hpp"
#include "host_buffer.hpp"
#include "kernels/dispatch.hpp"
#include "tier_copy.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

py::dict stats_dict(const fxstar::ArenaStats& s) {
  py::dict d;
  d["capacity"] = s.capacity;
  d["alignment"] = s.alignment;
  d["in_use"] = s.in_use;
  d["peak_in_use"] = s.peak_in_use;
  d["free_bytes"] = s.free_bytes;
  d["largest_free"] = s.largest_free;
  d["fragmentation"] = s.fragmentation;
  d["live_blocks"] = s.live_blocks;
  d["free_blocks"] = s.free_blocks;
  d["total_allocs"] = s.total_allocs;
  d["total_frees"] = s.total_frees;
  d["failed_allocs"] = s.failed_allocs;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fxstar's compiled core: the arena allocator, host buffers, copies between them, the CPU Adam kernels and asynchronous disk I/O.";

  // A MemoryError subclass that carries the numbers, so callers can react without parsing text.
  static py::handle oom_type = PyErr_NewExceptionWithDoc(
      "fxstar._C.ArenaOutOfMemory",
      "An arena allocation did not fit. Attributes: requested, free_bytes, largest_free.",
      PyExc_MemoryError, nullptr);
  m.attr("ArenaOutOfMemory") = oom_type;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const fxstar::ArenaOutOfMemory& e) {
      py::object exc = py::reinterpret_borrow<py::object>(oom_type)(e.what());
      exc.attr("requested") = e.requested;
      exc.attr("free_bytes") = e.free_bytes;
      exc.attr("largest_free") = e.largest_free;
      PyErr_SetObject(oom_type.ptr(), exc.ptr());
    }
  });

  py::class_<fxstar::Arena>(m, "Arena",
                            "Best-fit offset allocator with coalescing over a fixed capacity.")
      .def(py::init<uint64_t, uint64_t>(), "capacity"_a, "alignment"_a = 256)
      .def("alloc", &fxstar::Arena::alloc, "nbytes"_a,
           "Reserve nbytes (rounded up to the alignment); returns the offset.")
      .def("free", &fxstar::Arena::free, "offset"_a)
      .def("block_size", &fxstar::Arena::block_size, "offset"_a,
           "Bytes reserved at offset (the request rounded up to the alignment).")
      .def("owns", &fxstar::Arena::owns, "offset"_a)
      .def("round_up", &fxstar::Arena::round_up, "nbytes"_a)
      .def("stats", [](const fxstar::Arena& a) { return stats_dict(a.stats()); })
      .def("reset_peak", &fxstar::Arena::reset_peak)
      .def_property_readonly("capacity", &fxstar::Arena::capacity)
      .def_property_readonly("alignment", &fxstar::Arena::alignment)
      .def_property_readonly("in_use", &fxstar::Arena::in_use)
      .def("__repr__", [](const fxstar::Arena& a) {
        auto s = a.stats();
        return "Arena(capacity=" + std::to_string(s.capacity) + ", in_use=" +
               std::to_string(s.in_use) + ", live_blocks=" + std::to_string(s.live_blocks) + ")";
      });

  py::class_<fxstar::HostBuffer>(
      m, "HostBuffer",
      "Aligned host memory, exported to torch without a copy (torch.from_dlpack gives a uint8 "
      "tensor of nbytes). Zeroed by default; zero=False skips the memset and leaves whatever the "
      "heap held before (bytes freed by this process, possibly other data): use it only for a "
      "buffer that is overwritten completely before anything reads it.")
      .def(py::init<int64_t, uint64_t, bool>(), "nbytes"_a, "alignment"_a = 0, "zero"_a = true)
      .def(
          "__dlpack__",
          // Always the legacy capsule, whatever max_version asks: the protocol allows it.
          [](const fxstar::HostBuffer& b, py::args, py::kwargs) { return b.dlpack(); })
      .def("__dlpack_device__", [](const fxstar::HostBuffer&) { return py::make_tuple(1, 0); })
      .def_property_readonly("nbytes", &fxstar::HostBuffer::nbytes)
      .def_property_readonly("alignment", &fxstar::HostBuffer::alignment)
      .def_property_readonly("address", &fxstar::HostBuffer::address)
      .def_property_readonly("huge_pages", &fxstar::HostBuffer::huge_pages);

  m.def("host_bytes_in_use", &fxstar::host_bytes_in_use,
        "Bytes of every HostBuffer allocation alive now (as requested, before alignment).");
  m.def("max_threads", &fxstar::max_threads,
        "The most threads a kernel runs: a larger num_threads is clamped to this (4 per hardware "
        "thread); num_threads < 1 is a ValueError.");
  m.def("adam_step", &fxstar::adam_step, "param"_a, "grad"_a, "exp_avg"_a, "exp_avg_sq"_a,
        py::kw_only(), "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a,
        "adamw"_a, "grad_scale"_a = 1.0, "out"_a = py::none(), "num_threads"_a,
        "variant"_a = "",
        "One Adam/AdamW update in a single pass over memory, in place on param (fp32), exp_avg and "
        "exp_avg_sq (both fp32, or both bf16: computed in fp32, stored rounded to nearest even). "
        "grad may be fp32, bf16 or fp16 and is multiplied by grad_scale "
        "first; out (bf16/fp16), if given, receives the updated parameter (out may be grad itself: "
        "it is overwritten). Hyperparameters must be "
        "finite as float32, eps at least float32's smallest normal; num_threads >= 1, clamped to "
        "max_threads().");
  m.def("adam_step_8bit", &fxstar::adam_step_8bit, "param"_a, "grad"_a, "exp_avg_codes"_a,
        "exp_avg_absmax"_a, "exp_avg_sq_codes"_a, "exp_avg_sq_absmax"_a, py::kw_only(), "lr"_a,
        "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a, "adamw"_a,
        "grad_scale"_a = 1.0, "out"_a = py::none(), "num_threads"_a, "variant"_a = "",
        "adam_step with both moments 8-bit blockwise-quantised (bitsandbytes' dynamic map, "
        "QUANT_BLOCK values per fp32 absmax): each block is dequantised, updated in fp32 as "
        "adam_step updates, and requantised to the nearest code under its new absmax. codes are "
        "uint8 of param's size, absmax fp32 of ceil(numel / QUANT_BLOCK); all zeros is a zero "
        "moment. grad, grad_scale and out as adam_step.");
  m.def("quantize_moment", &fxstar::quantize_moment, "values"_a, "codes"_a, "absmax"_a,
        py::kw_only(), "signed"_a,
        "codes, absmax <- fp32 values quantised blockwise (signed=True for a first moment, "
        "False for a second, which must not be negative).");
  m.def("dequantize_moment", &fxstar::dequantize_moment, "codes"_a, "absmax"_a, "out"_a,
        py::kw_only(), "signed"_a, "out (fp32) <- the code's map value x its block's absmax.");
  m.def("quantization_map", &fxstar::quantization_map, py::kw_only(), "signed"_a,
        "The 256 values (ascending, in [-1, 1] or [0, 1]) an 8-bit moment code stands for.");
  m.attr("QUANT_BLOCK") = fxstar::kQuantBlock;
  m.def("grad_stats", &fxstar::grad_stats, "grad"_a, py::kw_only(), "num_threads"_a,
        "variant"_a = "",
        "(sum of squares, all finite) of a gradient buffer in one read.");
  m.def("adam_traffic", &fxstar::adam_traffic, "param"_a, "grad"_a, "exp_avg"_a, "exp_avg_sq"_a,
        py::kw_only(), "num_threads"_a, "variant"_a = "",
        "Adam's memory traffic with trivial arithmetic: the bandwidth roofline for benchmarks.");
  m.def("copy_into", &fxstar::copy_into, "dst"_a, "src"_a, py::kw_only(), "num_threads"_a,
        "dst <- src between host buffers of one dtype and size (both contiguous, not "
        "overlapping), with the GIL released: the caller and up to num_threads - 1 helper "
        "threads take 1 MiB blocks from one counter; a TypeError or ValueError names the "
        "argument that does not fit.");
  m.def("available_variants", [] {
    std::vector<std::string> names;
    for (auto* v : fxstar::available_variants()) names.emplace_back(v->name);
    return names;
  });
  m.def("selected_variant", [] { return std::string(fxstar::select_variant("").name); });
  m.def("cpu_features", &fxstar::cpu_features);
  m.def("format_bytes", &fxstar::format_bytes, "nbytes"_a);
  fxstar::bind_disk_io(m);
}
