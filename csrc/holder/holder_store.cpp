// HolderStore: the budgeted, contiguous record store of a holder (lumen/holder/holder_store.h).
#include "lumen/holder/holder_store.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "lumen/gather.h"
#include "lumen/holder/verified_write.h"
#include "lumen/holder/verify_scatter.h"

namespace lumen::holder {

using transport::AppendOutcome;
using transport::AppendTarget;
using transport::kFingerprintBytes;
using transport::Status;
using transport::WireHeader;

namespace {

// Slabs of up to 32 MiB, smaller for a small budget; two slabs' worth of free chunks stay
// mapped for reuse.
constexpr uint64_t kMaxSlabBytes = 32ull << 20;

uint64_t slab_bytes(const HolderOptions& options) {
  const uint64_t chunk = options.chunk_bytes;
  if (chunk == 0) return 0;  // refused by ChunkArena
  const uint64_t chunks_in_budget = options.budget_bytes / chunk + 1;
  return chunk * std::max<uint64_t>(1, std::min(kMaxSlabBytes / chunk, chunks_in_budget));
}

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

HolderStore::HolderStore(const HolderOptions& options)
    : options_(options),
      arena_(options.chunk_bytes, slab_bytes(options), 2 * slab_bytes(options), options.pinned,
             options.reserve_bytes) {
  stats_.budget_bytes = options.budget_bytes;
}

std::unique_ptr<uint8_t[]> HolderStore::take_buffer(uint64_t bytes) {
  auto it = spare_.find(bytes);
  if (it == spare_.end() || it->second.empty()) {
    return std::unique_ptr<uint8_t[]>(new uint8_t[bytes]);  // uninitialised: received over
  }
  std::unique_ptr<uint8_t[]> buffer = std::move(it->second.back());
  it->second.pop_back();
  spare_bytes_ -= bytes;
  return buffer;
}

void HolderStore::give_back(Pending* pending) {
  charged_bytes_ -= pending->charged_bytes;
  pending->charged_bytes = 0;
  give_buffer(pending->buffer_bytes, std::move(pending->buffer));
}

void HolderStore::give_buffer(uint64_t bytes, std::unique_ptr<uint8_t[]> buffer) {
  // Kept only within what the budget leaves free: spare buffers are mapped memory too.
  const uint64_t kept = spare_bytes_ + bytes;
  if (kept > kMaxSpareBytes || charged_bytes_ > options_.budget_bytes ||
      kept > options_.budget_bytes - charged_bytes_) {
    return;  // freed here
  }
  spare_bytes_ = kept;
  spare_[bytes].push_back(std::move(buffer));
}

bool HolderStore::make_room(uint64_t bytes, const Key& keep, Purpose purpose) {
  const uint64_t budget = options_.budget_bytes;
  auto free_bytes = [&] {
    const uint64_t used = charged_bytes_ + spare_bytes_;
    return used >= budget ? 0 : budget - used;
  };
  if (free_bytes() >= bytes) return true;
  spare_.clear();  // spare buffers give way before any checkpoint does
  spare_bytes_ = 0;
  if (free_bytes() >= bytes) return true;
  if (options_.policy == EvictionPolicy::kNone) return false;
  // A victim holds records, has nothing in flight and is not the checkpoint being grown; one
  // holding a reservation yields only to another reservation (placement's newer decision).
  auto evictable = [&](const Key& key, const Checkpoint& c) {
    return !(key == keep) && c.durable_tokens > 0 && c.pending.empty() &&
           (purpose == Purpose::kReservation || c.reserved_tokens == 0);
  };
  uint64_t reclaimable = 0;
  for (const auto& [key, c] : checkpoints_) {
    if (evictable(key, c)) reclaimable += c.charged_bytes;
  }
  if (free_bytes() + reclaimable < bytes) return false;  // evict nothing in vain
  // Unreserved checkpoints before reserved ones; within each, by policy.
  auto before = [&](const Checkpoint& a, const Checkpoint& b) {
    if ((a.reserved_tokens == 0) != (b.reserved_tokens == 0)) return a.reserved_tokens == 0;
    if (options_.policy == EvictionPolicy::kLru) return a.last_access_ns < b.last_access_ns;
    return a.durable_tokens < b.durable_tokens ||
           (a.durable_tokens == b.durable_tokens && a.last_access_ns < b.last_access_ns);
  };
  while (free_bytes() < bytes) {
    auto victim = checkpoints_.end();
    for (auto it = checkpoints_.begin(); it != checkpoints_.end(); ++it) {
      if (!evictable(it->first, it->second)) continue;
      if (victim == checkpoints_.end() || before(it->second, victim->second)) victim = it;
    }
    evict(victim);
  }
  return true;
}

bool HolderStore::charge(const Key& key, Checkpoint* checkpoint, uint64_t tokens, Purpose purpose) {
  uint64_t need = 0;
  if (__builtin_mul_overflow(std::max(tokens, checkpoint->reserved_tokens),
                             token_bytes(checkpoint->record_bytes), &need)) {
    return false;  // more than any budget
  }
  if (need <= checkpoint->charged_bytes) return true;
  const uint64_t delta = need - checkpoint->charged_bytes;
  if (!make_room(delta, key, purpose)) return false;
  charged_bytes_ += delta;
  checkpoint->charged_bytes = need;
  return true;
}

void HolderStore::evict(std::unordered_map<Key, Checkpoint, KeyHash>::iterator it) {
  const Checkpoint& c = it->second;
  ++stats_.evictions;
  stats_.evicted_tokens += c.durable_tokens;
  stats_.evicted_bytes += c.charged_bytes;
  stats_.evictions_reserved += c.reserved_tokens > 0 ? 1 : 0;
  eviction_log_.push_back(
      {c.request_id, c.shard, c.epoch, c.durable_tokens, c.reserved_tokens, c.charged_bytes});
  if (eviction_log_.size() > kMaxEvictionLog) eviction_log_.pop_front();
  drop(it);
}

void HolderStore::drop(std::unordered_map<Key, Checkpoint, KeyHash>::iterator it) {
  if (it->second.opened) {
    auto [retired, inserted] = retired_epochs_.emplace(it->first, it->second.epoch);
    if (inserted) {
      retired_order_.push_back(it->first);
      if (retired_order_.size() > kMaxRetiredEpochs) {
        retired_epochs_.erase(retired_order_.front());
        retired_order_.pop_front();
      }
    } else {
      retired->second = std::max(retired->second, it->second.epoch);
    }
  }
  charged_bytes_ -= it->second.charged_bytes;
  it->second.records.release(&arena_);
  checkpoints_.erase(it);
}

bool HolderStore::advance_epoch(Checkpoint* checkpoint, uint32_t epoch,
                                std::vector<AppendOutcome>* outcomes) {
  if (epoch < checkpoint->epoch) return false;
  if (epoch > checkpoint->epoch) {
    abort_pending(checkpoint, Status::kStaleEpoch, outcomes);
    checkpoint->epoch = epoch;
  }
  return true;
}

void HolderStore::abort_pending(Checkpoint* checkpoint, Status status,
                                std::vector<AppendOutcome>* outcomes) {
  // Receives still landing in the chunks past the durable prefix keep those chunks to
  // themselves: the checkpoint goes on in fresh ones.
  std::shared_ptr<ChunkHold> hold;
  for (const Pending& pending : checkpoint->pending) {
    if (pending.in_place && !pending.received && !hold) {
      hold = std::make_shared<ChunkHold>();
      hold->arena = &arena_;
      checkpoint->records.detach_from(&arena_, checkpoint->durable_tokens, &hold->chunks);
      // Mapped beside the chunks the checkpoint goes on in: charged until given back.
      hold->charged_bytes = hold->chunks.size() * arena_.chunk_bytes();
      charged_bytes_ += hold->charged_bytes;
    }
  }
  for (Pending& pending : checkpoint->pending) {
    ticket_keys_.erase(pending.ticket);
    if (!pending.received) {
      charged_bytes_ += pending.buffer_bytes - pending.charged_bytes;  // all of it, from here
      orphans_.emplace(pending.ticket,
                       Orphan{std::move(pending.buffer), pending.in_place ? hold : nullptr,
                              pending.buffer_bytes});
    } else {
      give_back(&pending);
    }
    outcomes->push_back({pending.ticket, status, checkpoint->durable_tokens});
  }
  checkpoint->pending.clear();
  checkpoint->next_pos = checkpoint->durable_tokens;
}

Status HolderStore::absent(const Key& key, uint32_t epoch) const {
  auto retired = retired_epochs_.find(key);
  return retired != retired_epochs_.end() && epoch < retired->second ? Status::kStaleEpoch
                                                                     : Status::kRejected;
}

Status HolderStore::open(const WireHeader& h, const uint8_t* fingerprints, uint64_t* durable_tokens,
                         std::vector<AppendOutcome>* outcomes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Key key{h.request_id, h.shard};
  auto it = checkpoints_.find(key);
  if (it == checkpoints_.end() || !it->second.opened) {
    // A checkpoint dropped at an epoch is re-created only by a newer incarnation: the writer
    // of that epoch (or an older one) must not refill what was released or evicted under it.
    auto retired = retired_epochs_.find(key);
    if (retired != retired_epochs_.end() && h.epoch <= retired->second) {
      return Status::kStaleEpoch;
    }
    *durable_tokens = 0;
    return open_fresh(h, fingerprints, key, it == checkpoints_.end() ? nullptr : &it->second);
  }
  Checkpoint& checkpoint = it->second;
  if (h.epoch < checkpoint.epoch) return Status::kStaleEpoch;
  if (h.record_bytes != checkpoint.record_bytes ||
      std::memcmp(fingerprints, checkpoint.fingerprints.data(), 2 * kFingerprintBytes) != 0) {
    ++stats_.conflicts;
    return Status::kConflict;
  }
  // The opener's reservation (placement's expected size) first: refused, the open changes
  // nothing (the current writer is not fenced).
  if (h.durable_tokens > 0 && !raise_reservation(key, &checkpoint, h.durable_tokens)) {
    return Status::kRejected;
  }
  advance_epoch(&checkpoint, h.epoch, outcomes);
  checkpoint.last_access_ns = now_ns();
  *durable_tokens = checkpoint.durable_tokens;
  return Status::kOk;
}

Status HolderStore::open_fresh(const WireHeader& h, const uint8_t* fingerprints, const Key& key,
                               Checkpoint* placed) {
  Checkpoint fresh;
  fresh.request_id = h.request_id;
  fresh.shard = h.shard;
  fresh.opened = true;
  fresh.epoch = h.epoch;
  fresh.record_bytes = h.record_bytes;
  fresh.fingerprints.assign(fingerprints, fingerprints + 2 * kFingerprintBytes);
  fresh.records = RecordChunks(h.record_bytes);
  fresh.last_access_ns = now_ns();
  // Placement's reservation is re-charged at the opener's record size (the same bytes when the
  // sizes agree), together with the opener's own; placement's is dropped if only it does not
  // fit at the new size.
  const uint64_t placed_tokens = placed != nullptr ? placed->reserved_tokens : 0;
  const uint64_t placed_bytes = placed != nullptr ? placed->charged_bytes : 0;
  charged_bytes_ -= placed_bytes;
  bool charged = false;
  for (uint64_t tokens : {std::max(placed_tokens, h.durable_tokens), h.durable_tokens}) {
    fresh.reserved_tokens = tokens;
    if ((charged = charge(key, &fresh, 0, Purpose::kReservation))) break;
  }
  if (!charged) {
    charged_bytes_ += placed_bytes;
    ++stats_.reservations_refused;
    return Status::kRejected;
  }
  if (h.durable_tokens > 0) ++stats_.reservations;
  if (placed != nullptr) {
    *placed = std::move(fresh);
  } else {
    checkpoints_.emplace(key, std::move(fresh));
  }
  return Status::kOk;
}

bool HolderStore::raise_reservation(const Key& key, Checkpoint* checkpoint, uint64_t tokens) {
  const uint64_t previous = checkpoint->reserved_tokens;
  checkpoint->reserved_tokens = std::max(previous, tokens);
  if (!charge(key, checkpoint, checkpoint->next_pos, Purpose::kReservation)) {
    checkpoint->reserved_tokens = previous;
    ++stats_.reservations_refused;
    return false;
  }
  ++stats_.reservations;
  return true;
}

Status HolderStore::begin_append(const WireHeader& h, AppendTarget* target) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Key key{h.request_id, h.shard};
  auto it = checkpoints_.find(key);
  if (it == checkpoints_.end() || !it->second.opened) return absent(key, h.epoch);
  Checkpoint& checkpoint = it->second;
  if (h.epoch < checkpoint.epoch) return Status::kStaleEpoch;
  if (h.epoch > checkpoint.epoch) return Status::kRejected;
  if (h.record_bytes != checkpoint.record_bytes) return Status::kRejected;
  if (h.start_pos > checkpoint.next_pos) {
    ++stats_.gaps_refused;
    return Status::kRejected;
  }
  const uint64_t end = std::max(checkpoint.next_pos, h.start_pos + h.num_tokens);
  const uint64_t charged_before = checkpoint.charged_bytes;
  if (!charge(key, &checkpoint, end, Purpose::kGrowth)) {
    ++stats_.appends_refused_budget;
    return Status::kRejected;
  }
  checkpoint.last_access_ns = now_ns();
  Pending pending;
  pending.ticket = next_ticket_++;
  pending.start_pos = h.start_pos;
  pending.num_tokens = h.num_tokens;
  // A plain append lands where it belongs; one that overlaps what is durable or pending is
  // received aside and compared with it on commit.
  pending.in_place = h.start_pos == checkpoint.next_pos;
  const uint64_t record_bytes = uint64_t(h.num_tokens) * h.record_bytes;
  pending.buffer_bytes = 8ull * h.num_tokens + (pending.in_place ? 0 : record_bytes);
  auto refuse = [&] {  // uncharged (what eviction made room for stays evicted)
    charged_bytes_ -= checkpoint.charged_bytes - charged_before;
    checkpoint.charged_bytes = charged_before;
    ++stats_.appends_refused_budget;
    return Status::kRejected;
  };
  if (!pending.in_place) {
    if (!make_room(pending.buffer_bytes, key, Purpose::kGrowth)) return refuse();
    pending.charged_bytes = pending.buffer_bytes;
    charged_bytes_ += pending.charged_bytes;
  }
  try {
    pending.buffer = take_buffer(pending.buffer_bytes);
    target->records.clear();
    if (pending.in_place) {
      checkpoint.records.reserve(&arena_, end);
      checkpoint.records.pieces(arena_, h.start_pos, h.num_tokens, &target->records);
    } else {
      target->records.push_back({pending.buffer.get() + 8ull * h.num_tokens, record_bytes});
    }
  } catch (const std::bad_alloc&) {
    // The host is out of memory before the budget is: the append is refused.
    charged_bytes_ -= pending.charged_bytes;
    return refuse();
  }
  stats_.appends_in_place += pending.in_place ? 1 : 0;
  target->ticket = pending.ticket;
  target->token_ids = reinterpret_cast<uint32_t*>(pending.buffer.get());
  target->crcs = target->token_ids + h.num_tokens;
  checkpoint.next_pos = end;
  checkpoint.pending.push_back(std::move(pending));
  ticket_keys_.emplace(target->ticket, key);
  return Status::kOk;
}

Status HolderStore::commit(Checkpoint* checkpoint, Pending* pending) {
  const uint32_t n = pending->num_tokens;
  const auto* token_ids = reinterpret_cast<const uint32_t*>(pending->buffer.get());
  const uint32_t* crcs = token_ids + n;
  const uint64_t start = pending->start_pos;
  const uint64_t end = start + n;
  if (pending->in_place) {  // begun at the end of what was pending: it follows the durable
    checkpoint->token_ids.insert(checkpoint->token_ids.end(), token_ids, token_ids + n);
    checkpoint->crcs.insert(checkpoint->crcs.end(), crcs, crcs + n);
    checkpoint->durable_tokens = end;
    stats_.tokens_committed += n;
    return Status::kOk;
  }
  const uint8_t* records = pending->buffer.get() + 8ull * n;
  const uint64_t overlap_end = std::min(end, checkpoint->durable_tokens);
  for (uint64_t pos = start; pos < overlap_end; ++pos) {
    if (checkpoint->crcs[pos] != crcs[pos - start] ||
        checkpoint->token_ids[pos] != token_ids[pos - start]) {
      ++stats_.conflicts;
      return Status::kConflict;
    }
  }
  if (end > checkpoint->durable_tokens) {
    const uint64_t skip = checkpoint->durable_tokens - start;
    const uint64_t keep = end - checkpoint->durable_tokens;
    const uint64_t record_bytes = checkpoint->record_bytes;
    checkpoint->records.reserve(&arena_, end);
    checkpoint->records.copy_in(arena_, checkpoint->durable_tokens, keep,
                                records + skip * record_bytes);
    checkpoint->token_ids.insert(checkpoint->token_ids.end(), token_ids + skip, token_ids + n);
    checkpoint->crcs.insert(checkpoint->crcs.end(), crcs + skip, crcs + n);
    checkpoint->durable_tokens = end;
    stats_.tokens_committed += keep;
  }
  return Status::kOk;
}

void HolderStore::finish_append(uint64_t ticket, bool received_ok,
                                std::vector<AppendOutcome>* outcomes) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto orphan = orphans_.find(ticket);
  if (orphan != orphans_.end()) {  // aborted while in flight: reported, its memory returns
    charged_bytes_ -= orphan->second.charged_bytes;
    const std::shared_ptr<ChunkHold>& hold = orphan->second.hold;
    if (hold && hold.use_count() == 1) charged_bytes_ -= hold->charged_bytes;
    orphans_.erase(orphan);
    return;
  }
  auto key_it = ticket_keys_.find(ticket);
  if (key_it == ticket_keys_.end()) return;
  Checkpoint& checkpoint = checkpoints_.find(key_it->second)->second;
  for (Pending& pending : checkpoint.pending) {
    if (pending.ticket == ticket) {
      pending.received = true;
      pending.ok = received_ok;
    }
  }
  while (!checkpoint.pending.empty() && checkpoint.pending.front().received) {
    Pending pending = std::move(checkpoint.pending.front());
    checkpoint.pending.pop_front();
    ticket_keys_.erase(pending.ticket);
    const Status status = pending.ok ? commit(&checkpoint, &pending) : Status::kAborted;
    give_back(&pending);
    outcomes->push_back({pending.ticket, status, checkpoint.durable_tokens});
    // Later appends of this checkpoint were sent after the failed one: they cannot land.
    if (status != Status::kOk) abort_pending(&checkpoint, Status::kAborted, outcomes);
  }
}

