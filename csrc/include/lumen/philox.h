// Philox4x32-10, the package's one counter-based generator (docs/verify_draft.md).
// Bit-identical to src/lumen_core/rng.py: counter = (position lo, position hi, index, 0),
// key = (seed lo, seed hi); the first two output words give a 53-bit double in [0, 1):
// ((x0 >> 5) * 2^26 + (x1 >> 6)) / 2^53. Header-only and __host__ __device__ so the CPU
// path, its tests and the CUDA kernels share one tested definition.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define LUMEN_HOST_DEVICE __host__ __device__
#else
#define LUMEN_HOST_DEVICE
#endif

namespace lumen {

struct PhiloxWords {
  uint32_t x0, x1, x2, x3;
};

LUMEN_HOST_DEVICE inline PhiloxWords philox4x32_10(PhiloxWords c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c.x0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c.x2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c = PhiloxWords{hi1 ^ c.x1 ^ k0, lo1, hi0 ^ c.x3 ^ k1, lo0};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

// The uniform double in [0, 1) of draw `index` at (seed, position).
LUMEN_HOST_DEVICE inline double philox_uniform(uint64_t seed, uint64_t position, uint32_t index) {
  const PhiloxWords counter{static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32),
                            index, 0u};
  const PhiloxWords x =
      philox4x32_10(counter, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return (static_cast<double>(x.x0 >> 5) * 67108864.0 + static_cast<double>(x.x1 >> 6)) /
         9007199254740992.0;
}

}  // namespace lumen
