// lumen_core._C_ucx: the native UCX transport (and, later, holder and streamer).
// Registration only; each area binds itself in ucx/bind_<area>.cpp.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_transport(py::module_& m);
void bind_holder(py::module_& m);
void bind_streamer(py::module_& m);

PYBIND11_MODULE(_C_ucx, m) {
  m.doc() = "lumen_core native UCX transport";
  bind_transport(m);
  bind_holder(m);
  bind_streamer(m);
}
