// Binding of csrc/verify_draft.cu: device addresses validated by lumen_core.verify.verify_draft
// (all on one CUDA device), cheap invariants re-checked, launched on the caller's stream with
// no synchronisation (the kernel writes per-request status to device memory).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "../verify_args.h"
#include "lumen/verify_draft.h"

namespace py = pybind11;

void bind_verify_cuda(py::module_& m) {
  m.def(
      "verify_draft",
      [](py::dict buffers, uintptr_t stream) {
        const lumen::VerifyDraftArgs args = lumen_bind::make_verify_args(buffers);
        py::gil_scoped_release release;
        lumen::verify_draft_cuda(args, reinterpret_cast<void*>(stream));
      },
      py::arg("buffers"), py::arg("stream"),
      "Chain speculative verification on CUDA, one block per request, asynchronous on `stream` "
      "(a cudaStream_t address); field names as lumen/verify_draft.h.");
}
