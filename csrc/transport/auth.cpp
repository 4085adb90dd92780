// HMAC-SHA256 proofs and capabilities over OpenSSL (lumen/transport/auth.h).
#include "lumen/transport/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <stdexcept>
#include <vector>

namespace lumen::transport {
namespace {

Mac hmac_sha256(const std::string& secret, const std::vector<uint8_t>& message) {
  Mac mac{};
  unsigned int mac_len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), message.data(),
           message.size(), mac.data(), &mac_len) == nullptr ||
      mac_len != kMacBytes) {
    throw std::runtime_error("HMAC-SHA256 failed in OpenSSL");
  }
  return mac;
}

void append_le(std::vector<uint8_t>* out, uint64_t value, size_t num_bytes) {
  for (size_t i = 0; i < num_bytes; ++i) out->push_back(static_cast<uint8_t>(value >> (8 * i)));
}

}  // namespace

void check_secret(const std::string& secret) {
  if (secret.size() < kMinSecretBytes) {
    throw std::invalid_argument("secret must be at least " + std::to_string(kMinSecretBytes) +
                                " bytes, got " + std::to_string(secret.size()));
  }
}

Nonce random_nonce() {
  Nonce nonce{};
  if (RAND_bytes(nonce.data(), static_cast<int>(nonce.size())) != 1) {
    throw std::runtime_error("RAND_bytes failed in OpenSSL");
  }
  return nonce;
}

Mac issue_capability(const std::string& secret, uint64_t request_id, uint32_t shard,
                     uint32_t epoch) {
  static const std::string kLabel = "lumen-cap-v1";
  std::vector<uint8_t> message(kLabel.begin(), kLabel.end());
  append_le(&message, request_id, 8);
  append_le(&message, shard, 4);
  append_le(&message, epoch, 4);
  return hmac_sha256(secret, message);
}

Mac handshake_mac(const std::string& secret, const char* role, const uint8_t* first,
                  const uint8_t* second, const uint8_t* announced, size_t announced_bytes) {
  const std::string label = std::string("lumen-auth-v1-") + role;
  std::vector<uint8_t> message(label.begin(), label.end());
  message.insert(message.end(), first, first + kNonceBytes);
  message.insert(message.end(), second, second + kNonceBytes);
  if (announced_bytes > 0) message.insert(message.end(), announced, announced + announced_bytes);
  return hmac_sha256(secret, message);
}

bool mac_equal(const uint8_t* a, const uint8_t* b) { return CRYPTO_memcmp(a, b, kMacBytes) == 0; }

}  // namespace lumen::transport
