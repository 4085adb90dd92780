// Binding of csrc/staging.cpp. The arena is handed out as a numpy array whose base is the
// pool itself, so the memory lives as long as any array or tensor viewing it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "lumen/staging.h"

namespace py = pybind11;

void bind_staging(py::module_& m) {
  py::class_<lumen::StagingPool>(m, "StagingPool")
      .def(py::init<int64_t, int64_t>(), py::arg("num_buffers"), py::arg("buffer_bytes"))
      .def(
          "acquire",
          [](lumen::StagingPool& pool, double timeout_s) {
            py::gil_scoped_release release;
            return pool.acquire(timeout_s);
          },
          py::arg("timeout_s"), "Index of a free buffer; -1 after timeout_s (< 0: wait forever).")
      .def("release", &lumen::StagingPool::release, py::arg("index"))
      .def(
          "arena",
          [](py::object self) {
            auto& pool = self.cast<lumen::StagingPool&>();
            return py::array_t<uint8_t>({pool.arena_bytes()}, {int64_t{1}}, pool.arena(), self);
          },
          "The whole arena as a uint8 numpy array that keeps the pool alive.")
      .def_property_readonly("num_buffers", &lumen::StagingPool::num_buffers)
      .def_property_readonly("buffer_bytes", &lumen::StagingPool::buffer_bytes)
      .def_property_readonly("stride_bytes", &lumen::StagingPool::stride_bytes)
      .def_property_readonly("num_free", &lumen::StagingPool::num_free);
}
