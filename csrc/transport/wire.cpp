// Encoding and validation of WireHeader (byte layout in lumen/transport/wire.h).
#include "lumen/transport/wire.h"

#include <algorithm>
#include <cstring>

#include "lumen/checksum.h"
#include "lumen/transport/le.h"

namespace lumen::transport {
namespace {

bool fail(std::string* why, const std::string& text) {
  *why = text;
  return false;
}

}  // namespace

const char* status_name(Status status) {
  switch (status) {
    case Status::kOk:
      return "ok";
    case Status::kRejected:
      return "rejected";
    case Status::kConflict:
      return "conflict";
    case Status::kStaleEpoch:
      return "stale epoch";
    case Status::kMalformed:
      return "malformed";
    case Status::kPeerGone:
      return "peer gone";
    case Status::kTimeout:
      return "timeout";
    case Status::kAborted:
      return "aborted";
  }
  return "unknown";
}

const char* kind_name(MessageKind kind) {
  switch (kind) {
    case MessageKind::kChallenge:
      return "challenge";
    case MessageKind::kAuth:
      return "auth";
    case MessageKind::kAuthOk:
      return "auth-ok";
    case MessageKind::kOpen:
      return "open";
    case MessageKind::kAppend:
      return "append";
    case MessageKind::kRelease:
      return "release";
    case MessageKind::kRead:
      return "read";
    case MessageKind::kAck:
      return "ack";
    case MessageKind::kReadData:
      return "read-data";
    case MessageKind::kError:
      return "error";
  }
  return "unknown";
}

void encode_limits(uint8_t* out, const WireLimits& limits) {
  put_le<uint32_t>(out + 0, limits.max_tokens_per_message);
  put_le<uint32_t>(out + 4, limits.max_record_bytes);
  put_le<uint64_t>(out + 8, limits.max_payload_bytes);
}

bool decode_limits(WireLimits* out, const uint8_t* in) {
  WireLimits limits;
  limits.max_tokens_per_message = get_le<uint32_t>(in + 0);
  limits.max_record_bytes = get_le<uint32_t>(in + 4);
  limits.max_payload_bytes = get_le<uint64_t>(in + 8);
  if (limits.max_tokens_per_message == 0 || limits.max_record_bytes == 0 ||
      limits.max_payload_bytes == 0) {
    return false;
  }
  *out = limits;
  return true;
}

WireLimits min_limits(const WireLimits& a, const WireLimits& b) {
  WireLimits out;
  out.max_tokens_per_message = std::min(a.max_tokens_per_message, b.max_tokens_per_message);
  out.max_record_bytes = std::min(a.max_record_bytes, b.max_record_bytes);
  out.max_payload_bytes = std::min(a.max_payload_bytes, b.max_payload_bytes);
  return out;
}

bool append_payload_bytes(uint64_t* out, uint64_t num_tokens, uint64_t record_bytes) {
  uint64_t per_token = 0;
  uint64_t total = 0;
  if (__builtin_add_overflow(record_bytes, uint64_t{8}, &per_token)) return false;
  if (__builtin_mul_overflow(num_tokens, per_token, &total)) return false;
  *out = total;
  return true;
}

void encode_header(uint8_t* out, const WireHeader& h) {
  put_le<uint32_t>(out + 0, kWireMagic);
  put_le<uint16_t>(out + 4, h.version);
  put_le<uint16_t>(out + 6, static_cast<uint16_t>(h.kind));
  put_le<uint64_t>(out + 8, h.request_id);
  put_le<uint64_t>(out + 16, h.op_id);
  put_le<uint32_t>(out + 24, h.shard);
  put_le<uint32_t>(out + 28, h.epoch);
  put_le<uint64_t>(out + 32, h.start_pos);
  put_le<uint32_t>(out + 40, h.num_tokens);
  put_le<uint32_t>(out + 44, h.record_bytes);
  put_le<uint64_t>(out + 48, h.payload_bytes);
  put_le<uint64_t>(out + 56, h.durable_tokens);
  put_le<uint32_t>(out + 64, static_cast<uint32_t>(h.status));
  std::memcpy(out + 68, h.capability.data(), kCapabilityBytes);
  put_le<uint32_t>(out + kCrcOffset, crc32c(out, kCrcOffset));
  std::memset(out + kSealSeqOffset, 0, kHeaderBytes - kSealSeqOffset);  // sealed later, if at all
}

bool decode_header(WireHeader* out, std::string* why, const void* bytes, size_t num_bytes,
                   size_t payload_length, const WireLimits& limits, size_t bulk_trailer_bytes) {
  const auto* in = static_cast<const uint8_t*>(bytes);
  if (num_bytes != kHeaderBytes) {
    return fail(why, "header is " + std::to_string(num_bytes) + " bytes, expected " +
                         std::to_string(kHeaderBytes));
  }
  if (get_le<uint32_t>(in) != kWireMagic) return fail(why, "bad magic");
  WireHeader h;
  h.version = get_le<uint16_t>(in + 4);
  if (h.version != kWireVersion) {
    return fail(why, "unsupported version " + std::to_string(h.version));
  }
  if (get_le<uint32_t>(in + kCrcOffset) != crc32c(in, kCrcOffset)) {
    return fail(why, "header crc mismatch");
  }
  const uint16_t kind = get_le<uint16_t>(in + 6);
  if (kind < 1 || kind > kMaxKind) return fail(why, "unknown kind " + std::to_string(kind));
  h.kind = static_cast<MessageKind>(kind);
  h.request_id = get_le<uint64_t>(in + 8);
  h.op_id = get_le<uint64_t>(in + 16);
  h.shard = get_le<uint32_t>(in + 24);
  h.epoch = get_le<uint32_t>(in + 28);
  h.start_pos = get_le<uint64_t>(in + 32);
  h.num_tokens = get_le<uint32_t>(in + 40);
  h.record_bytes = get_le<uint32_t>(in + 44);
  h.payload_bytes = get_le<uint64_t>(in + 48);
  h.durable_tokens = get_le<uint64_t>(in + 56);
  const uint32_t status = get_le<uint32_t>(in + 64);
  std::memcpy(h.capability.data(), in + 68, kCapabilityBytes);

  if (h.payload_bytes != payload_length) {
    return fail(why, "payload is " + std::to_string(payload_length) + " bytes, header says " +
                         std::to_string(h.payload_bytes));
  }
  const bool bulk = h.kind == MessageKind::kAppend || h.kind == MessageKind::kReadData;
  const uint64_t trailer = bulk ? bulk_trailer_bytes : 0;
  if (h.payload_bytes > limits.max_payload_bytes + trailer) {
    return fail(why, "payload over the limit");
  }
  if (h.num_tokens > limits.max_tokens_per_message) return fail(why, "num_tokens over the limit");
  if (h.record_bytes > limits.max_record_bytes) return fail(why, "record_bytes over the limit");
  uint64_t end_pos = 0;
  if (__builtin_add_overflow(h.start_pos, uint64_t{h.num_tokens}, &end_pos)) {
    return fail(why, "start_pos + num_tokens overflows");
  }
  const bool is_reply = h.kind == MessageKind::kAck || h.kind == MessageKind::kError ||
                        h.kind == MessageKind::kReadData;
  if (h.kind == MessageKind::kError) {
    if (status == 0 || status > static_cast<uint32_t>(Status::kAborted)) {
      return fail(why, "error reply with status " + std::to_string(status));
    }
  } else if (status != 0) {
    return fail(why, "non-zero status in a " + std::string(is_reply ? "reply" : "request"));
  }
  h.status = static_cast<Status>(status);

  uint64_t expected = 0;
  switch (h.kind) {
    case MessageKind::kChallenge:
      expected = kNonceBytes + kExchangeKeyBytes;
      break;
    case MessageKind::kAuthOk:
      expected = kMacBytes + kLimitsBytes;
      break;
    case MessageKind::kAuth:
      // With or without the worker's identity (its credential and proof).
      expected = h.payload_bytes == kAuthIdentifiedBytes ? kAuthIdentifiedBytes : kAuthBytes;
      break;
    case MessageKind::kOpen:
      if (h.record_bytes == 0) return fail(why, "open with record_bytes 0");
      expected = 2 * kFingerprintBytes;
      break;
    case MessageKind::kAppend:
      if (h.num_tokens == 0 || h.record_bytes == 0) return fail(why, "empty append");
      if (!append_payload_bytes(&expected, h.num_tokens, h.record_bytes)) {
        return fail(why, "append size overflows");
      }
      break;
    case MessageKind::kRead:
      if (h.num_tokens == 0) return fail(why, "read of 0 tokens");
      break;
    case MessageKind::kReadData:
      if (!append_payload_bytes(&expected, h.num_tokens, h.record_bytes)) {
        return fail(why, "read size overflows");
      }
      expected += 2 * kFingerprintBytes;
      break;
    case MessageKind::kRelease:
    case MessageKind::kAck:
    case MessageKind::kError:
      break;
  }
  expected += trailer;
  if (h.payload_bytes != expected) {
    return fail(why, "payload of " + std::to_string(h.payload_bytes) + " bytes, kind " +
                         std::to_string(kind) + " needs " + std::to_string(expected));
  }
  *out = h;
  return true;
}

}  // namespace lumen::transport
