// lumen_core._C_cuda: the CUDA module. Registration only; areas bind in cuda/bind_<area>.cpp.
#include <pybind11/pybind11.h>

#include "lumen/cuda_device.h"

namespace py = pybind11;

void bind_gather_cuda(py::module_& m);
void bind_verify_cuda(py::module_& m);

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "lumen_core CUDA kernels";
  m.def("device_count", &lumen::cuda_device_count,
        "Number of usable CUDA devices (0 without a driver or device).");
  bind_gather_cuda(m);
  bind_verify_cuda(m);
}
