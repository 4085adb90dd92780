// Handshake proofs, X25519 session keys and message seals over OpenSSL (lumen/transport/auth.h).
#include "lumen/transport/auth.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "lumen/transport/le.h"

namespace lumen::transport {
namespace {

Mac hmac_sha256(const uint8_t* key, size_t key_bytes, const uint8_t* message,
                size_t message_bytes) {
  Mac mac{};
  unsigned int mac_len = 0;
  if (HMAC(EVP_sha256(), key, static_cast<int>(key_bytes), message, message_bytes, mac.data(),
           &mac_len) == nullptr ||
      mac_len != kMacBytes) {
    throw std::runtime_error("HMAC-SHA256 failed in OpenSSL");
  }
  return mac;
}

Mac hmac_sha256(const std::string& secret, const std::vector<uint8_t>& message) {
  return hmac_sha256(reinterpret_cast<const uint8_t*>(secret.data()), secret.size(), message.data(),
                     message.size());
}

template <size_t N>
void append(std::vector<uint8_t>* out, const std::array<uint8_t, N>& bytes) {
  out->insert(out->end(), bytes.begin(), bytes.end());
}

void append_transcript(std::vector<uint8_t>* out, const HandshakeTranscript& t) {
  append(out, t.server_nonce);
  append(out, t.server_key);
  append(out, t.client_nonce);
  append(out, t.client_key);
}

struct PkeyFree {
  void operator()(EVP_PKEY* pkey) const { EVP_PKEY_free(pkey); }
};
struct PkeyCtxFree {
  void operator()(EVP_PKEY_CTX* ctx) const { EVP_PKEY_CTX_free(ctx); }
};
using Pkey = std::unique_ptr<EVP_PKEY, PkeyFree>;
using PkeyCtx = std::unique_ptr<EVP_PKEY_CTX, PkeyCtxFree>;

}  // namespace

ExchangeKey exchange_shared_secret(const ExchangeKey& own_private, const ExchangeKey& peer_public) {
  Pkey own(EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, own_private.data(),
                                        own_private.size()));
  Pkey peer(EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, nullptr, peer_public.data(),
                                        peer_public.size()));
  if (!own || !peer) throw std::runtime_error("OpenSSL refused an X25519 key");
  PkeyCtx ctx(EVP_PKEY_CTX_new(own.get(), nullptr));
  ExchangeKey shared{};
  size_t shared_bytes = shared.size();
  // OpenSSL refuses an all-zero result (a low-order peer key) in EVP_PKEY_derive.
  if (!ctx || EVP_PKEY_derive_init(ctx.get()) != 1 ||
      EVP_PKEY_derive_set_peer(ctx.get(), peer.get()) != 1 ||
      EVP_PKEY_derive(ctx.get(), shared.data(), &shared_bytes) != 1 ||
      shared_bytes != shared.size()) {
    throw std::runtime_error("X25519 key agreement failed in OpenSSL");
  }
  return shared;
}

namespace {

// The MAC of a seal: over the header up to the MAC, then the payload if the kind's is covered.
Mac seal_mac(MacKey* key, const uint8_t* header, MessageKind kind, const uint8_t* payload,
             size_t payload_bytes) {
  const bool covered = seal_covers_payload(kind);
  return key->compute(header, kSealMacOffset, payload, covered ? payload_bytes : 0);
}

}  // namespace

MacKey::MacKey(const Mac& key) {
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  if (mac == nullptr) throw std::runtime_error("OpenSSL has no HMAC");
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(mac);
  EVP_MAC_free(mac);  // the context holds its own reference
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                               OSSL_PARAM_construct_end()};
  if (ctx == nullptr || EVP_MAC_init(ctx, key.data(), key.size(), params) != 1) {
    EVP_MAC_CTX_free(ctx);
    throw std::runtime_error("HMAC-SHA256 key setup failed in OpenSSL");
  }
  ctx_ = ctx;
}

MacKey::~MacKey() { EVP_MAC_CTX_free(static_cast<EVP_MAC_CTX*>(ctx_)); }

MacKey::MacKey(MacKey&& other) noexcept : ctx_(other.ctx_) { other.ctx_ = nullptr; }

MacKey& MacKey::operator=(MacKey&& other) noexcept {
  if (this != &other) {
    EVP_MAC_CTX_free(static_cast<EVP_MAC_CTX*>(ctx_));
    ctx_ = other.ctx_;
    other.ctx_ = nullptr;
  }
  return *this;
}

Mac MacKey::compute(const uint8_t* first, size_t first_bytes, const uint8_t* second,
                    size_t second_bytes) {
  if (ctx_ == nullptr) throw std::logic_error("MacKey used before it was keyed");
  auto* ctx = static_cast<EVP_MAC_CTX*>(ctx_);
  Mac mac{};
  size_t mac_bytes = 0;
  // A null key restarts from the state the constructor prepared (the key's inner and outer
  // pads already hashed).
  if (EVP_MAC_init(ctx, nullptr, 0, nullptr) != 1 || EVP_MAC_update(ctx, first, first_bytes) != 1 ||
      (second_bytes > 0 && EVP_MAC_update(ctx, second, second_bytes) != 1) ||
      EVP_MAC_final(ctx, mac.data(), &mac_bytes, mac.size()) != 1 || mac_bytes != kMacBytes) {
    throw std::runtime_error("HMAC-SHA256 failed in OpenSSL");
  }
  return mac;
}

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