Status HolderStore::release(const WireHeader& h, std::vector<AppendOutcome>* outcomes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Key key{h.request_id, h.shard};
  auto it = checkpoints_.find(key);
  if (it == checkpoints_.end() || !it->second.opened) return absent(key, h.epoch);
  if (h.epoch < it->second.epoch) return Status::kStaleEpoch;
  if (h.epoch > it->second.epoch) return Status::kRejected;
  abort_pending(&it->second, Status::kAborted, outcomes);
  ++stats_.releases;
  drop(it);
  return Status::kOk;
}

Status HolderStore::read(const WireHeader& h, transport::ReadResult* result,
                         std::vector<AppendOutcome>* outcomes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Key key{h.request_id, h.shard};
  auto it = checkpoints_.find(key);
  if (it == checkpoints_.end() || !it->second.opened) return absent(key, h.epoch);
  Checkpoint& checkpoint = it->second;
  if (!advance_epoch(&checkpoint, h.epoch, outcomes)) return Status::kStaleEpoch;
  checkpoint.last_access_ns = now_ns();
  const uint64_t start = std::min(h.start_pos, checkpoint.durable_tokens);
  const uint64_t n = std::min<uint64_t>(h.num_tokens, checkpoint.durable_tokens - start);
  const uint64_t record_bytes = checkpoint.record_bytes;
  auto payload =
      std::make_shared<std::vector<uint8_t>>(2 * kFingerprintBytes + n * (8 + record_bytes));
  uint8_t* out = payload->data();
  std::memcpy(out, checkpoint.fingerprints.data(), 2 * kFingerprintBytes);
  auto* tokens = reinterpret_cast<uint32_t*>(out + 2 * kFingerprintBytes);
  if (n > 0) {
    std::memcpy(tokens, checkpoint.token_ids.data() + start, n * 4);
    std::memcpy(tokens + n, checkpoint.crcs.data() + start, n * 4);
    checkpoint.records.copy_out(arena_, start, n, reinterpret_cast<uint8_t*>(tokens + 2 * n));
  }
  result->start_pos = start;
  result->num_tokens = static_cast<uint32_t>(n);
  result->record_bytes = checkpoint.record_bytes;
  result->durable_tokens = checkpoint.durable_tokens;
  result->payload = std::move(payload);
  return Status::kOk;
}

