// Error checking for CUDA runtime calls and kernel launches: every failure becomes a
// std::runtime_error carrying the runtime's message (pybind11 maps it to RuntimeError).
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace lumen {

inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// After a launch: catches bad launch configurations at once; asynchronous faults surface at
// the caller's next synchronisation.
inline void cuda_check_launch(const char* kernel) { cuda_check(cudaGetLastError(), kernel); }

// Makes `device` current on the calling thread for one scope and restores what was current:
// the data plane runs on threads whose current device is the engine's business.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace lumen
