// Where a transport server puts what it receives (docs/streaming.md). RecordSink is the seam
// between the wire protocol and a store: the server authenticates, validates and checks
// capabilities, then asks the sink to order, place and keep records. The store implementing it
// is lumen::holder::HolderStore (lumen/holder/holder_store.h). The server calls every method on
// its progress thread only.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "lumen/transport/wire.h"

namespace lumen::transport {

struct MemoryPiece {
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
};

// Where the payload of one accepted append is received; valid until finish_append(ticket).
// The records may be split over several pieces (a record may straddle two), in order.
struct AppendTarget {
  uint64_t ticket = 0;
  uint32_t* token_ids = nullptr;     // [num_tokens]
  uint32_t* crcs = nullptr;          // [num_tokens]
  std::vector<MemoryPiece> records;  // num_tokens * record_bytes bytes in all
};

// An append that became durable (kOk) or failed, reported in the order appends were begun.
struct AppendOutcome {
  uint64_t ticket = 0;
  Status status = Status::kOk;
  uint64_t durable_tokens = 0;
};

// A read's answer: the READ_DATA payload (fingerprints, token ids, crcs, records) in one
// buffer that stays valid while the reply is in flight.
struct ReadResult {
  uint64_t start_pos = 0;
  uint32_t num_tokens = 0;
  uint32_t record_bytes = 0;
  uint64_t durable_tokens = 0;
  std::shared_ptr<const std::vector<uint8_t>> payload;
};

class RecordSink {
 public:
  virtual ~RecordSink() = default;
  // Opens or re-opens (request_id, shard) at header.epoch: an older epoch than recorded is
  // kStaleEpoch; a newer one fences the old writer, whose appends still pending are settled
  // as kStaleEpoch into *outcomes; other fingerprints or record_bytes than recorded are
  // kConflict. fingerprints: 2 * kFingerprintBytes.
  virtual Status open(const WireHeader& header, const uint8_t* fingerprints,
                      uint64_t* durable_tokens, std::vector<AppendOutcome>* outcomes) = 0;
  // Checks the append's epoch (older: kStaleEpoch; not opened at it: kRejected), order (a gap
  // after what is durable or pending: kRejected) and record_bytes, and reserves its buffers.
  virtual Status begin_append(const WireHeader& header, AppendTarget* target) = 0;
  // The payload of ticket arrived intact (received_ok) or did not. Appends become durable in
  // begin order: *outcomes receives every append settled by this call. An overlap with durable
  // tokens must match their token ids and crcs (else kConflict); a failed append aborts the
  // appends of the same checkpoint begun after it (kAborted).
  virtual void finish_append(uint64_t ticket, bool received_ok,
                             std::vector<AppendOutcome>* outcomes) = 0;
  // Frees (request_id, shard); epoch rules as for begin_append. Appends still pending are
  // settled as kAborted into *outcomes.
  virtual Status release(const WireHeader& header, std::vector<AppendOutcome>* outcomes) = 0;
  // Up to header.num_tokens durable tokens from header.start_pos; an older epoch is
  // kStaleEpoch, a newer one fences the old writer as open does. Unknown checkpoint:
  // kRejected.
  virtual Status read(const WireHeader& header, ReadResult* result,
                      std::vector<AppendOutcome>* outcomes) = 0;
};

}  // namespace lumen::transport