bool HolderStore::reserve(uint64_t request_id, uint32_t shard, uint64_t num_tokens,
                          uint32_t record_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Key key{request_id, shard};
  auto it = checkpoints_.find(key);
  const bool fresh = it == checkpoints_.end();
  Checkpoint scratch;
  Checkpoint& checkpoint = fresh ? scratch : it->second;
  if (fresh) {
    checkpoint.request_id = request_id;
    checkpoint.shard = shard;
    checkpoint.record_bytes = record_bytes;
    checkpoint.last_access_ns = now_ns();
  }
  if (!raise_reservation(key, &checkpoint, num_tokens)) return false;
  if (fresh) checkpoints_.emplace(key, std::move(scratch));
  return true;
}

uint64_t HolderStore::expire(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t dropped = 0;
  for (auto it = checkpoints_.begin(); it != checkpoints_.end();) {
    auto next = std::next(it);
    if (it->first.request_id == request_id && it->second.pending.empty()) {
      drop(it);
      ++dropped;
    }
    it = next;
  }
  stats_.expirations += dropped;
  return dropped;
}

uint64_t HolderStore::expire_idle(double max_idle_s) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t now = now_ns();
  const auto max_idle_ns = static_cast<uint64_t>(max_idle_s * 1e9);
  uint64_t dropped = 0;
  for (auto it = checkpoints_.begin(); it != checkpoints_.end();) {
    auto next = std::next(it);
    if (it->second.pending.empty() && now - it->second.last_access_ns > max_idle_ns) {
      drop(it);
      ++dropped;
    }
    it = next;
  }
  stats_.expirations += dropped;
  return dropped;
}

