// MemorySink: the minimal in-memory RecordSink (lumen/transport/sink.h).
#include <algorithm>
#include <cstring>

#include "lumen/transport/sink.h"

namespace lumen::transport {

std::unique_ptr<uint8_t[]> MemorySink::take_buffer(uint64_t bytes) {
  auto it = spare_.find(bytes);
  if (it == spare_.end() || it->second.empty()) {
    return std::unique_ptr<uint8_t[]>(new uint8_t[bytes]);  // uninitialised: received over
  }
  std::unique_ptr<uint8_t[]> buffer = std::move(it->second.back());
  it->second.pop_back();
  spare_bytes_ -= bytes;
  return buffer;
}

void MemorySink::give_buffer(uint64_t bytes, std::unique_ptr<uint8_t[]> buffer) {
  if (spare_bytes_ + bytes > kMaxSpareBytes) return;  // freed here
  spare_bytes_ += bytes;
  spare_[bytes].push_back(std::move(buffer));
}

bool MemorySink::advance_epoch(Checkpoint* checkpoint, uint32_t epoch,
                               std::vector<AppendOutcome>* outcomes) {
  if (epoch < checkpoint->epoch) return false;
  if (epoch > checkpoint->epoch) {
    abort_pending(checkpoint, Status::kStaleEpoch, outcomes);
    checkpoint->epoch = epoch;
  }
  return true;
}

Status MemorySink::open(const WireHeader& h, const uint8_t* fingerprints,
                        uint64_t* durable_tokens, std::vector<AppendOutcome>* outcomes) {
  const Key key{h.request_id, h.shard};
  auto it = checkpoints_.find(key);
  if (it == checkpoints_.end()) {
    Checkpoint checkpoint;
    checkpoint.epoch = h.epoch;
    checkpoint.record_bytes = h.record_bytes;
    checkpoint.fingerprints.assign(fingerprints, fingerprints + 2 * kFingerprintBytes);
    checkpoints_.emplace(key, std::move(checkpoint));
    *durable_tokens = 0;
    return Status::kOk;
  }
  Checkpoint& checkpoint = it->second;
  if (h.epoch < checkpoint.epoch) return Status::kStaleEpoch;
  if (h.record_bytes != checkpoint.record_bytes ||
      std::memcmp(fingerprints, checkpoint.fingerprints.data(), 2 * kFingerprintBytes) != 0) {
    return Status::kConflict;
  }
  advance_epoch(&checkpoint, h.epoch, outcomes);
  *durable_tokens = checkpoint.durable_tokens;
  return Status::kOk;
}

Status MemorySink::begin_append(const WireHeader& h, AppendTarget* target) {
  const Key key{h.request_id, h.shard};
  auto it = checkpoints_.find(key);
  if (it == checkpoints_.end()) return Status::kRejected;
  Checkpoint& checkpoint = it->second;
  if (h.epoch < checkpoint.epoch) return Status::kStaleEpoch;
  if (h.epoch > checkpoint.epoch) return Status::kRejected;
  if (h.record_bytes != checkpoint.record_bytes) return Status::kRejected;
  if (h.start_pos > checkpoint.next_pos) return Status::kRejected;  // a gap

  Pending pending;
  pending.ticket = next_ticket_++;
  pending.chunk.start_pos = h.start_pos;
  pending.chunk.num_tokens = h.num_tokens;
  pending.chunk.payload_bytes = h.payload_bytes;
  pending.chunk.payload = take_buffer(h.payload_bytes);
  target->ticket = pending.ticket;
  target->token_ids = pending.chunk.token_ids();
  target->crcs = pending.chunk.crcs();
  target->records = pending.chunk.records();
  checkpoint.next_pos = std::max(checkpoint.next_pos, h.start_pos + h.num_tokens);
  checkpoint.pending.push_back(std::move(pending));
  ticket_keys_.emplace(target->ticket, key);
  return Status::kOk;
}

const MemorySink::Chunk* MemorySink::chunk_at(const Checkpoint& checkpoint, uint64_t pos) const {
  auto it = std::upper_bound(
      checkpoint.chunks.begin(), checkpoint.chunks.end(), pos,
      [](uint64_t p, const Chunk& c) { return p < c.start_pos; });
  return &*(it - 1);  // chunks tile [0, durable) and pos < durable
}

Status MemorySink::commit(Checkpoint* checkpoint, Chunk* chunk) {
  const uint64_t end = chunk->start_pos + chunk->num_tokens;
  const uint64_t overlap_end = std::min(end, checkpoint->durable_tokens);
  for (uint64_t pos = chunk->start_pos; pos < overlap_end; ++pos) {
    const Chunk* stored = chunk_at(*checkpoint, pos);
    const uint64_t i = pos - stored->start_pos;
    const uint64_t j = pos - chunk->start_pos;
    if (stored->crcs()[i] != chunk->crcs()[j] || stored->token_ids()[i] != chunk->token_ids()[j]) {
      return Status::kConflict;
    }
  }
  if (end > checkpoint->durable_tokens) {
    // Chunks must tile the durable range: a chunk that starts inside it is kept whole but
    // indexed from where the durable range ended.
    if (chunk->start_pos < checkpoint->durable_tokens) {
      const uint64_t skip = checkpoint->durable_tokens - chunk->start_pos;
      const uint64_t keep = chunk->num_tokens - skip;
      const uint64_t record_bytes = checkpoint->record_bytes;
      std::unique_ptr<uint8_t[]> tail(new uint8_t[keep * (8 + record_bytes)]);
      auto* tokens = reinterpret_cast<uint32_t*>(tail.get());
      std::memcpy(tokens, chunk->token_ids() + skip, keep * 4);
      std::memcpy(tokens + keep, chunk->crcs() + skip, keep * 4);
      std::memcpy(tail.get() + 8 * keep, chunk->records() + skip * record_bytes,
                  keep * record_bytes);
      chunk->payload = std::move(tail);
      chunk->payload_bytes = keep * (8 + record_bytes);
      chunk->start_pos = checkpoint->durable_tokens;
      chunk->num_tokens = static_cast<uint32_t>(keep);
    }
    checkpoint->durable_tokens = end;
    checkpoint->chunks.push_back(std::move(*chunk));
  }
  return Status::kOk;
}

void MemorySink::finish_append(uint64_t ticket, bool received_ok,
                               std::vector<AppendOutcome>* outcomes) {
  if (orphans_.erase(ticket) > 0) return;  // aborted while in flight: already reported
  auto key_it = ticket_keys_.find(ticket);
  if (key_it == ticket_keys_.end()) return;
  auto it = checkpoints_.find(key_it->second);
  Checkpoint& checkpoint = it->second;
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
    Status status = pending.ok ? commit(&checkpoint, &pending.chunk) : Status::kAborted;
    outcomes->push_back({pending.ticket, status, checkpoint.durable_tokens});
    // Later appends of this checkpoint were sent after the failed one: they cannot land.
    if (status != Status::kOk) abort_pending(&checkpoint, Status::kAborted, outcomes);
  }
}

