// The holder's store (docs/streaming.md): each (request, shard)'s token records kept in host
// memory (ChunkArena chunks, pinned where a GPU is present) with their token ids and crcs,
// under a byte budget. It is the RecordSink a
// transport Server writes into (appends in position order, overlaps checked against stored
// crcs, gaps refused, epochs fencing old writers) and the source of verified restores.
// Thread-safe: the server's progress thread and Python callers share one mutex.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "lumen/holder/chunk_arena.h"
#include "lumen/holder/cuda_restore.h"
#include "lumen/holder/record_chunks.h"
#include "lumen/slot_index.h"
#include "lumen/transport/sink.h"

namespace lumen::holder {

enum class EvictionPolicy : int { kShortestPrefix = 0, kLru = 1, kNone = 2 };

struct HolderOptions {
  uint64_t budget_bytes = UINT64_MAX;
  EvictionPolicy policy = EvictionPolicy::kShortestPrefix;
  uint64_t chunk_bytes = 2ull << 20;  // records live in chunks of this size (page multiple)
  bool pinned = false;                // page-lock the chunks (needs a CUDA device)
  uint64_t reserve_bytes = 0;         // chunks mapped at construction and kept (ChunkArena)
};

// Counters; every refusal, eviction and expiry is visible here.
struct HolderStats {
  uint64_t checkpoints = 0;
  uint64_t budget_bytes = 0;
  uint64_t bytes_charged = 0;  // sum over checkpoints of max(reserved, held) bytes, plus
                               // the memory aborted receives still write into
  uint64_t spare_bytes = 0;    // freed receive buffers kept for reuse; with bytes_charged
                               // within the budget, and the first to go when room is needed
  uint64_t bytes_held = 0;     // durable record, token id and crc bytes
  uint64_t tokens_held = 0;
  uint64_t reservations = 0;
  uint64_t reservations_refused = 0;
  uint64_t appends_refused_budget = 0;
  uint64_t gaps_refused = 0;
  uint64_t conflicts = 0;
  uint64_t evictions = 0;
  uint64_t evicted_tokens = 0;
  uint64_t evicted_bytes = 0;       // charged bytes freed by evictions
  uint64_t evictions_reserved = 0;  // of which checkpoints that held a reservation
  uint64_t expirations = 0;
  uint64_t releases = 0;
  uint64_t tokens_committed = 0;
  uint64_t appends_in_place = 0;  // received straight into the checkpoint's chunks
  uint64_t arena_bytes = 0;       // host memory mapped for records
  uint64_t arena_free_bytes = 0;  // of which free for reuse
  bool pinned = false;
};

// One checkpoint evicted to make room (HolderStore::take_evictions).
struct Eviction {
  uint64_t request_id = 0;
  uint32_t shard = 0;
  uint32_t epoch = 0;
  uint64_t durable_tokens = 0;
  uint64_t reserved_tokens = 0;
  uint64_t bytes = 0;  // its charge, freed
};

struct CheckpointInfo {
  uint64_t request_id = 0;
  uint32_t shard = 0;
  uint32_t epoch = 0;
  uint32_t record_bytes = 0;
  bool opened = false;
  uint64_t durable_tokens = 0;
  uint64_t reserved_tokens = 0;
  std::vector<uint8_t> fingerprints;  // layout then model, 2 * kFingerprintBytes (once opened)
};

// Why a restore stopped where it did.
enum class RestoreStatus : int {
  kComplete = 0,             // every durable token (up to the expected ones) restored
  kMissing = 1,              // no such checkpoint (never opened, released, evicted, expired)
  kFingerprintMismatch = 2,  // another layout or model: nothing restored
  kTokenMismatch = 3,        // a stored token id differs from the expected one
  kCrcMismatch = 4,          // a stored record no longer matches its crc
};

struct RestoreReport {
  RestoreStatus status = RestoreStatus::kMissing;
  uint64_t restored_tokens = 0;  // verified prefix written into the slots
  uint64_t durable_tokens = 0;   // what the holder had
};

class HolderStore final : public transport::RecordSink {
 public:
  explicit HolderStore(const HolderOptions& options);

  // RecordSink (lumen/transport/sink.h).
  transport::Status open(const transport::WireHeader& header, const uint8_t* fingerprints,
                         uint64_t* durable_tokens,
                         std::vector<transport::AppendOutcome>* outcomes) override;
  transport::Status begin_append(const transport::WireHeader& header,
                                 transport::AppendTarget* target) override;
  void finish_append(uint64_t ticket, bool received_ok,
                     std::vector<transport::AppendOutcome>* outcomes) override;
  transport::Status release(const transport::WireHeader& header,
                            std::vector<transport::AppendOutcome>* outcomes) override;
  transport::Status read(const transport::WireHeader& header, transport::ReadResult* result,
                         std::vector<transport::AppendOutcome>* outcomes) override;

