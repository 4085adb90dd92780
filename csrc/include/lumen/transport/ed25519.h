// Ed25519 signing and verification over OpenSSL: the one home of the public-key signatures of
// the data plane (capabilities and worker credentials, lumen/transport/capability.h, and the
// identity proof of a connection's handshake, lumen/transport/auth.h).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>

namespace lumen::transport {

constexpr size_t kEd25519KeyBytes = 32;  // a private key (seed) or a public key
constexpr size_t kEd25519SignatureBytes = 64;

using Ed25519Key = std::array<uint8_t, kEd25519KeyBytes>;
using Ed25519Signature = std::array<uint8_t, kEd25519SignatureBytes>;

// A fresh random private key (OpenSSL RAND_bytes); throws std::runtime_error if it fails.
Ed25519Key generate_ed25519_key();

// Signs with one private key; holds the parsed OpenSSL key. Safe to share between threads.
class Ed25519Signer {
 public:
  // Throws std::runtime_error if OpenSSL refuses the key.
  explicit Ed25519Signer(const Ed25519Key& private_key);
  ~Ed25519Signer();
  Ed25519Signer(const Ed25519Signer&) = delete;
  Ed25519Signer& operator=(const Ed25519Signer&) = delete;

  const Ed25519Key& public_key() const { return public_key_; }
  // Throws std::runtime_error if OpenSSL fails.
  Ed25519Signature sign(const uint8_t* message, size_t num_bytes) const;

 private:
  void* pkey_ = nullptr;  // EVP_PKEY*, kept out of the header
  Ed25519Key public_key_{};
};

// Verifies against one public key.
class Ed25519Verifier {
 public:
  // Throws std::runtime_error if OpenSSL refuses the key.
  explicit Ed25519Verifier(const Ed25519Key& public_key);
  ~Ed25519Verifier();
  Ed25519Verifier(const Ed25519Verifier&) = delete;
  Ed25519Verifier& operator=(const Ed25519Verifier&) = delete;

  bool verify(const uint8_t* message, size_t num_bytes, const uint8_t* signature) const;

 private:
  void* pkey_ = nullptr;  // EVP_PKEY*
};

}  // namespace lumen::transport
