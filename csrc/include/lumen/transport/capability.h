// Capabilities and worker credentials of the data plane (docs/security.md, "Data-plane
// capabilities" and "Worker identity"), both Ed25519-signed (lumen/transport/ed25519.h) by the
// issuer: the gateway, or a gateway-less vLLM server. Workers hold no issuer key, so none can
// grant itself access, move an epoch or speak for another worker.
//
// A capability names one checkpoint's (request_id, shard, epoch), the holder it is valid on,
// its rights, its expiry and, when bound, the one worker (its bearer) whose connections may
// use it; a holder verifies it once per open, read or release, and an append presents the
// capability its connection's open verified. Byte layout (little-endian):
//
//    0 u8[8]  label            "lumencap"
//    8 u64    request_id
//   16 u32    shard
//   20 u32    epoch
//   24 u64    holder_id        the one holder that accepts it
//   32 u32    rights           Rights bits
//   36 u32    flags            kBoundToBearer, or 0
//   40 u64    expires_at_ms    unix time in ms; refused from then on
//   48 u64    bearer_id        the worker it is bound to (0 unless flags say bound)
//   56 u8[8]  reserved         0
//   64 u8[64] signature        Ed25519 over bytes [0, 64)
//
// A worker credential says that an Ed25519 public key speaks for one worker incarnation; the
// worker proves it holds the private key in each connection's handshake (lumen/transport/auth.h):
//
//    0 u8[8]  label            "lumenwid"
//    8 u64    worker_id
//   16 u32    epoch            the registration it was issued at
//   20 u32    reserved         0
//   24 u8[32] public_key       the worker's Ed25519 public key
//   56 u8[8]  reserved         0
//   64 u8[64] signature        Ed25519 over bytes [0, 64)
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "lumen/transport/ed25519.h"

namespace lumen::transport {

constexpr size_t kCapabilityBytes = 128;
constexpr size_t kCredentialBytes = 128;
constexpr size_t kSignedBytes = 64;  // the part the signature covers, in both
constexpr size_t kIssuerKeyBytes = kEd25519KeyBytes;

using CapabilityBytes = std::array<uint8_t, kCapabilityBytes>;
using CredentialBytes = std::array<uint8_t, kCredentialBytes>;
using IssuerKey = Ed25519Key;

// What a capability lets its bearer do; a capability may carry both.
enum Rights : uint32_t {
  kRightWrite = 1u,  // open, append, release (and fence an older epoch by opening)
  kRightRead = 2u,   // read (and fence an older epoch by reading)
};
constexpr uint32_t kAllRights = kRightWrite | kRightRead;

// Capability flags.
constexpr uint32_t kBoundToBearer = 1u;  // only a connection identified as bearer_id may use it

struct Capability {
  uint64_t request_id = 0;
  uint32_t shard = 0;
  uint32_t epoch = 0;
  uint64_t holder_id = 0;
  uint32_t rights = 0;
  uint64_t expires_at_ms = 0;
  std::optional<uint64_t> bearer;  // bound to this worker id; none: any authenticated peer
};

struct Credential {
  uint64_t worker_id = 0;
  uint32_t epoch = 0;
  Ed25519Key public_key{};
};

// Signs capabilities and credentials with the issuer's private key.
class CapabilityIssuer {
 public:
  // Throws std::runtime_error if OpenSSL refuses the key.
  explicit CapabilityIssuer(const IssuerKey& private_key) : signer_(private_key) {}

  const IssuerKey& public_key() const { return signer_.public_key(); }
  // Throws std::invalid_argument for rights outside kAllRights or none, std::runtime_error if
  // signing fails.
  CapabilityBytes issue(const Capability& capability) const;
  // Throws std::runtime_error if signing fails.
  CredentialBytes issue_credential(const Credential& credential) const;

 private:
  Ed25519Signer signer_;
};

// Checks capabilities and credentials against the issuer's public key.
class CapabilityVerifier {
 public:
  // Throws std::runtime_error if OpenSSL refuses the key.
  explicit CapabilityVerifier(const IssuerKey& public_key) : verifier_(public_key) {}

  // The capability in bytes if its label, flags, reserved fields and signature are right;
  // false and *why otherwise. Says nothing yet about what it is valid for (see check_grant).
  bool verify(Capability* out, std::string* why, const CapabilityBytes& bytes) const;
  // The same for a credential.
  bool verify_credential(Credential* out, std::string* why, const CredentialBytes& bytes) const;

 private:
  Ed25519Verifier verifier_;
};

// Whether a verified capability grants `needed` rights on (request_id, shard, epoch) at holder
// holder_id at unix time now_ms, to a connection identified as `peer` (none: not identified);
// false and *why otherwise.
bool check_grant(std::string* why, const Capability& capability, uint64_t request_id,
                 uint32_t shard, uint32_t epoch, uint64_t holder_id, uint32_t needed,
                 uint64_t now_ms, std::optional<uint64_t> peer);

// Unix time in ms (the clock expiries are read on).
uint64_t unix_now_ms();

}  // namespace lumen::transport
