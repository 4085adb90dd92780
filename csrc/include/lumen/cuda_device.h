// Device discovery for the CUDA module.
#pragma once

namespace lumen {

// Number of usable CUDA devices; 0 when there is no driver or no device (never throws).
int cuda_device_count();

}  // namespace lumen
