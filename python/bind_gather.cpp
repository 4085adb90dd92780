// Binding of csrc/gather.cpp: addresses and sizes in, GIL released around the copies.
// Planes arrive as the address of a packed int64 [num_planes, 9] array (slot_index.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "lumen/gather.h"

namespace py = pybind11;

namespace {

const lumen::PlaneDesc* as_planes(uintptr_t address) {
  return reinterpret_cast<const lumen::PlaneDesc*>(address);
}

}  // namespace

void bind_gather(py::module_& m) {
  m.attr("PLANE_DESC_FIELDS") = lumen::kPlaneDescFields;
  m.def(
      "gather_tokens",
      [](uintptr_t records, uintptr_t planes, int num_planes, int64_t record_bytes,
         uintptr_t slot_ids, int64_t num_tokens, int num_threads) {
        py::gil_scoped_release release;
        lumen::gather_tokens_cpu(reinterpret_cast<uint8_t*>(records), as_planes(planes), num_planes,
                                 record_bytes, reinterpret_cast<const int64_t*>(slot_ids),
                                 num_tokens, num_threads);
      },
      py::arg("records"), py::arg("planes"), py::arg("num_planes"), py::arg("record_bytes"),
      py::arg("slot_ids"), py::arg("num_tokens"), py::arg("num_threads"));
  m.def(
      "scatter_tokens",
      [](uintptr_t records, uintptr_t planes, int num_planes, int64_t record_bytes,
         uintptr_t slot_ids, int64_t num_tokens, int num_threads) {
        py::gil_scoped_release release;
        lumen::scatter_tokens_cpu(
            reinterpret_cast<const uint8_t*>(records), as_planes(planes), num_planes, record_bytes,
            reinterpret_cast<const int64_t*>(slot_ids), num_tokens, num_threads);
      },
      py::arg("records"), py::arg("planes"), py::arg("num_planes"), py::arg("record_bytes"),
      py::arg("slot_ids"), py::arg("num_tokens"), py::arg("num_threads"));
  m.def(
      "copy_bytes",
      [](uintptr_t dst, uintptr_t src, int64_t num_bytes, int num_threads, bool streaming) {
        py::gil_scoped_release release;
        lumen::copy_bytes_cpu(reinterpret_cast<uint8_t*>(dst),
                              reinterpret_cast<const uint8_t*>(src), num_bytes, num_threads,
                              streaming);
      },
      py::arg("dst"), py::arg("src"), py::arg("num_bytes"), py::arg("num_threads"), py::kw_only(),
      py::arg("streaming") = false,
      "Contiguous copy split over threads: memcpy (the ceiling of the benchmarks) or, with "
      "streaming=True, the kernels' streaming copy routine (cpu_copy_kind).");
  m.def(
      "slot_piece_offsets",
      [](uintptr_t planes, int num_planes, int64_t record_bytes, std::vector<int64_t> slot_ids) {
        // The index math of slot_index.h, exposed so tests can compare it with torch's own
        // element addresses: [token][plane][piece] byte offsets from each plane's base.
        lumen::validate_planes(as_planes(planes), num_planes, record_bytes);
        lumen::validate_slots(as_planes(planes), num_planes, slot_ids.data(),
                              static_cast<int64_t>(slot_ids.size()));
        std::vector<std::vector<std::vector<int64_t>>> offsets;
        for (int64_t slot : slot_ids) {
          auto& per_plane = offsets.emplace_back();
          for (int i = 0; i < num_planes; ++i) {
            const lumen::PlaneDesc& plane = as_planes(planes)[i];
            auto& pieces = per_plane.emplace_back();
            for (int64_t p = 0; p < plane.num_pieces; ++p) {
              pieces.push_back(lumen::slot_piece_offset(plane, slot, p));
            }
          }
        }
        return offsets;
      },
      py::arg("planes"), py::arg("num_planes"), py::arg("record_bytes"), py::arg("slot_ids"));
  m.def("cpu_copy_kind", &lumen::cpu_copy_kind,
        "The streaming copy routine the CPU kernels use for every scatter and for gathers "
        "larger than a quarter of the last-level cache (smaller ones: memcpy): avx512, avx2 "
        "or memcpy. LUMEN_CPU_COPY in the environment, read once per process, forces one.");
}
