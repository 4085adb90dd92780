// HMAC-SHA256 handshake proofs over OpenSSL (lumen/transport/auth.h).
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
