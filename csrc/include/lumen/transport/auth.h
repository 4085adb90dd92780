// Authentication of the data plane's connections (docs/transport.md, docs/security.md). The
// handshake is an HMAC-SHA256 (OpenSSL) challenge-response on the cluster secret over an X25519
// exchange of ephemeral keys; from the shared secret both ends derive a pair of session keys,
// and every message after the handshake is sealed: a sequence number and an HMAC-SHA256 under
// its direction's key, so a message that was altered, forged, replayed or reordered is refused.
// What a connection may do with a checkpoint is decided by capabilities the issuer signs
// (lumen/transport/capability.h), not by the secret; a worker also proves in its handshake the
// identity its credential names, which capabilities bound to it require.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "lumen/transport/wire.h"

namespace lumen::transport {

using Mac = std::array<uint8_t, kMacBytes>;
using Nonce = std::array<uint8_t, kNonceBytes>;
using ExchangeKey = std::array<uint8_t, kExchangeKeyBytes>;

// Secrets shorter than this are refused: there is no default secret.
constexpr size_t kMinSecretBytes = 16;

// Throws std::invalid_argument unless secret has at least kMinSecretBytes bytes.
void check_secret(const std::string& secret);

// A fresh random nonce (OpenSSL RAND_bytes); throws std::runtime_error if it fails.
Nonce random_nonce();

// One end's ephemeral X25519 key pair, drawn fresh for each connection.
struct EphemeralKey {
  ExchangeKey private_key{};
  ExchangeKey public_key{};
};
// Throws std::runtime_error if OpenSSL fails.
EphemeralKey generate_ephemeral_key();

// The X25519 shared secret of own_private and peer_public (also what the gateway's
// registrations exchange, lumen_core.auth). Throws std::runtime_error for a peer key OpenSSL
// refuses (a low-order point, whose shared secret would be all zeros).
ExchangeKey exchange_shared_secret(const ExchangeKey& own_private, const ExchangeKey& peer_public);

// What one handshake says, in the order the transcript covers it.
struct HandshakeTranscript {
  Nonce server_nonce{};
  ExchangeKey server_key{};  // the server's ephemeral public key (CHALLENGE)
  Nonce client_nonce{};
  ExchangeKey client_key{};  // the client's ephemeral public key (AUTH)
};

// The proofs of the handshake: HMAC(secret, "lumen-auth-v4-" role || transcript || announced),
// role "client" or "server". The server's proof also covers what it announces with it
// (`announced`, announced_bytes: its encoded limits), so no one in between can change them.
Mac handshake_mac(const std::string& secret, const char* role, const HandshakeTranscript& t,
                  const uint8_t* announced = nullptr, size_t announced_bytes = 0);

// What a worker signs with its identity key in AUTH: "lumen-identity-v5" || transcript. Both
// ephemeral keys and nonces are in it, so a proof is good for one connection only.
std::vector<uint8_t> identity_message(const HandshakeTranscript& t);

// A worker's identity on its connections: the credential the issuer signed and the private key
// whose public half the credential names.
struct Identity {
  CredentialBytes credential{};
  Ed25519Key private_key{};
};

// The keys of one connection's two directions: each seals its messages and, when the
// connection encrypts its payloads, keys AES-256-GCM for them.
struct SessionKeys {
  Mac client_to_server{};
  Mac server_to_client{};
  Mac client_to_server_cipher{};
  Mac server_to_client_cipher{};
};

// AUTH's flags (its header's start_pos): what the client asks of the connection.
constexpr uint64_t kAuthEncrypt = 1;  // bulk payloads (APPEND, READ_DATA) in AES-256-GCM
constexpr uint64_t kAuthFlags = kAuthEncrypt;

constexpr size_t kCipherTagBytes = 16;  // the GCM tag that follows an encrypted bulk payload

// A run of bytes a payload is made of (the pieces a message is sent from or received into).
struct Span {
  uint8_t* data = nullptr;
  size_t bytes = 0;
};

// AES-256-GCM (OpenSSL) of one direction's bulk payloads. The nonce is the message's seal
// sequence number, unique per direction key; a payload is authenticated by its tag (and the
// header, which names its length, by the seal). One thread at a time.
class PayloadCipher {
 public:
  PayloadCipher() = default;  // no key: encrypt and decrypt throw std::logic_error
  // Throws std::runtime_error if OpenSSL fails.
  explicit PayloadCipher(const Mac& key);
  ~PayloadCipher();
  PayloadCipher(PayloadCipher&& other) noexcept;
  PayloadCipher& operator=(PayloadCipher&& other) noexcept;
  PayloadCipher(const PayloadCipher&) = delete;
  PayloadCipher& operator=(const PayloadCipher&) = delete;

