// Ed25519 over OpenSSL (lumen/transport/ed25519.h).
#include "lumen/transport/ed25519.h"

#include <openssl/evp.h>
#include <openssl/rand.h>

#include <memory>
#include <stdexcept>

namespace lumen::transport {
namespace {

struct MdCtxFree {
  void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
};
using MdCtx = std::unique_ptr<EVP_MD_CTX, MdCtxFree>;

MdCtx new_md_ctx() {
  MdCtx ctx(EVP_MD_CTX_new());
  if (!ctx) throw std::runtime_error("EVP_MD_CTX_new failed in OpenSSL");
  return ctx;
}

}  // namespace

Ed25519Key generate_ed25519_key() {
  Ed25519Key key{};
  if (RAND_bytes(key.data(), static_cast<int>(key.size())) != 1) {
    throw std::runtime_error("RAND_bytes failed in OpenSSL");
  }
  return key;
}

Ed25519Signer::Ed25519Signer(const Ed25519Key& private_key) {
  EVP_PKEY* pkey =
      EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, private_key.data(), kEd25519KeyBytes);
  if (pkey == nullptr) throw std::runtime_error("OpenSSL refused the Ed25519 private key");
  size_t num_bytes = kEd25519KeyBytes;
  if (EVP_PKEY_get_raw_public_key(pkey, public_key_.data(), &num_bytes) != 1 ||
      num_bytes != kEd25519KeyBytes) {
    EVP_PKEY_free(pkey);
    throw std::runtime_error("OpenSSL could not derive the Ed25519 public key");
  }
  pkey_ = pkey;
}

Ed25519Signer::~Ed25519Signer() { EVP_PKEY_free(static_cast<EVP_PKEY*>(pkey_)); }

Ed25519Signature Ed25519Signer::sign(const uint8_t* message, size_t num_bytes) const {
  Ed25519Signature signature{};
  size_t signature_bytes = signature.size();
  MdCtx ctx = new_md_ctx();
  if (EVP_DigestSignInit(ctx.get(), nullptr, nullptr, nullptr, static_cast<EVP_PKEY*>(pkey_)) !=
          1 ||
      EVP_DigestSign(ctx.get(), signature.data(), &signature_bytes, message, num_bytes) != 1 ||
      signature_bytes != signature.size()) {
    throw std::runtime_error("Ed25519 signing failed in OpenSSL");
  }
  return signature;
}

Ed25519Verifier::Ed25519Verifier(const Ed25519Key& public_key) {
  pkey_ =
      EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, nullptr, public_key.data(), kEd25519KeyBytes);
  if (pkey_ == nullptr) throw std::runtime_error("OpenSSL refused the Ed25519 public key");
}

Ed25519Verifier::~Ed25519Verifier() { EVP_PKEY_free(static_cast<EVP_PKEY*>(pkey_)); }

bool Ed25519Verifier::verify(const uint8_t* message, size_t num_bytes,
                             const uint8_t* signature) const {
  MdCtx ctx = new_md_ctx();
  return EVP_DigestVerifyInit(ctx.get(), nullptr, nullptr, nullptr,
                              static_cast<EVP_PKEY*>(pkey_)) == 1 &&
         EVP_DigestVerify(ctx.get(), signature, kEd25519SignatureBytes, message, num_bytes) == 1;
}

}  // namespace lumen::transport
