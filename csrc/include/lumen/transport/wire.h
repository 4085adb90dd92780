// Wire format of the checkpoint data plane (docs/streaming.md): every message is one UCP active
// message whose AM header is a fixed-size, versioned, little-endian WireHeader and whose data
// is the payload. Byte layout (offsets in bytes):
//
//    0 u32 magic            'LUMN' (0x4E4D554C)
//    4 u16 version          kWireVersion
//    6 u16 kind             MessageKind
//    8 u64 request_id
//   16 u64 op_id            the sender's operation id; a reply echoes it
//   24 u32 shard
//   28 u32 epoch
//   32 u64 start_pos        first token position of an append or read
//   40 u32 num_tokens
//   44 u32 record_bytes
//   48 u64 payload_bytes    length of the AM data that follows
//   56 u64 durable_tokens   ack / read reply: durable length of the checkpoint;
//                           open: tokens the holder must reserve for it (0: none)
//   64 u32 status           reply status (Status), 0 in requests
//   68 u8[128] capability   signed by the issuer (lumen/transport/capability.h); open, read
//                           and release verify it, an append repeats its open's; zero in
//                           replies and the handshake
//  196 u32 header_crc       crc32c of bytes [0, 196)
//  200 u64 seal_seq         sequence number of the message in its direction (1, 2, ...)
//  208 u8[32] seal_mac      HMAC-SHA256 under the direction's session key of bytes [0, 208)
//                           and, but for APPEND and READ_DATA, the payload
//                           (lumen/transport/auth.h); both zero in the handshake
//
// Payloads:
//   CHALLENGE   32-byte server nonce + 32-byte server X25519 ephemeral public key
//   AUTH        32-byte client nonce + 32-byte client X25519 ephemeral public key +
//               32-byte HMAC(secret, "lumen-auth-v4-client" || transcript), then, from a
//               worker that identifies itself, its 128-byte credential and a 64-byte Ed25519
//               signature by the credential's key of "lumen-identity-v5" || transcript
//   AUTH_OK     32-byte HMAC(secret, "lumen-auth-v4-server" || transcript || limits) +
//               limits: the server's WireLimits (what it accepts in one message), 16 bytes:
//               u32 max_tokens_per_message, u32 max_record_bytes, u64 max_payload_bytes
//   (transcript: server nonce, server key, client nonce, client key)
//   OPEN        32-byte layout fingerprint + 32-byte model fingerprint
//   APPEND      token_ids u32[n] + crc32c u32[n] + records u8[n * record_bytes]
//   READ_DATA   fingerprints (64 bytes) + token_ids u32[n] + crcs u32[n] + records
//   RELEASE, READ, ACK, ERROR: none
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "lumen/transport/capability.h"

namespace lumen::transport {

constexpr uint32_t kWireMagic = 0x4E4D554Cu;  // "LUMN" in little-endian byte order
// 2: AUTH_OK announces the server's limits; 3: signed 128-byte capabilities; 4: X25519
// session keys in the handshake, every later message sealed; 5: a worker's identity in AUTH,
// capabilities bound to a worker
constexpr uint16_t kWireVersion = 5;
constexpr size_t kMacBytes = 32;
constexpr size_t kCrcOffset = 68 + kCapabilityBytes;
constexpr size_t kSealSeqOffset = kCrcOffset + 4;
constexpr size_t kSealMacOffset = kSealSeqOffset + 8;
constexpr size_t kHeaderBytes = kSealMacOffset + kMacBytes;
constexpr size_t kNonceBytes = 32;
constexpr size_t kExchangeKeyBytes = 32;  // an X25519 public or private key
constexpr size_t kFingerprintBytes = 32;
constexpr size_t kLimitsBytes = 16;  // WireLimits as AUTH_OK carries them
constexpr size_t kAuthBytes = kNonceBytes + kExchangeKeyBytes + kMacBytes;
constexpr size_t kAuthIdentifiedBytes = kAuthBytes + kCredentialBytes + kEd25519SignatureBytes;
constexpr uint16_t kAmId = 0x4C55;  // the active-message id every lumen message uses

enum class MessageKind : uint16_t {
  kChallenge = 1,
  kAuth = 2,
  kAuthOk = 3,
  kOpen = 4,
  kAppend = 5,
  kRelease = 6,
  kRead = 7,
  kAck = 8,
  kReadData = 9,
  kError = 10,
};
constexpr uint16_t kMaxKind = 10;

// Reply status codes; also the codes of TransportError. Values are part of the wire format.
enum class Status : uint32_t {
  kOk = 0,
  kRejected = 1,    // unauthenticated, bad capability, not open, gap, limit, unknown request
  kConflict = 2,    // overlapping append whose crcs differ, or open with other fingerprints
  kStaleEpoch = 3,  // epoch older than the one recorded for the request
  kMalformed = 4,   // the message failed validation
  kPeerGone = 5,    // the connection failed or was closed
  kTimeout = 6,     // the deadline passed
  kAborted = 7,     // an earlier append of the same checkpoint failed; resend from durable
};
const char* status_name(Status status);
const char* kind_name(MessageKind kind);

struct WireHeader {
  uint16_t version = kWireVersion;
  MessageKind kind = MessageKind::kError;
  uint64_t request_id = 0;
  uint64_t op_id = 0;
  uint32_t shard = 0;
  uint32_t epoch = 0;
  uint64_t start_pos = 0;
  uint32_t num_tokens = 0;
  uint32_t record_bytes = 0;
  uint64_t payload_bytes = 0;
  uint64_t durable_tokens = 0;
  Status status = Status::kOk;
  CapabilityBytes capability{};
};

// Limits the receiver enforces on every message.
struct WireLimits {
  uint32_t max_tokens_per_message = 1u << 16;
  uint32_t max_record_bytes = 1u << 24;
  uint64_t max_payload_bytes = 1ull << 30;
};

// The limits as AUTH_OK carries them (out: kLimitsBytes), and back. decode_limits returns
// false when a field is 0 (no message could be sent).
void encode_limits(uint8_t* out, const WireLimits& limits);
bool decode_limits(WireLimits* out, const uint8_t* in);
// Field by field, the smaller of a and b: what both ends accept.
WireLimits min_limits(const WireLimits& a, const WireLimits& b);

// Bytes of an APPEND payload (or the record part of READ_DATA) for n tokens; false on overflow.
bool append_payload_bytes(uint64_t* out, uint64_t num_tokens, uint64_t record_bytes);

void encode_header(uint8_t* out, const WireHeader& header);

// Decodes and validates a header received with payload_length bytes of AM data. Checks the
// length, magic, version, crc, kind, the payload length the kind requires, limits, and
// arithmetic overflow. Returns false and fills *why on the first failure. On a connection
// that encrypts, a bulk payload (APPEND, READ_DATA) carries bulk_trailer_bytes more (its GCM
// tag), outside the limits.
bool decode_header(WireHeader* out, std::string* why, const void* bytes, size_t num_bytes,
                   size_t payload_length, const WireLimits& limits, size_t bulk_trailer_bytes = 0);

}  // namespace lumen::transport
