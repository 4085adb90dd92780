// Ed25519 capabilities over OpenSSL (lumen/transport/capability.h).
#include "lumen/transport/capability.h"

#include <openssl/evp.h>
#include <openssl/rand.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "lumen/transport/le.h"

namespace lumen::transport {
namespace {

constexpr char kCapabilityLabel[8] = {'l', 'u', 'm', 'e', 'n', 'c', 'a', 'p'};
constexpr size_t kSignatureBytes = kCapabilityBytes - kSignedBytes;

struct MdCtxFree {
  void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
};
using MdCtx = std::unique_ptr<EVP_MD_CTX, MdCtxFree>;

MdCtx new_md_ctx() {
  MdCtx ctx(EVP_MD_CTX_new());
  if (!ctx) throw std::runtime_error("EVP_MD_CTX_new failed in OpenSSL");
  return ctx;
}

std::string to_string(const std::string& field, uint64_t got, uint64_t want) {
  return field + " is " + std::to_string(got) + ", the request says " + std::to_string(want);
}

}  // namespace

IssuerKey generate_issuer_key() {
  IssuerKey key{};
  if (RAND_bytes(key.data(), static_cast<int>(key.size())) != 1) {
    throw std::runtime_error("RAND_bytes failed in OpenSSL");
  }
  return key;
}

CapabilityIssuer::CapabilityIssuer(const IssuerKey& private_key) {
  EVP_PKEY* pkey =
      EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, private_key.data(), kIssuerKeyBytes);
  if (pkey == nullptr) throw std::runtime_error("OpenSSL refused the Ed25519 private key");
  size_t num_bytes = kIssuerKeyBytes;
  if (EVP_PKEY_get_raw_public_key(pkey, public_key_.data(), &num_bytes) != 1 ||
      num_bytes != kIssuerKeyBytes) {
    EVP_PKEY_free(pkey);
    throw std::runtime_error("OpenSSL could not derive the Ed25519 public key");
  }
  pkey_ = pkey;
}

CapabilityIssuer::~CapabilityIssuer() { EVP_PKEY_free(static_cast<EVP_PKEY*>(pkey_)); }

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
  put_le<uint64_t>(out.data() + 40, c.expires_at_ms);
  MdCtx ctx = new_md_ctx();
  size_t signature_bytes = kSignatureBytes;
  if (EVP_DigestSignInit(ctx.get(), nullptr, nullptr, nullptr, static_cast<EVP_PKEY*>(pkey_)) !=
          1 ||
      EVP_DigestSign(ctx.get(), out.data() + kSignedBytes, &signature_bytes, out.data(),
                     kSignedBytes) != 1 ||
      signature_bytes != kSignatureBytes) {
    throw std::runtime_error("Ed25519 signing failed in OpenSSL");
  }
  return out;
}

CapabilityVerifier::CapabilityVerifier(const IssuerKey& public_key) {
  pkey_ =
      EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, nullptr, public_key.data(), kIssuerKeyBytes);
  if (pkey_ == nullptr) throw std::runtime_error("OpenSSL refused the Ed25519 public key");
}

CapabilityVerifier::~CapabilityVerifier() { EVP_PKEY_free(static_cast<EVP_PKEY*>(pkey_)); }

bool CapabilityVerifier::verify(Capability* out, std::string* why,
                                const CapabilityBytes& bytes) const {
  const uint8_t* in = bytes.data();
  if (std::memcmp(in, kCapabilityLabel, sizeof(kCapabilityLabel)) != 0) {
    *why = "not a capability (label)";
    return false;
  }
  bool reserved_zero = get_le<uint32_t>(in + 36) == 0;
  for (size_t i = 48; i < kSignedBytes; ++i) reserved_zero = reserved_zero && in[i] == 0;
  if (!reserved_zero) {
    *why = "reserved capability bytes are not zero";
    return false;
  }
  MdCtx ctx = new_md_ctx();
  if (EVP_DigestVerifyInit(ctx.get(), nullptr, nullptr, nullptr, static_cast<EVP_PKEY*>(pkey_)) !=
          1 ||
      EVP_DigestVerify(ctx.get(), in + kSignedBytes, kSignatureBytes, in, kSignedBytes) != 1) {
    *why = "bad signature: not issued by the trusted issuer";
    return false;
  }
  out->request_id = get_le<uint64_t>(in + 8);
  out->shard = get_le<uint32_t>(in + 16);
  out->epoch = get_le<uint32_t>(in + 20);
  out->holder_id = get_le<uint64_t>(in + 24);
  out->rights = get_le<uint32_t>(in + 32);
  out->expires_at_ms = get_le<uint64_t>(in + 40);
  return true;
}

bool check_grant(std::string* why, const Capability& c, uint64_t request_id, uint32_t shard,
                 uint32_t epoch, uint64_t holder_id, uint32_t needed, uint64_t now_ms) {
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