std::vector<Eviction> HolderStore::take_evictions() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Eviction> out(eviction_log_.begin(), eviction_log_.end());
  eviction_log_.clear();
  return out;
}

HolderStats HolderStore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  HolderStats stats = stats_;
  stats.checkpoints = checkpoints_.size();
  stats.arena_bytes = arena_.mapped_bytes();
  stats.arena_free_bytes = arena_.free_bytes();
  stats.pinned = arena_.pinned();
  stats.bytes_charged = charged_bytes_;
  stats.spare_bytes = spare_bytes_;
  for (const auto& [key, c] : checkpoints_) {
    stats.tokens_held += c.durable_tokens;
    stats.bytes_held += c.durable_tokens * token_bytes(c.record_bytes);
  }
  return stats;
}

uint64_t HolderStore::durable_tokens(uint64_t request_id, uint32_t shard) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = checkpoints_.find({request_id, shard});
  return it == checkpoints_.end() || !it->second.opened ? 0 : it->second.durable_tokens;
}

std::vector<CheckpointInfo> HolderStore::checkpoints() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<CheckpointInfo> out;
  out.reserve(checkpoints_.size());
  for (const auto& [key, c] : checkpoints_) {
    out.push_back({c.request_id, c.shard, c.epoch, c.record_bytes, c.opened, c.durable_tokens,
                   c.reserved_tokens, c.fingerprints});
  }
  return out;
}

