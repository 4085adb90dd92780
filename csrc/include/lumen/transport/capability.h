// Capabilities of the data plane (docs/security.md, "Data-plane capabilities"): an Ed25519
// signature (OpenSSL) by the issuer (the gateway, or a gateway-less vLLM server) over one
// checkpoint's (request_id, shard, epoch), the holder it is valid on, its rights and its
// expiry. Workers hold no issuer key, so none can grant itself access or move an epoch; a
// holder verifies with the issuer's public key once per open, read or release, and an append
// presents the capability its connection's open verified. Byte layout (little-endian):
//
//    0 u8[8]  label            "lumencap" (kCapabilityLabel)
//    8 u64    request_id
//   16 u32    shard
//   20 u32    epoch
//   24 u64    holder_id        the one holder that accepts it
//   32 u32    rights           Rights bits
//   36 u32    reserved         0
//   40 u64    expires_at_ms    unix time in ms; refused from then on
//   48 u8[16] reserved         0
//   64 u8[64] signature        Ed25519 over bytes [0, 64)
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace lumen::transport {

constexpr size_t kCapabilityBytes = 128;
constexpr size_t kSignedBytes = 64;     // the part the signature covers
constexpr size_t kIssuerKeyBytes = 32;  // an Ed25519 private key (seed) or public key

using CapabilityBytes = std::array<uint8_t, kCapabilityBytes>;
using IssuerKey = std::array<uint8_t, kIssuerKeyBytes>;

// What a capability lets its bearer do; a capability may carry both.
enum Rights : uint32_t {
  kRightWrite = 1u,  // open, append, release (and fence an older epoch by opening)
  kRightRead = 2u,   // read (and fence an older epoch by reading)
};
constexpr uint32_t kAllRights = kRightWrite | kRightRead;

struct Capability {
  uint64_t request_id = 0;
  uint32_t shard = 0;
  uint32_t epoch = 0;
  uint64_t holder_id = 0;
  uint32_t rights = 0;
  uint64_t expires_at_ms = 0;
};

// A fresh Ed25519 private key (OpenSSL RAND_bytes); throws std::runtime_error if it fails.
IssuerKey generate_issuer_key();

// Signs capabilities with one private key; holds the parsed OpenSSL key.
class CapabilityIssuer {
 public:
  // Throws std::runtime_error if OpenSSL refuses the key.
  explicit CapabilityIssuer(const IssuerKey& private_key);
  ~CapabilityIssuer();
  CapabilityIssuer(const CapabilityIssuer&) = delete;
  CapabilityIssuer& operator=(const CapabilityIssuer&) = delete;

  const IssuerKey& public_key() const { return public_key_; }
  // Throws std::invalid_argument for rights outside kAllRights or none, std::runtime_error if
  // signing fails.
  CapabilityBytes issue(const Capability& capability) const;

 private:
  void* pkey_ = nullptr;  // EVP_PKEY*, kept out of the header
  IssuerKey public_key_{};
};

// Checks capabilities against one public key; safe to call from one thread at a time.
class CapabilityVerifier {
 public:
  // Throws std::runtime_error if OpenSSL refuses the key.
  explicit CapabilityVerifier(const IssuerKey& public_key);
  ~CapabilityVerifier();
  CapabilityVerifier(const CapabilityVerifier&) = delete;
  CapabilityVerifier& operator=(const CapabilityVerifier&) = delete;

  // The capability in bytes if its label, reserved fields and signature are right; false and
  // *why otherwise. Says nothing yet about what it is valid for (see check_grant).
  bool verify(Capability* out, std::string* why, const CapabilityBytes& bytes) const;

 private:
  void* pkey_ = nullptr;  // EVP_PKEY*
};

// Whether a verified capability grants `needed` rights on (request_id, shard, epoch) at holder
// holder_id at unix time now_ms; false and *why otherwise.
bool check_grant(std::string* why, const Capability& capability, uint64_t request_id,
                 uint32_t shard, uint32_t epoch, uint64_t holder_id, uint32_t needed,
                 uint64_t now_ms);

// Unix time in ms (the clock expiries are read on).
uint64_t unix_now_ms();

}  // namespace lumen::transport
