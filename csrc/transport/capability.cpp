// Capabilities and worker credentials (lumen/transport/capability.h).
#include "lumen/transport/capability.h"

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "lumen/transport/le.h"

namespace lumen::transport {
namespace {

// Distinct labels: a signed capability is never a valid credential, nor the reverse.
constexpr char kCapabilityLabel[8] = {'l', 'u', 'm', 'e', 'n', 'c', 'a', 'p'};
constexpr char kCredentialLabel[8] = {'l', 'u', 'm', 'e', 'n', 'w', 'i', 'd'};
static_assert(kCapabilityBytes == kSignedBytes + kEd25519SignatureBytes);
static_assert(kCredentialBytes == kSignedBytes + kEd25519SignatureBytes);

std::string to_string(const std::string& field, uint64_t got, uint64_t want) {
  return field + " is " + std::to_string(got) + ", the request says " + std::to_string(want);
}

bool all_zero(const uint8_t* bytes, size_t num_bytes) {
  bool zero = true;
  for (size_t i = 0; i < num_bytes; ++i) zero = zero && bytes[i] == 0;
  return zero;
}

void sign(const Ed25519Signer& signer, uint8_t* bytes) {
  const Ed25519Signature signature = signer.sign(bytes, kSignedBytes);
  std::memcpy(bytes + kSignedBytes, signature.data(), signature.size());
}

// The label and the signature of a signed 128-byte record; false and *why otherwise.
bool verify_signed(const Ed25519Verifier& verifier, std::string* why, const uint8_t* bytes,
                   const char (&label)[8], const char* what) {
  if (std::memcmp(bytes, label, sizeof(label)) != 0) {
    *why = std::string("not a ") + what + " (label)";
    return false;
  }
  if (!verifier.verify(bytes, kSignedBytes, bytes + kSignedBytes)) {
    *why = "bad signature: not issued by the trusted issuer";
    return false;
  }
  return true;
}

}  // namespace

CapabilityBytes CapabilityIssuer::issue(const Capability& c) const {
  if (c.rights == 0 || (c.rights & ~kAllRights) != 0) {
    throw std::invalid_argument("rights must be a non-empty set of write (1) and read (2), got " +
                                std::to_string(c.rights));
  }
  CapabilityBytes out{};
  std::memcpy(out.data(), kCapabilityLabel, sizeof(kCapabilityLabel));
  put_le<uint64_t>(out.data() + 8, c.request_id);
  put_le<uint32_t>(out.data() + 16, c.shard);
  put_le<uint32_t>(out.data() + 20, c.epoch);
  put_le<uint64_t>(out.data() + 24, c.holder_id);
  put_le<uint32_t>(out.data() + 32, c.rights);
  put_le<uint32_t>(out.data() + 36, c.bearer ? kBoundToBearer : 0u);
  put_le<uint64_t>(out.data() + 40, c.expires_at_ms);
  put_le<uint64_t>(out.data() + 48, c.bearer.value_or(0));
  sign(signer_, out.data());
  return out;
}

CredentialBytes CapabilityIssuer::issue_credential(const Credential& c) const {
  CredentialBytes out{};
  std::memcpy(out.data(), kCredentialLabel, sizeof(kCredentialLabel));
  put_le<uint64_t>(out.data() + 8, c.worker_id);
  put_le<uint32_t>(out.data() + 16, c.epoch);
  std::memcpy(out.data() + 24, c.public_key.data(), c.public_key.size());
  sign(signer_, out.data());
  return out;
}

bool CapabilityVerifier::verify(Capability* out, std::string* why,
                                const CapabilityBytes& bytes) const {
  const uint8_t* in = bytes.data();
  if (!verify_signed(verifier_, why, in, kCapabilityLabel, "capability")) return false;
  const uint32_t flags = get_le<uint32_t>(in + 36);
  const uint64_t bearer = get_le<uint64_t>(in + 48);
  if ((flags & ~kBoundToBearer) != 0 || (!(flags & kBoundToBearer) && bearer != 0) ||
      !all_zero(in + 56, kSignedBytes - 56)) {
    *why = "unknown capability flags, or reserved bytes not zero";
    return false;
  }
  out->request_id = get_le<uint64_t>(in + 8);
  out->shard = get_le<uint32_t>(in + 16);
  out->epoch = get_le<uint32_t>(in + 20);
  out->holder_id = get_le<uint64_t>(in + 24);
  out->rights = get_le<uint32_t>(in + 32);
  out->expires_at_ms = get_le<uint64_t>(in + 40);
  out->bearer = (flags & kBoundToBearer) ? std::optional<uint64_t>(bearer) : std::nullopt;
  return true;
}

bool CapabilityVerifier::verify_credential(Credential* out, std::string* why,
                                           const CredentialBytes& bytes) const {
  const uint8_t* in = bytes.data();
  if (!verify_signed(verifier_, why, in, kCredentialLabel, "worker credential")) return false;
  if (get_le<uint32_t>(in + 20) != 0 || !all_zero(in + 56, kSignedBytes - 56)) {
    *why = "reserved credential bytes are not zero";
    return false;
  }
  out->worker_id = get_le<uint64_t>(in + 8);
  out->epoch = get_le<uint32_t>(in + 16);
  std::memcpy(out->public_key.data(), in + 24, out->public_key.size());
  return true;
}

bool check_grant(std::string* why, const Capability& c, uint64_t request_id, uint32_t shard,
                 uint32_t epoch, uint64_t holder_id, uint32_t needed, uint64_t now_ms,
                 std::optional<uint64_t> peer) {
  if (c.request_id != request_id) {
    *why = to_string("capability request_id", c.request_id, request_id);
  } else if (c.shard != shard) {
    *why = to_string("capability shard", c.shard, shard);
  } else if (c.epoch != epoch) {
    *why = to_string("capability epoch", c.epoch, epoch);
  } else if (c.holder_id != holder_id) {
    *why = "capability is for holder " + std::to_string(c.holder_id) + ", this is holder " +
           std::to_string(holder_id);
  } else if ((c.rights & needed) != needed) {
    *why = "capability rights " + std::to_string(c.rights) + " lack " + std::to_string(needed);
  } else if (now_ms >= c.expires_at_ms) {
    *why = "capability expired at " + std::to_string(c.expires_at_ms) + " ms, now " +
           std::to_string(now_ms) + " ms";
  } else if (c.bearer && c.bearer != peer) {
    *why = "capability is bound to worker " + std::to_string(*c.bearer) + ", the connection is " +
           (peer ? "worker " + std::to_string(*peer) : std::string("not identified"));
  } else {
    return true;
  }
  return false;
}

uint64_t unix_now_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace lumen::transport