template <typename Write>
RestoreReport HolderStore::restore(uint64_t request_id, uint32_t shard, const uint8_t* fingerprints,
                                   const uint32_t* expected_token_ids, uint64_t num_expected,
                                   uint64_t num_slots, const Write& write) {
  std::lock_guard<std::mutex> lock(mutex_);
  RestoreReport report;
  auto it = checkpoints_.find({request_id, shard});
  if (it == checkpoints_.end() || !it->second.opened) return report;  // kMissing
  Checkpoint& checkpoint = it->second;
  checkpoint.last_access_ns = now_ns();
  report.durable_tokens = checkpoint.durable_tokens;
  if (std::memcmp(fingerprints, checkpoint.fingerprints.data(), 2 * kFingerprintBytes) != 0) {
    report.status = RestoreStatus::kFingerprintMismatch;
    return report;
  }
  const uint64_t n = std::min({checkpoint.durable_tokens, num_expected, num_slots});
  uint64_t matching = 0;
  while (matching < n && checkpoint.token_ids[matching] == expected_token_ids[matching]) {
    ++matching;
  }
  // The store's lock is held until write returns: no append, release or eviction moves the
  // records it reads.
  report.restored_tokens = write(checkpoint, matching);
  report.status = report.restored_tokens < matching ? RestoreStatus::kCrcMismatch
                  : matching < n                    ? RestoreStatus::kTokenMismatch
                                                    : RestoreStatus::kComplete;
  return report;
}

