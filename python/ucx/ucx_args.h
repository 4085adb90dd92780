// Shared by the bindings in python/ucx/: argument conversions the transport, holder and
// streamer bindings all need, each checked the same way.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <array>
#include <cstring>
#include <string>
#include <utility>

#include "lumen/slot_index.h"
#include "lumen/transport/auth.h"
#include "lumen/transport/capability.h"
#include "lumen/transport/wire.h"

namespace lumen_bind {

namespace py = pybind11;

// value as a fixed-size byte array; ValueError "<name> must be N bytes, got M" otherwise.
template <size_t N>
std::array<uint8_t, N> to_byte_array(const py::bytes& value, const char* name) {
  const std::string bytes = value;
  if (bytes.size() != N) {
    throw py::value_error(std::string(name) + " must be " + std::to_string(N) + " bytes, got " +
                          std::to_string(bytes.size()));
  }
  std::array<uint8_t, N> out{};
  std::memcpy(out.data(), bytes.data(), N);
  return out;
}

// A capability (kCapabilityBytes) as the wire carries it.
inline lumen::transport::CapabilityBytes to_capability(const py::bytes& value, const char* name) {
  return to_byte_array<lumen::transport::kCapabilityBytes>(value, name);
}

// A worker identity: its credential (kCredentialBytes) and Ed25519 private key.
inline lumen::transport::Identity to_identity(const py::bytes& credential,
                                              const py::bytes& identity_key) {
  return lumen::transport::Identity{
      to_byte_array<lumen::transport::kCredentialBytes>(credential, "credential"),
      to_byte_array<lumen::transport::kEd25519KeyBytes>(identity_key, "identity_key")};
}

template <size_t N>
py::bytes to_bytes(const std::array<uint8_t, N>& value) {
  return py::bytes(reinterpret_cast<const char*>(value.data()), N);
}

inline lumen::transport::WireLimits to_limits(uint32_t max_tokens, uint32_t max_record_bytes,
                                              uint64_t max_payload_bytes) {
  lumen::transport::WireLimits limits;
  limits.max_tokens_per_message = max_tokens;
  limits.max_record_bytes = max_record_bytes;
  limits.max_payload_bytes = max_payload_bytes;
  return limits;
}

// The plane descriptors lumen_core.layouts builds ([num_planes, kPlaneDescFields] int64) as
// (planes, num_planes); ValueError for another shape.
inline std::pair<const lumen::PlaneDesc*, int> to_planes(
    const py::array_t<int64_t, py::array::c_style>& descriptors) {
  if (descriptors.ndim() != 2 || descriptors.shape(1) != lumen::kPlaneDescFields) {
    throw py::value_error("descriptors must be [num_planes, 9] int64");
  }
  return {reinterpret_cast<const lumen::PlaneDesc*>(descriptors.data()),
          static_cast<int>(descriptors.shape(0))};
}

}  // namespace lumen_bind
