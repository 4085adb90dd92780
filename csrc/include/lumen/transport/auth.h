// Authentication of the data plane's connections (DESIGN.md 3.3): HMAC-SHA256 (OpenSSL)
// challenge-response on the cluster secret. What a connection may do with a checkpoint is
// decided by capabilities the issuer signs (lumen/transport/capability.h), not by the secret.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "lumen/transport/wire.h"

namespace lumen::transport {

using Mac = std::array<uint8_t, kMacBytes>;
using Nonce = std::array<uint8_t, kNonceBytes>;

// Secrets shorter than this are refused: there is no default secret.
constexpr size_t kMinSecretBytes = 16;

// Throws std::invalid_argument unless secret has at least kMinSecretBytes bytes.
void check_secret(const std::string& secret);

// A fresh random nonce (OpenSSL RAND_bytes); throws std::runtime_error if it fails.
Nonce random_nonce();

// The proofs of the handshake: role is "client" or "server"; first and second are the nonces
// in the order the role uses (client: server nonce then client nonce; server: the reverse).
// The server's proof also covers what it announces with it (`announced`, announced_bytes:
// its encoded limits), so no one in between can change them.
Mac handshake_mac(const std::string& secret, const char* role, const uint8_t* first,
                  const uint8_t* second, const uint8_t* announced = nullptr,
                  size_t announced_bytes = 0);

// Constant-time comparison (CRYPTO_memcmp).
bool mac_equal(const uint8_t* a, const uint8_t* b);

}  // namespace lumen::transport