EphemeralKey generate_ephemeral_key() {
  EphemeralKey key;
  if (RAND_bytes(key.private_key.data(), static_cast<int>(key.private_key.size())) != 1) {
    throw std::runtime_error("RAND_bytes failed in OpenSSL");
  }
  Pkey pkey(EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, key.private_key.data(),
                                         key.private_key.size()));
  size_t public_bytes = key.public_key.size();
  if (!pkey || EVP_PKEY_get_raw_public_key(pkey.get(), key.public_key.data(), &public_bytes) != 1 ||
      public_bytes != key.public_key.size()) {
    throw std::runtime_error("OpenSSL could not make an X25519 key");
  }
  return key;
}

Mac handshake_mac(const std::string& secret, const char* role, const HandshakeTranscript& t,
                  const uint8_t* announced, size_t announced_bytes) {
  const std::string label = std::string("lumen-auth-v4-") + role;
  std::vector<uint8_t> message(label.begin(), label.end());
  append_transcript(&message, t);
  if (announced_bytes > 0) message.insert(message.end(), announced, announced + announced_bytes);
  return hmac_sha256(secret, message);
}

std::vector<uint8_t> identity_message(const HandshakeTranscript& t) {
  const std::string label = "lumen-identity-v5";
  std::vector<uint8_t> message(label.begin(), label.end());
  append_transcript(&message, t);
  return message;
}

SessionKeys derive_session_keys(const std::string& secret, const ExchangeKey& own_private,
                                const ExchangeKey& peer_public, const HandshakeTranscript& t,
                                uint64_t flags) {
  const std::string label = "lumen-session-v4";
  std::vector<uint8_t> message(label.begin(), label.end());
  append(&message, exchange_shared_secret(own_private, peer_public));
  append_transcript(&message, t);
  std::array<uint8_t, 8> encoded_flags{};
  put_le<uint64_t>(encoded_flags.data(), flags);
  append(&message, encoded_flags);
  const Mac session = hmac_sha256(secret, message);
  auto direction = [&](const char* name) {
    return hmac_sha256(session.data(), session.size(), reinterpret_cast<const uint8_t*>(name),
                       std::strlen(name));
  };
  return SessionKeys{direction("client-to-server"), direction("server-to-client"),
                     direction("client-to-server-gcm"), direction("server-to-client-gcm")};
}

namespace {

// The 12-byte GCM nonce of a message: four zero bytes, then its sequence number.
std::array<uint8_t, 12> gcm_nonce(uint64_t sequence) {
  std::array<uint8_t, 12> nonce{};
  put_le<uint64_t>(nonce.data() + 4, sequence);
  return nonce;
}

// EVP's lengths are int: a piece goes through in steps of at most this.
constexpr size_t kMaxUpdateBytes = size_t{1} << 30;

// Runs `pieces` through the context's update in calls of at most kMaxUpdateBytes: the output
// goes to `out` in sequence, or over each piece in place when `out` is null.
bool update_pieces(EVP_CIPHER_CTX* ctx, const std::vector<Span>& pieces, uint8_t* out) {
  int n = 0;
  for (const Span& piece : pieces) {
    for (size_t done = 0; done < piece.bytes; done += kMaxUpdateBytes) {
      const int step = static_cast<int>(std::min(kMaxUpdateBytes, piece.bytes - done));
      uint8_t* dst = out != nullptr ? out : piece.data + done;
      if (EVP_CipherUpdate(ctx, dst, &n, piece.data + done, step) != 1 || n != step) return false;
      if (out != nullptr) out += step;
    }
  }
  return true;
}

}  // namespace

PayloadCipher::PayloadCipher(const Mac& key) {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  // Encrypt and decrypt share the key schedule; each call sets its direction and nonce.
  if (ctx == nullptr ||
      EVP_CipherInit_ex(ctx, EVP_aes_256_gcm(), nullptr, key.data(), nullptr, 1) != 1) {
    EVP_CIPHER_CTX_free(ctx);
    throw std::runtime_error("AES-256-GCM key setup failed in OpenSSL");
  }
  ctx_ = ctx;
}

PayloadCipher::~PayloadCipher() { EVP_CIPHER_CTX_free(static_cast<EVP_CIPHER_CTX*>(ctx_)); }

PayloadCipher::PayloadCipher(PayloadCipher&& other) noexcept : ctx_(other.ctx_) {
  other.ctx_ = nullptr;
}

