// lumen_core._C: the CPU module. Registration only; each area binds itself in bind_<area>.cpp.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_checksum(py::module_& m);
void bind_gather(py::module_& m);
void bind_staging(py::module_& m);
void bind_verify(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "lumen_core CPU kernels";
  py::dict info;
  info["modules"] = LUMEN_BUILD_MODULES;
  info["cuda_archs"] = LUMEN_BUILD_CUDA_ARCHS;
  info["cxx"] = LUMEN_BUILD_CXX;
#ifdef LUMEN_BUILD_CUDA_VERSION
  info["cuda_version"] = LUMEN_BUILD_CUDA_VERSION;
#endif
  m.attr("BUILD_INFO") = info;
  bind_checksum(m);
  bind_gather(m);
  bind_staging(m);
  bind_verify(m);
}
