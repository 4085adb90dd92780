// Binding of csrc/gather.cu: addresses, sizes, a placement enum and a stream handle in; the
// GIL is released around the (asynchronous) launches.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "lumen/gather.h"

namespace py = pybind11;

namespace {

void gather(uintptr_t records, uintptr_t planes_host, uintptr_t planes_device, int num_planes,
            int64_t record_bytes, uintptr_t slot_ids, int64_t num_tokens,
            lumen::RecordPlacement placement, uintptr_t staging, uintptr_t stream) {
  py::gil_scoped_release release;
  lumen::gather_tokens_cuda(
      reinterpret_cast<uint8_t*>(records), reinterpret_cast<const lumen::PlaneDesc*>(planes_host),
      reinterpret_cast<const lumen::PlaneDesc*>(planes_device), num_planes, record_bytes,
      reinterpret_cast<const int64_t*>(slot_ids), num_tokens, placement,
      reinterpret_cast<uint8_t*>(staging), reinterpret_cast<CUstream_st*>(stream));
}

void scatter(uintptr_t records, uintptr_t planes_host, uintptr_t planes_device, int num_planes,
             int64_t record_bytes, uintptr_t slot_ids, int64_t num_tokens,
             lumen::RecordPlacement placement, uintptr_t staging, uintptr_t stream) {
  py::gil_scoped_release release;
  lumen::scatter_tokens_cuda(reinterpret_cast<const uint8_t*>(records),
                             reinterpret_cast<const lumen::PlaneDesc*>(planes_host),
                             reinterpret_cast<const lumen::PlaneDesc*>(planes_device), num_planes,
                             record_bytes, reinterpret_cast<const int64_t*>(slot_ids), num_tokens,
                             placement, reinterpret_cast<uint8_t*>(staging),
                             reinterpret_cast<CUstream_st*>(stream));
}

}  // namespace

void bind_gather_cuda(py::module_& m) {
  py::enum_<lumen::MoveDirection>(m, "MoveDirection")
      .value("gather", lumen::MoveDirection::kGather)
      .value("scatter", lumen::MoveDirection::kScatter);
  py::enum_<lumen::RecordPlacement>(m, "RecordPlacement")
      .value("device", lumen::RecordPlacement::kDevice)
      .value("mapped_host", lumen::RecordPlacement::kMappedHost)
      .value("staged_host", lumen::RecordPlacement::kStagedHost);
  const char* args_doc =
      "(records, planes_host, planes_device, num_planes, record_bytes, slot_ids, num_tokens, "
      "placement, staging, stream): addresses of the records, of the packed plane descriptors "
      "on the host and on the device, of int64 device slot ids, of a device staging buffer "
      "(staged placement) and the cudaStream_t handle.";
  m.def("gather_tokens", &gather, py::arg("records"), py::arg("planes_host"),
        py::arg("planes_device"), py::arg("num_planes"), py::arg("record_bytes"),
        py::arg("slot_ids"), py::arg("num_tokens"), py::arg("placement"), py::arg("staging"),
        py::arg("stream"), args_doc);
  m.def("scatter_tokens", &scatter, py::arg("records"), py::arg("planes_host"),
        py::arg("planes_device"), py::arg("num_planes"), py::arg("record_bytes"),
        py::arg("slot_ids"), py::arg("num_tokens"), py::arg("placement"), py::arg("staging"),
        py::arg("stream"), args_doc);
  m.def(
      "emulate_move_tokens_on_host",
      [](uintptr_t records, uintptr_t planes, int num_planes, int64_t record_bytes,
         uintptr_t slot_ids, int64_t num_tokens, lumen::MoveDirection direction,
         int64_t num_blocks) {
        py::gil_scoped_release release;
        lumen::emulate_move_tokens_on_host(
            reinterpret_cast<uint8_t*>(records), reinterpret_cast<const lumen::PlaneDesc*>(planes),
            num_planes, record_bytes, reinterpret_cast<const int64_t*>(slot_ids), num_tokens,
            direction, num_blocks);
      },
      py::arg("records"), py::arg("planes"), py::arg("num_planes"), py::arg("record_bytes"),
      py::arg("slot_ids"), py::arg("num_tokens"), py::arg("direction"), py::arg("num_blocks"),
      "The kernel's lane code run on the CPU over host memory (tests without a GPU).");
}
