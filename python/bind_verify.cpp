// Binding of csrc/verify_draft.cpp and lumen/philox.h: addresses of tensors that
// lumen_core.verify.verify_draft has validated, cheap invariants re-checked, GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "lumen/philox.h"
#include "lumen/verify_draft.h"
#include "verify_args.h"

namespace py = pybind11;

void bind_verify(py::module_& m) {
  m.def(
      "verify_draft",
      [](py::dict buffers, int num_threads) {
        if (num_threads < 1) throw std::invalid_argument("verify_draft: num_threads must be >= 1");
        const lumen::VerifyDraftArgs args = lumen_bind::make_verify_args(buffers);
        py::gil_scoped_release release;
        lumen::verify_draft_cpu(args, num_threads);
      },
      py::arg("buffers"), py::arg("num_threads"),
      "Chain speculative verification on the CPU; `buffers` maps the VerifyDraftArgs field "
      "names (lumen/verify_draft.h) to addresses and sizes validated by ops.verify_draft.");
  m.def(
      "probability_row_ok",
      [](py::buffer row, double tolerance, bool portable) {
        const py::buffer_info info = row.request();
        if (info.ndim != 1 || (info.format != "f" && info.format != "d") ||
            info.strides[0] != info.itemsize) {
          throw std::invalid_argument(
              "probability_row_ok: row must be a contiguous 1-D float32/float64 buffer");
        }
        const lumen::SimdPath path = portable ? lumen::SimdPath::kPortable : lumen::SimdPath::kAuto;
        if (info.format == "f") {
          return lumen::probability_row_ok(static_cast<const float*>(info.ptr), info.shape[0],
                                           tolerance, path);
        }
        return lumen::probability_row_ok(static_cast<const double*>(info.ptr), info.shape[0],
                                         tolerance, path);
      },
      py::arg("row"), py::arg("tolerance"), py::kw_only(), py::arg("portable") = false,
      "The native probability-row check of verify_draft; portable=True forces the non-SIMD loop.");
  m.def(
      "philox_uniforms",
      [](py::array_t<uint64_t, py::array::c_style | py::array::forcecast> seeds,
         py::array_t<int64_t, py::array::c_style | py::array::forcecast> positions, int64_t index) {
        if (seeds.size() != positions.size()) {
          throw std::invalid_argument(
              "philox_uniforms: seeds and positions must have the same size");
        }
        if (index < 0 || index >= (int64_t{1} << 32)) {
          throw std::invalid_argument("philox_uniforms: index must be in [0, 2**32)");
        }
        py::array_t<double> out(positions.request().shape);
        const uint64_t* s = seeds.data();
        const int64_t* p = positions.data();
        double* o = out.mutable_data();
        const py::ssize_t n = positions.size();
        for (py::ssize_t i = 0; i < n; ++i) {
          if (p[i] < 0) throw std::invalid_argument("philox_uniforms: positions must be >= 0");
        }
        {
          py::gil_scoped_release release;
          for (py::ssize_t i = 0; i < n; ++i) {
            o[i] = lumen::philox_uniform(s[i], static_cast<uint64_t>(p[i]),
                                         static_cast<uint32_t>(index));
          }
        }
        return out;
      },
      py::arg("seeds"), py::arg("positions"), py::arg("index"),
      "Philox4x32-10 uniforms in [0, 1) for equal-shaped uint64 seeds and int64 positions.");
}