  bool keyed() const { return ctx_ != nullptr; }
  // Encrypts the pieces, in order, into out (their total size) and writes the tag.
  void encrypt(uint64_t sequence, const std::vector<Span>& pieces, uint8_t* out, uint8_t* tag);
  // Decrypts the pieces in place; false (and the pieces are garbage) unless tag verifies.
  bool decrypt(uint64_t sequence, const std::vector<Span>& pieces, const uint8_t* tag);

 private:
  void* ctx_ = nullptr;  // EVP_CIPHER_CTX*, kept out of the header
};

// AES-256-GCM on this thread: bytes per second of one encryption plus one decryption of a
// buffer of `bytes`, count times (bench/transport_bw.py). Throws std::invalid_argument for 0.
double measure_cipher_bytes_per_s(size_t bytes, uint32_t count);

// An HMAC-SHA256 key whose OpenSSL state (EVP_MAC) is prepared once, so that a message costs
// only its own hashing. One thread at a time: computing resets the state.
class MacKey {
 public:
  MacKey() = default;  // unkeyed: compute() throws std::logic_error
  // Throws std::runtime_error if OpenSSL fails.
  explicit MacKey(const Mac& key);
  ~MacKey();
  MacKey(MacKey&& other) noexcept;
  MacKey& operator=(MacKey&& other) noexcept;
  MacKey(const MacKey&) = delete;
  MacKey& operator=(const MacKey&) = delete;

  // HMAC over first || second (second_bytes may be 0); throws std::runtime_error.
  Mac compute(const uint8_t* first, size_t first_bytes, const uint8_t* second, size_t second_bytes);

 private:
  void* ctx_ = nullptr;  // EVP_MAC_CTX*, kept out of the header
};

// One end's seal of a connection: its two directions' keys and the sequence numbers sealed
// and accepted so far (the first sealed message is number 1).
struct SealState {
  MacKey send_key;
  MacKey receive_key;
  PayloadCipher send_cipher;  // keyed when the connection encrypts its bulk payloads
  PayloadCipher receive_cipher;
  uint64_t sent = 0;      // the sequence number of the last message sealed
  uint64_t received = 0;  // the sequence number of the last message accepted
};

// Both directions' keys from the X25519 shared secret of own_private and peer_public, keyed
// with the cluster secret and bound to the transcript and AUTH's flags: HMAC(HMAC(secret,
// "lumen-session-v4" || shared || transcript || flags), direction). A party that saw the
// handshake but holds neither ephemeral private key cannot derive them, whatever secret it
// holds; one that changed the flags on the way leaves the two ends with different keys, so
// the first sealed message fails. Throws std::runtime_error if OpenSSL refuses the peer's key
// (e.g. a low-order point).
SessionKeys derive_session_keys(const std::string& secret, const ExchangeKey& own_private,
                                const ExchangeKey& peer_public, const HandshakeTranscript& t,
                                uint64_t flags);

// Whether a message of this kind has its payload covered by the seal: every kind but the bulk
// ones (APPEND, READ_DATA), whose records the sender's crc32c and, on the wire, the payload
// cipher (not the seal) protect.
bool seal_covers_payload(MessageKind kind);

// Seals an encoded header (kHeaderBytes, in place) as the next message of state: writes the
// sequence number and the HMAC over header bytes [0, kSealMacOffset) and, where the kind's
// seal covers it, the payload.
void seal_header(uint8_t* header, SealState* state, const uint8_t* payload, size_t payload_bytes);

enum class SealCheck { kOk, kBadMac, kOutOfSequence };
// Checks a received, decoded header's seal against state; on kOk, state accepts its number.
// kOutOfSequence: the MAC is right but the number is not the next one (a replay or reorder).
SealCheck check_seal(const uint8_t* header, SealState* state, MessageKind kind,
                     const uint8_t* payload, size_t payload_bytes);

// Nanoseconds one seal_header plus one check_seal of a header take on this thread, the mean of
// count pairs: what sealing adds to each message on the data path (bench/transport_bw.py).
// Throws std::invalid_argument for count 0.
double measure_seal_ns(uint32_t count);

// Constant-time comparison of two MACs (CRYPTO_memcmp).
bool mac_equal(const uint8_t* a, const uint8_t* b);

}  // namespace lumen::transport