PayloadCipher& PayloadCipher::operator=(PayloadCipher&& other) noexcept {
  if (this != &other) {
    EVP_CIPHER_CTX_free(static_cast<EVP_CIPHER_CTX*>(ctx_));
    ctx_ = other.ctx_;
    other.ctx_ = nullptr;
  }
  return *this;
}

void PayloadCipher::encrypt(uint64_t sequence, const std::vector<Span>& pieces, uint8_t* out,
                            uint8_t* tag) {
  if (ctx_ == nullptr) throw std::logic_error("PayloadCipher used before it was keyed");
  auto* ctx = static_cast<EVP_CIPHER_CTX*>(ctx_);
  const auto nonce = gcm_nonce(sequence);
  size_t total = 0;
  for (const Span& piece : pieces) total += piece.bytes;
  int n = 0;
  const bool ok = EVP_CipherInit_ex(ctx, nullptr, nullptr, nullptr, nonce.data(), 1) == 1 &&
                  update_pieces(ctx, pieces, out) &&
                  EVP_CipherFinal_ex(ctx, out + total, &n) == 1 &&
                  EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, kCipherTagBytes, tag) == 1;
  if (!ok) throw std::runtime_error("AES-256-GCM encryption failed in OpenSSL");
}

bool PayloadCipher::decrypt(uint64_t sequence, const std::vector<Span>& pieces,
                            const uint8_t* tag) {
  if (ctx_ == nullptr) throw std::logic_error("PayloadCipher used before it was keyed");
  auto* ctx = static_cast<EVP_CIPHER_CTX*>(ctx_);
  const auto nonce = gcm_nonce(sequence);
  int n = 0;
  uint8_t last[16];
  return EVP_CipherInit_ex(ctx, nullptr, nullptr, nullptr, nonce.data(), 0) == 1 &&
         update_pieces(ctx, pieces, nullptr) &&
         EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, kCipherTagBytes,
                             const_cast<uint8_t*>(tag)) == 1 &&
         EVP_CipherFinal_ex(ctx, last, &n) == 1;
}

double measure_cipher_bytes_per_s(size_t bytes, uint32_t count) {
  if (bytes == 0 || count == 0) throw std::invalid_argument("bytes and count must be >= 1");
  Mac key{};
  key.fill(7);
  PayloadCipher cipher(key);
  std::vector<uint8_t> plain(bytes, 1), sealed(bytes);
  std::array<uint8_t, kCipherTagBytes> tag{};
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t i = 0; i < count; ++i) {
    cipher.encrypt(i + 1, {{plain.data(), bytes}}, sealed.data(), tag.data());
    if (!cipher.decrypt(i + 1, {{sealed.data(), bytes}}, tag.data())) {
      throw std::runtime_error("a payload did not decrypt in measure_cipher_bytes_per_s");
    }
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return static_cast<double>(bytes) * count / elapsed.count();
}

bool seal_covers_payload(MessageKind kind) {
  return kind != MessageKind::kAppend && kind != MessageKind::kReadData;
}

void seal_header(uint8_t* header, SealState* state, const uint8_t* payload, size_t payload_bytes) {
  const auto kind = static_cast<MessageKind>(get_le<uint16_t>(header + 6));
  put_le<uint64_t>(header + kSealSeqOffset, ++state->sent);
  const Mac mac = seal_mac(&state->send_key, header, kind, payload, payload_bytes);
  std::memcpy(header + kSealMacOffset, mac.data(), kMacBytes);
}

SealCheck check_seal(const uint8_t* header, SealState* state, MessageKind kind,
                     const uint8_t* payload, size_t payload_bytes) {
  const Mac expected = seal_mac(&state->receive_key, header, kind, payload, payload_bytes);
  if (!mac_equal(expected.data(), header + kSealMacOffset)) return SealCheck::kBadMac;
  if (get_le<uint64_t>(header + kSealSeqOffset) != state->received + 1) {
    return SealCheck::kOutOfSequence;
  }
  ++state->received;
  return SealCheck::kOk;
}

double measure_seal_ns(uint32_t count) {
  if (count == 0) throw std::invalid_argument("count must be >= 1, got 0");
  WireHeader h;
  h.kind = MessageKind::kAppend;  // the data path's message: its seal covers the header alone
  std::array<uint8_t, kHeaderBytes> header{};
  encode_header(header.data(), h);
  Mac key{};
  key.fill(1);
  SealState sender;
  sender.send_key = MacKey(key);
  SealState receiver;
  receiver.receive_key = MacKey(key);
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t i = 0; i < count; ++i) {
    seal_header(header.data(), &sender, nullptr, 0);
    if (check_seal(header.data(), &receiver, h.kind, nullptr, 0) != SealCheck::kOk) {
      throw std::runtime_error("a seal did not verify in measure_seal_ns");
    }
  }
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / count;
}

bool mac_equal(const uint8_t* a, const uint8_t* b) { return CRYPTO_memcmp(a, b, kMacBytes) == 0; }

}  // namespace lumen::transport
