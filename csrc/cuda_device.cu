#include <cuda_runtime.h>

#include "lumen/cuda_device.h"

namespace lumen {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" status so later calls start clean
    return 0;
  }
  return count;
}

}  // namespace lumen