  // Placement: charges (request_id, shard) for num_tokens records of record_bytes (raising an
  // existing reservation, never lowering it), evicting when the budget is short (see
  // make_room). False (counted, nothing changed) when the budget cannot make room, including a
  // size whose bytes overflow 64 bits.
  bool reserve(uint64_t request_id, uint32_t shard, uint64_t num_tokens, uint32_t record_bytes);
  // Drops every shard of request_id (its request is gone); number of checkpoints dropped.
  uint64_t expire(uint64_t request_id);
  // Drops checkpoints untouched for longer than max_idle_s with no append in flight.
  uint64_t expire_idle(double max_idle_s);

  HolderStats stats() const;
  // The evictions since the last call, oldest first (at most kMaxEvictionLog are kept: the
  // oldest are forgotten first; stats() counts them all).
  std::vector<Eviction> take_evictions();
  std::vector<CheckpointInfo> checkpoints() const;
  // Durable length of (request_id, shard); 0 when there is no such opened checkpoint.
  uint64_t durable_tokens(uint64_t request_id, uint32_t shard) const;

  // Verified restore into a KV cache: compares the stored fingerprints with `fingerprints`
  // (2 * kFingerprintBytes), then walks the durable prefix in position order, stopping at the
  // first token whose id differs from expected_token_ids[i] or whose record no longer matches
  // its crc (or after num_expected / num_slots tokens), and scatters the verified prefix into
  // slot_ids (each record is verified before it is written, by write_verified: no slot past
  // the verified prefix is written). planes: the cache
  // (lumen/slot_index.h), already validated by the caller.
  RestoreReport restore_into(uint64_t request_id, uint32_t shard, const uint8_t* fingerprints,
                             const uint32_t* expected_token_ids, uint64_t num_expected,
                             const PlaneDesc* planes, int num_planes, const int64_t* slot_ids,
                             uint64_t num_slots);
  // restore_into for a cache on CUDA device `device`, by the native pipeline of
  // lumen/holder/cuda_restore.h: the scatters are queued on `stream` (a cudaStream_t, 0 for the
  // default stream) and have run when this returns; the crcs are checked by num_threads
  // threads. std::runtime_error when this build has no CUDA or a CUDA call fails.
  RestoreReport restore_into_cuda(uint64_t request_id, uint32_t shard, const uint8_t* fingerprints,
                                  const uint32_t* expected_token_ids, uint64_t num_expected,
                                  const PlaneDesc* planes, int num_planes, const int64_t* slot_ids,
                                  uint64_t num_slots, int device, uintptr_t stream,
                                  int num_threads);

 private:
  struct Pending {
    uint64_t ticket = 0;
    uint64_t start_pos = 0;
    uint32_t num_tokens = 0;
    bool in_place = false;  // records received into the checkpoint's chunks
    bool received = false;
    bool ok = false;
    uint64_t buffer_bytes = 0;
    std::unique_ptr<uint8_t[]> buffer;  // token ids, crcs, and the records unless in place
    // Of buffer_bytes, what is in charged_bytes_ while the append is pending: all of an
    // append received aside (its records are mapped twice until it commits), none of one
    // in place (its token bytes are the checkpoint's own charge).
    uint64_t charged_bytes = 0;
  };
  // Chunks detached from a checkpoint while a receive may still write into them; given back
  // to the arena when the last receive that could touch them has finished.
  struct ChunkHold {
    ChunkArena* arena = nullptr;
    std::vector<uint8_t*> chunks;
    uint64_t charged_bytes = 0;  // the chunks' bytes, in charged_bytes_ until given back
    ~ChunkHold() {
      for (uint8_t* c : chunks) arena->give(c);
    }
  };
  // An append aborted while its payload was still arriving: keeps its memory alive.
  struct Orphan {
    std::unique_ptr<uint8_t[]> buffer;
    std::shared_ptr<ChunkHold> hold;
    uint64_t charged_bytes = 0;  // the buffer's bytes, in charged_bytes_ until freed
  };
  struct Checkpoint {
    uint64_t request_id = 0;
    uint32_t shard = 0;
    bool opened = false;
    uint32_t epoch = 0;
    uint32_t record_bytes = 0;
    std::vector<uint8_t> fingerprints;
    uint64_t durable_tokens = 0;
    uint64_t next_pos = 0;  // end of what is durable or pending
    uint64_t reserved_tokens = 0;
    uint64_t charged_bytes = 0;
    RecordChunks records;
    std::vector<uint32_t> token_ids;
    std::vector<uint32_t> crcs;
    std::deque<Pending> pending;
    uint64_t last_access_ns = 0;
  };
  struct Key {
    uint64_t request_id;
    uint32_t shard;
    bool operator==(const Key& other) const {
      return request_id == other.request_id && shard == other.shard;
    }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<uint64_t>()(k.request_id * 1000003ull + k.shard);
    }
  };

