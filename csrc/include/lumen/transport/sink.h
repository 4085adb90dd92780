// Where a transport server puts what it receives (DESIGN.md 3.3/3.4). RecordSink is the seam
// between the wire protocol and a store: the server authenticates, validates and checks
// capabilities, then asks the sink to order, place and keep records. MemorySink is a minimal
// unbudgeted store for the protocol; the budgeted HolderStore (issue 6) implements the same
// interface. Every method runs on the server's progress thread only.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

#include "lumen/transport/wire.h"

namespace lumen::transport {

// Where the payload of one accepted append is received; valid until finish_append(ticket).
struct AppendTarget {
  uint64_t ticket = 0;
  uint32_t* token_ids = nullptr;  // [num_tokens]
  uint32_t* crcs = nullptr;       // [num_tokens]
  uint8_t* records = nullptr;     // [num_tokens * record_bytes]
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

// Keeps each append's payload as one chunk in host memory, without a budget. Buffers of
// released checkpoints are kept for reuse (up to kMaxSpareBytes): a fresh buffer costs a page
// fault per 4 KiB on the progress thread while it is being received into.
class MemorySink final : public RecordSink {
 public:
  Status open(const WireHeader& header, const uint8_t* fingerprints, uint64_t* durable_tokens,
              std::vector<AppendOutcome>* outcomes) override;
  Status begin_append(const WireHeader& header, AppendTarget* target) override;
  void finish_append(uint64_t ticket, bool received_ok,
                     std::vector<AppendOutcome>* outcomes) override;
  Status release(const WireHeader& header, std::vector<AppendOutcome>* outcomes) override;
  Status read(const WireHeader& header, ReadResult* result,
              std::vector<AppendOutcome>* outcomes) override;

 private:
  struct Chunk {
    uint64_t start_pos = 0;
    uint32_t num_tokens = 0;
    uint64_t payload_bytes = 0;
    std::unique_ptr<uint8_t[]> payload;  // token ids, crcs, records
    uint32_t* token_ids() const { return reinterpret_cast<uint32_t*>(payload.get()); }
    uint32_t* crcs() const { return token_ids() + num_tokens; }
    uint8_t* records() const { return payload.get() + 8ull * num_tokens; }
  };
  struct Pending {
    uint64_t ticket = 0;
    bool received = false;
    bool ok = false;
    Chunk chunk;
  };
  struct Checkpoint {
    uint32_t epoch = 0;
    uint32_t record_bytes = 0;
    std::vector<uint8_t> fingerprints;
    uint64_t durable_tokens = 0;
    uint64_t next_pos = 0;  // end of what is durable or pending
    std::vector<Chunk> chunks;
    std::deque<Pending> pending;
  };
  struct Key {
    uint64_t request_id;
    uint32_t shard;
    bool operator==(const Key& other) const {
      return request_id == other.request_id && shard == other.shard;
    }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const { return std::hash<uint64_t>()(k.request_id * 131 + k.shard); }
  };

  Status commit(Checkpoint* checkpoint, Chunk* chunk);
  // Settles every pending append of checkpoint as status; buffers still being received are
  // kept in orphans_ until their finish_append.
  void abort_pending(Checkpoint* checkpoint, Status status, std::vector<AppendOutcome>* outcomes);
  // Records a newer epoch (fencing the writers of older ones); false if epoch is older.
  bool advance_epoch(Checkpoint* checkpoint, uint32_t epoch, std::vector<AppendOutcome>* outcomes);
  const Chunk* chunk_at(const Checkpoint& checkpoint, uint64_t pos) const;
  std::unique_ptr<uint8_t[]> take_buffer(uint64_t bytes);
  void give_buffer(uint64_t bytes, std::unique_ptr<uint8_t[]> buffer);

  static constexpr uint64_t kMaxSpareBytes = 256ull << 20;

  std::unordered_map<Key, Checkpoint, KeyHash> checkpoints_;
  std::unordered_map<uint64_t, Key> ticket_keys_;
  std::unordered_map<uint64_t, std::unique_ptr<uint8_t[]>> orphans_;
  std::unordered_map<uint64_t, std::vector<std::unique_ptr<uint8_t[]>>> spare_;  // by size
  uint64_t spare_bytes_ = 0;
  uint64_t next_ticket_ = 1;
};

}  // namespace lumen::transport
