// host_pin.h on the CUDA runtime, or the no-GPU build where pinning is never possible.
#include "lumen/holder/host_pin.h"

#include <stdexcept>
#include <string>

#ifdef LUMEN_HOLDER_CUDA
#include <cuda_runtime_api.h>
#endif

namespace lumen::holder {

#ifdef LUMEN_HOLDER_CUDA

bool can_pin_host_memory() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

void pin_host_memory(void* data, size_t bytes) {
  const cudaError_t status = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
  if (status != cudaSuccess) {
    throw std::runtime_error("cudaHostRegister of " + std::to_string(bytes) +
                             " bytes failed: " + cudaGetErrorString(status));
  }
}

void unpin_host_memory(void* data) { cudaHostUnregister(data); }

#else

bool can_pin_host_memory() { return false; }

void pin_host_memory(void* /*data*/, size_t /*bytes*/) {
  throw std::runtime_error("this build of lumen_core has no CUDA: host memory cannot be pinned");
}

void unpin_host_memory(void* /*data*/) {}

#endif

}  // namespace lumen::holder