void MemorySink::abort_pending(Checkpoint* checkpoint, Status status,
                               std::vector<AppendOutcome>* outcomes) {
  for (Pending& pending : checkpoint->pending) {
    ticket_keys_.erase(pending.ticket);
    if (!pending.received) orphans_.emplace(pending.ticket, std::move(pending.chunk.payload));
    outcomes->push_back({pending.ticket, status, checkpoint->durable_tokens});
  }
  checkpoint->pending.clear();
  checkpoint->next_pos = checkpoint->durable_tokens;
}

Status MemorySink::release(const WireHeader& h, std::vector<AppendOutcome>* outcomes) {
  auto it = checkpoints_.find({h.request_id, h.shard});
  if (it == checkpoints_.end()) return Status::kRejected;
  if (h.epoch < it->second.epoch) return Status::kStaleEpoch;
  if (h.epoch > it->second.epoch) return Status::kRejected;
  abort_pending(&it->second, Status::kAborted, outcomes);
  for (Chunk& chunk : it->second.chunks) give_buffer(chunk.payload_bytes, std::move(chunk.payload));
  checkpoints_.erase(it);
  return Status::kOk;
}

Status MemorySink::read(const WireHeader& h, ReadResult* result,
                        std::vector<AppendOutcome>* outcomes) {
  auto it = checkpoints_.find({h.request_id, h.shard});
  if (it == checkpoints_.end()) return Status::kRejected;
  Checkpoint& checkpoint = it->second;
  if (!advance_epoch(&checkpoint, h.epoch, outcomes)) return Status::kStaleEpoch;
  const uint64_t start = std::min(h.start_pos, checkpoint.durable_tokens);
  const uint64_t n = std::min<uint64_t>(h.num_tokens, checkpoint.durable_tokens - start);
  const uint64_t record_bytes = checkpoint.record_bytes;
  auto payload = std::make_shared<std::vector<uint8_t>>(2 * kFingerprintBytes + n * (8 + record_bytes));
  uint8_t* out = payload->data();
  std::memcpy(out, checkpoint.fingerprints.data(), 2 * kFingerprintBytes);
  auto* tokens = reinterpret_cast<uint32_t*>(out + 2 * kFingerprintBytes);
  uint32_t* crcs = tokens + n;
  uint8_t* records = reinterpret_cast<uint8_t*>(crcs + n);
  for (uint64_t done = 0; done < n;) {
    const Chunk* chunk = chunk_at(checkpoint, start + done);
    const uint64_t i = start + done - chunk->start_pos;
    const uint64_t take = std::min<uint64_t>(chunk->num_tokens - i, n - done);
    std::memcpy(tokens + done, chunk->token_ids() + i, take * 4);
    std::memcpy(crcs + done, chunk->crcs() + i, take * 4);
    std::memcpy(records + done * record_bytes, chunk->records() + i * record_bytes,
                take * record_bytes);
    done += take;
  }
  result->start_pos = start;
  result->num_tokens = static_cast<uint32_t>(n);
  result->record_bytes = checkpoint.record_bytes;
  result->durable_tokens = checkpoint.durable_tokens;
  result->payload = std::move(payload);
  return Status::kOk;
}

}  // namespace lumen::transport
