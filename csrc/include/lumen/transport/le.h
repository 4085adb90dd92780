// Little-endian encoding of unsigned integers at a byte pointer: the one home of the byte order
// of the wire header (wire.h), capabilities (capability.h) and worker certificates
// (credential.h). The pointer needs no alignment.
#pragma once
#include <cstddef>
#include <cstdint>

namespace lumen::transport {

template <typename T>
void put_le(uint8_t* out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}

template <typename T>
T get_le(const uint8_t* in) {
  T value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) value |= static_cast<T>(static_cast<T>(in[i]) << (8 * i));
  return value;
}

}  // namespace lumen::transport