  static uint64_t token_bytes(uint32_t record_bytes) { return uint64_t(record_bytes) + 8; }
  // Every restore, under the lock throughout: finds the checkpoint and checks its
  // fingerprints (else the report says why), finds the prefix of at most min(durable,
  // num_expected, num_slots) tokens whose ids are the expected ones, and has
  // write(checkpoint, matching) write a verified prefix of those `matching` tokens and return
  // its length.
  template <typename Write>
  RestoreReport restore(uint64_t request_id, uint32_t shard, const uint8_t* fingerprints,
                        const uint32_t* expected_token_ids, uint64_t num_expected,
                        uint64_t num_slots, const Write& write);
  // What the bytes being charged are for: the eviction victims they may take.
  enum class Purpose { kGrowth, kReservation };
  // Sets checkpoint's charge to max(reserved, tokens) tokens, evicting others if needed;
  // false (nothing changed) when the budget cannot cover it or its bytes overflow 64 bits.
  bool charge(const Key& key, Checkpoint* checkpoint, uint64_t tokens, Purpose purpose);
  // Frees `bytes` of budget by evicting checkpoints other than `keep`, unreserved ones first
  // (by policy), then, only for a reservation, reserved ones: a reservation is a promise that
  // growth past another checkpoint's own reservation never breaks. Evicts nothing and returns
  // false when even every eligible victim would not free enough.
  bool make_room(uint64_t bytes, const Key& keep, Purpose purpose);
  // Raises checkpoint's reservation to tokens (never lowers it) and charges it; false
  // (counted, nothing changed) when the budget cannot make room.
  bool raise_reservation(const Key& key, Checkpoint* checkpoint, uint64_t tokens);
  // Opens the checkpoint at `key` that is not open yet (`placed`: its reservation entry, or
  // null), charging placement's and the opener's reservations; kRejected (counted, nothing
  // changed) when the opener's does not fit.
  transport::Status open_fresh(const transport::WireHeader& header, const uint8_t* fingerprints,
                               const Key& key, Checkpoint* placed);
  void drop(std::unordered_map<Key, Checkpoint, KeyHash>::iterator it);
  void evict(std::unordered_map<Key, Checkpoint, KeyHash>::iterator it);
  // A message for a checkpoint the store does not hold (any more): stale when that checkpoint
  // was dropped at a newer epoch, else refused.
  transport::Status absent(const Key& key, uint32_t epoch) const;
  transport::Status commit(Checkpoint* checkpoint, Pending* pending);
  void abort_pending(Checkpoint* checkpoint, transport::Status status,
                     std::vector<transport::AppendOutcome>* outcomes);
  bool advance_epoch(Checkpoint* checkpoint, uint32_t epoch,
                     std::vector<transport::AppendOutcome>* outcomes);
  std::unique_ptr<uint8_t[]> take_buffer(uint64_t bytes);
  void give_buffer(uint64_t bytes, std::unique_ptr<uint8_t[]> buffer);
  // A pending append ended (committed, failed or aborted once received): its buffer and
  // its charge return.
  void give_back(Pending* pending);

  static constexpr uint64_t kMaxSpareBytes = 256ull << 20;
  // Released, evicted or expired checkpoints whose last epoch is remembered (oldest forgotten
  // first): without it a fenced incarnation could re-open one with its old capability and
  // fill it with records a later restore would trust.
  static constexpr size_t kMaxRetiredEpochs = size_t{1} << 16;
  static constexpr size_t kMaxEvictionLog = size_t{1} << 12;

  HolderOptions options_;
  mutable std::mutex mutex_;
  ChunkArena arena_;  // outlives every checkpoint and orphan below
  std::unordered_map<Key, Checkpoint, KeyHash> checkpoints_;
  std::unordered_map<uint64_t, Key> ticket_keys_;
  std::unordered_map<Key, uint32_t, KeyHash> retired_epochs_;
  std::deque<Key> retired_order_;  // the keys of retired_epochs_, oldest first
  std::deque<Eviction> eviction_log_;
  std::unordered_map<uint64_t, Orphan> orphans_;
  std::unordered_map<uint64_t, std::vector<std::unique_ptr<uint8_t[]>>> spare_;
  uint64_t spare_bytes_ = 0;
  uint64_t next_ticket_ = 1;
  uint64_t charged_bytes_ = 0;
  HolderStats stats_;
  std::unique_ptr<CudaRestorer> cuda_restorer_;  // made by the first restore into a CUDA cache
};

}  // namespace lumen::holder
