// Binding of csrc/checksum.cpp: raw pointers in, GIL released around the work.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "lumen/checksum.h"

namespace py = pybind11;

void bind_checksum(py::module_& m) {
  m.def(
      "checksum_records",
      [](uintptr_t out, uintptr_t records, int64_t num_records, int64_t record_bytes,
         int num_threads) {
        if (num_records < 0 || record_bytes < 0 || num_threads < 1) {
          throw std::invalid_argument("checksum_records: negative size or thread count < 1");
        }
        py::gil_scoped_release release;
        lumen::checksum_records(reinterpret_cast<uint32_t*>(out),
                                reinterpret_cast<const uint8_t*>(records), num_records,
                                record_bytes, num_threads);
      },
      py::arg("out"), py::arg("records"), py::arg("num_records"), py::arg("record_bytes"),
      py::arg("num_threads"),
      "out[i] = crc32c(records[i]) for uint32 out[num_records] and uint8 "
      "records[num_records, record_bytes] given as addresses.");
  m.def(
      "crc32c",
      [](py::buffer data, uint32_t crc, bool portable) {
        py::buffer_info info = data.request();
        if (!PyBuffer_IsContiguous(info.view(), 'C')) {
          throw std::invalid_argument("crc32c: data must be a C-contiguous buffer");
        }
        size_t num_bytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        py::gil_scoped_release release;
        return portable ? lumen::crc32c_portable(info.ptr, num_bytes, crc)
                        : lumen::crc32c(info.ptr, num_bytes, crc);
      },
      py::arg("data"), py::arg("crc") = 0, py::kw_only(), py::arg("portable") = false,
      "CRC-32C of a contiguous buffer, continuing from `crc`; portable=True forces the table "
      "implementation.");
  m.def("crc32c_uses_hardware", &lumen::crc32c_uses_hardware,
        "True when crc32c runs on the SSE4.2 crc32 instruction.");
}