RestoreReport HolderStore::restore_into(uint64_t request_id, uint32_t shard,
                                        const uint8_t* fingerprints,
                                        const uint32_t* expected_token_ids, uint64_t num_expected,
                                        const PlaneDesc* planes, int num_planes,
                                        const int64_t* slot_ids, uint64_t num_slots) {
  return restore(
      request_id, shard, fingerprints, expected_token_ids, num_expected, num_slots,
      [&](const Checkpoint& checkpoint, uint64_t matching) {
        const uint64_t record_bytes = checkpoint.record_bytes;
        const std::vector<int> order =
            fused_plane_order(planes, num_planes, static_cast<int64_t>(record_bytes));
        auto read = [&](uint64_t i, uint8_t* scratch) {
          return checkpoint.records.record(arena_, i, scratch);
        };
        auto write = [&](const uint8_t* const* records, uint64_t first, int count) {
          if (!order.empty()) {
            // The non-temporal copy (no crcs needed: these records passed theirs).
            uint32_t crcs[3];
            scatter_with_crc(records, slot_ids + first, count, planes, order, crcs);
            return;
          }
          for (int t = 0; t < count; ++t) {
            scatter_tokens_cpu(records[t], planes, num_planes, static_cast<int64_t>(record_bytes),
                               slot_ids + first + t, 1, 1);
          }
        };
        return write_verified(matching, record_bytes, checkpoint.crcs.data(), read, write).written;
      });
}

RestoreReport HolderStore::restore_into_cuda(uint64_t request_id, uint32_t shard,
                                             const uint8_t* fingerprints,
                                             const uint32_t* expected_token_ids,
                                             uint64_t num_expected, const PlaneDesc* planes,
                                             int num_planes, const int64_t* slot_ids,
                                             uint64_t num_slots, int device, uintptr_t stream,
                                             int num_threads) {
  return restore(request_id, shard, fingerprints, expected_token_ids, num_expected, num_slots,
                 [&](const Checkpoint& checkpoint, uint64_t matching) {
                   if (cuda_restorer_ == nullptr || cuda_restorer_->device() != device) {
                     cuda_restorer_ = make_cuda_restorer(device);
                   }
                   return cuda_restorer_->restore(checkpoint.records, arena_,
                                                  checkpoint.crcs.data(), matching, planes,
                                                  num_planes, slot_ids, stream, num_threads);
                 });
}

}  // namespace lumen::holder
