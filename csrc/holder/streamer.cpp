// Streamer: the native checkpoint streamer (lumen/holder/streamer.h).
#include "lumen/holder/streamer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "lumen/checksum.h"
#include "lumen/gather.h"
#include "lumen/transport/error.h"

namespace lumen::holder {

using transport::Status;
using transport::TransportError;

namespace {

std::chrono::steady_clock::time_point deadline_after(double timeout_s) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(timeout_s));
}

// Records of record_bytes one append may carry under limits (0: not even one).
uint64_t tokens_per_append(const transport::WireLimits& limits, uint64_t record_bytes) {
  if (record_bytes > limits.max_record_bytes) return 0;
  return std::min<uint64_t>(limits.max_tokens_per_message,
                            limits.max_payload_bytes / (record_bytes + 8));
}

}  // namespace

Streamer::Streamer(const StreamerOptions& options)
    : options_(options), pool_(options.staging_buffers, options.staging_bytes) {
  if (options.planes.empty() || options.record_bytes == 0) {
    throw std::invalid_argument("planes: need at least one plane and record_bytes >= 1");
  }
  validate_planes(options.planes.data(), static_cast<int>(options.planes.size()),
                  options.record_bytes);
  if (options.fingerprints.size() != 2 * transport::kFingerprintBytes) {
    throw std::invalid_argument("fingerprints must be 64 bytes");
  }
  if (static_cast<uint64_t>(options.staging_bytes) < options.record_bytes) {
    throw std::invalid_argument("staging_bytes must hold at least one record");
  }
  if (options.max_queued_steps < 1) throw std::invalid_argument("max_queued_steps must be >= 1");
  if (!(options.reconnect_backoff_s > 0) || !(options.give_up_after_s > 0)) {
    throw std::invalid_argument("reconnect_backoff_s and give_up_after_s must be > 0");
  }
  if (options.cuda_device >= 0) {
    gather_ = make_cuda_step_gather(options.planes, options.record_bytes, options.cuda_device,
                                    pool_.arena(), pool_.arena_bytes(),
                                    options.staging_bytes / options.record_bytes);
  } else {
    gather_ = make_cpu_step_gather(options.planes, options.record_bytes, options.gather_threads);
  }
  thread_ = std::thread([this] { run(); });
}

Streamer::~Streamer() { close(); }

void Streamer::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Closing the clients finishes every append in flight; then their buffers may go.
  for (auto& holder : holders_) {
    if (holder->client) holder->client->close();
  }
  for (Batch& batch : batches_) pool_.release(batch.buffer);
  batches_.clear();
  changed_.notify_all();
}

Streamer::Holder* Streamer::holder_for(const HolderAddress& address) {
  for (auto& holder : holders_) {
    if (holder->address == address) return holder.get();
  }
  holders_.push_back(std::make_unique<Holder>());
  holders_.back()->address = address;
  return holders_.back().get();
}

void Streamer::add_request(uint64_t request_id, const std::vector<HolderAddress>& holders,
                           const std::vector<transport::CapabilityBytes>& capabilities,
                           uint32_t epoch, uint64_t expected_tokens) {
  if (holders.empty()) throw std::invalid_argument("holders must name at least one holder");
  if (capabilities.size() != holders.size()) {
    throw std::invalid_argument("capabilities must be one per holder (" +
                                std::to_string(holders.size()) + "), got " +
                                std::to_string(capabilities.size()));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (requests_.count(request_id) > 0) {
    throw std::invalid_argument("request_id " + std::to_string(request_id) +
                                " is already registered");
  }
  Request& request = requests_[request_id];
  request.epoch = epoch;
  request.expected_tokens = expected_tokens;
  for (size_t i = 0; i < holders.size(); ++i) {
    Replica replica;
    replica.holder = holder_for(holders[i]);
    replica.capability = capabilities[i];
    request.replicas.push_back(replica);
  }
}

uint64_t Streamer::save_step(const uint64_t* request_ids, const uint64_t* positions,
                             const int64_t* slot_ids, const uint32_t* token_ids, size_t n,
                             uintptr_t engine_stream) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopping_) throw std::runtime_error("the streamer is closed");
  // Validate every run first, so a bad step changes nothing.
  for (size_t i = 0; i < n;) {
    auto it = requests_.find(request_ids[i]);
    if (it == requests_.end()) {
      throw std::invalid_argument("request_ids: request " + std::to_string(request_ids[i]) +
                                  " was not added");
    }
    if (positions[i] > it->second.slots.size()) {
      throw std::invalid_argument("positions: request " + std::to_string(request_ids[i]) +
                                  " would have a gap at " + std::to_string(positions[i]) +
                                  " after " + std::to_string(it->second.slots.size()) +
                                  " saved tokens");
    }
    size_t j = i + 1;
    while (j < n && request_ids[j] == request_ids[i]) {
      if (positions[j] != positions[j - 1] + 1) {
        throw std::invalid_argument("positions: a request's tokens must be consecutive");
      }
      ++j;
    }
    for (size_t k = j; k < n; ++k) {
      if (request_ids[k] == request_ids[i]) {
        throw std::invalid_argument("request_ids: a request's tokens must be adjacent");
      }
    }
    i = j;
  }
  Work work;
  uint64_t tokens = 0;
  for (size_t i = 0; i < n;) {
    Request& request = requests_[request_ids[i]];
    size_t j = i;
    while (j < n && request_ids[j] == request_ids[i]) ++j;
    const uint64_t start = positions[i];
    if (start < request.slots.size()) {
      // Recomputed from an earlier position: resend from there (overlaps must match).
      request.slots.resize(start);
      request.token_ids.resize(start);
      for (Replica& replica : request.replicas) replica.sent = std::min(replica.sent, start);
    }
    request.readable_from = std::min(request.readable_from, start);
    request.slots.insert(request.slots.end(), slot_ids + i, slot_ids + j);
    request.token_ids.insert(request.token_ids.end(), token_ids + i, token_ids + j);
    work.request_ids.push_back(request_ids[i]);
    tokens += j - i;
    i = j;
  }
  stats_.tokens_saved += tokens;
  if (work.request_ids.empty()) return 0;
  auto drop = [&] {  // these tokens stay unsent (stale) until a later step finds room
    ++stats_.steps_dropped;
    stats_.tokens_dropped += tokens;
    stats_.bytes_dropped += tokens * options_.record_bytes;
  };
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queued_steps) {
    drop();
    return 0;
  }
  try {
    work.mark = gather_->mark(engine_stream);
  } catch (...) {
    drop();
    throw;
  }
  for (uint64_t id : work.request_ids) ++requests_[id].queued_steps;
  work.fence = next_fence_++;
  const uint64_t fence = work.fence;
  queue_.push_back(std::move(work));
  ++stats_.steps_enqueued;
  lock.unlock();
  wake_.notify_one();
  return fence;
}

bool Streamer::wait_for_save(uint64_t request_id, double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  const bool done = changed_.wait_until(lock, deadline_after(timeout_s), [&] {
    auto it = requests_.find(request_id);
    return it == requests_.end() || it->second.queued_steps == 0 || stopping_;
  });
  auto it = requests_.find(request_id);
  if (done && it != requests_.end()) it->second.readable_from = it->second.slots.size();
  return done;
}

bool Streamer::wait_fence(uint64_t fence, double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  return changed_.wait_until(lock, deadline_after(timeout_s),
                             [&] { return gathered_fence_ >= fence || stopping_; });
}

bool Streamer::flush(double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  return changed_.wait_until(lock, deadline_after(timeout_s),
                             [&] { return (queue_.empty() && !busy_) || stopping_; });
}

void Streamer::forget(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  requests_.erase(request_id);
  changed_.notify_all();
}

void Streamer::release(uint64_t request_id) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  Work work;
  work.request_ids.push_back(request_id);
  for (const Replica& replica : it->second.replicas) {
    // A replica on a holder that is down may still be held there: released too.
    if (!replica.lost && (replica.opened || replica.holder->down)) {
      work.releases.push_back({replica.holder, {replica.capability, it->second.epoch}});
    }
  }
  requests_.erase(it);
  if (!work.releases.empty()) queue_.push_back(std::move(work));
  lock.unlock();
  wake_.notify_one();
  changed_.notify_all();
}

void Streamer::renew(uint64_t request_id,
                     const std::vector<transport::CapabilityBytes>& capabilities) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    throw std::invalid_argument("request_id " + std::to_string(request_id) + " was not added");
  }
  std::vector<Replica>& replicas = it->second.replicas;
  if (capabilities.size() != replicas.size()) {
    throw std::invalid_argument("capabilities must be one per replica (" +
                                std::to_string(replicas.size()) + "), got " +
                                std::to_string(capabilities.size()));
  }
  for (size_t i = 0; i < replicas.size(); ++i) {
    replicas[i].capability = capabilities[i];
    replicas[i].opened = false;  // re-opened (same epoch) with it before the next append
  }
}

uint64_t Streamer::replace_holder(
    const HolderAddress& old_holder, const HolderAddress& new_holder,
    const std::map<uint64_t, transport::CapabilityBytes>& capabilities) {
  std::lock_guard<std::mutex> lock(mutex_);
  Holder* fresh = holder_for(new_holder);
  uint64_t moved = 0;
  for (auto& [id, request] : requests_) {
    for (Replica& replica : request.replicas) {
      if (!(replica.holder->address == old_holder) || replica.lost) continue;
      auto cap = capabilities.find(id);
      if (cap == capabilities.end()) {
        replica.lost = true;  // the old holder's capability is not valid on the new one
        ++stats_.replicas_lost;
        continue;
      }
      replica = Replica();
      replica.holder = fresh;
      replica.capability = cap->second;
      ++moved;
    }
  }
  ++stats_.replacements;
  return moved;
}

void Streamer::mark_down(Holder* holder) {
  if (holder->gone || holder->down) return;  // this failure is known already
  const auto now = std::chrono::steady_clock::now();
  holder->down = true;
  ++stats_.holder_failures;
  if (holder->failures++ == 0) holder->failing_since = now;
  // Re-opened on reconnection: the holder says what is durable and each replica resumes there.
  for (auto& [id, request] : requests_) {
    for (Replica& replica : request.replicas) {
      if (replica.holder == holder) replica.opened = false;
    }
  }
  if (now - holder->failing_since >= std::chrono::duration<double>(options_.give_up_after_s)) {
    holder->gone = true;
    ++stats_.holders_gone;
    for (auto& [id, request] : requests_) {
      for (Replica& replica : request.replicas) {
        if (replica.holder == holder && !replica.lost) {
          replica.lost = true;
          ++stats_.replicas_lost;
        }
      }
    }
    return;
  }
  // Doubling from reconnect_backoff_s, never beyond give_up_after_s.
  const double backoff_s = std::min(
      options_.reconnect_backoff_s * std::ldexp(1.0, std::min<uint32_t>(holder->failures - 1, 30)),
      options_.give_up_after_s);
  holder->retry_at = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                               std::chrono::duration<double>(backoff_s));
}

void Streamer::mark_up(Holder* holder) { holder->failures = 0; }

void Streamer::set_identity(const transport::Identity& identity) {
  std::lock_guard<std::mutex> lock(mutex_);
  options_.identity = identity;
}

bool Streamer::connect(Holder* holder) {
  std::shared_ptr<transport::Client> stale;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (holder->gone) return false;
    if (holder->down) {
      if (std::chrono::steady_clock::now() < holder->retry_at) return false;
      stale = std::move(holder->client);  // a stalled connection is never trusted again
    }
  }
  // Closing finishes the appends still in flight on it: their waits fail at once.
  if (stale) stale->close();
  if (holder->client && holder->client->connected()) return true;
  if (holder->client) holder->client->close();
  holder->client.reset();
  transport::ClientOptions options;
  options.address = holder->address.address;
  options.port = holder->address.port;
  options.secret = options_.secret;
  options.tls = options_.tls;
  options.limits = options_.limits;
  options.connect_timeout_s = options_.connect_timeout_s;
  options.encrypt = options_.encrypt;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    options.identity = options_.identity;
  }
  std::shared_ptr<transport::Client> client;
  try {
    client = std::make_shared<transport::Client>(options);
  } catch (const std::exception&) {
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const bool was_down = holder->down;
  holder->down = false;
  if (!client) {
    mark_down(holder);
    return false;
  }
  if (was_down) ++stats_.reconnects;
  holder->client = std::move(client);
  return true;
}

void Streamer::open_replicas(const std::vector<uint64_t>& request_ids) {
  struct ToOpen {
    uint64_t request_id;
    size_t replica;
    Holder* holder;
    transport::CapabilityBytes capability;
    uint32_t epoch;
    uint64_t expected_tokens;
  };
  std::vector<ToOpen> to_open;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (uint64_t id : request_ids) {
      auto it = requests_.find(id);
      if (it == requests_.end()) continue;
      for (size_t r = 0; r < it->second.replicas.size(); ++r) {
        const Replica& replica = it->second.replicas[r];
        if (!replica.opened && !replica.lost && !replica.holder->gone) {  // down: connect says
          to_open.push_back({id, r, replica.holder, replica.capability, it->second.epoch,
                             it->second.expected_tokens});
        }
      }
    }
  }
  for (const ToOpen& item : to_open) {
    uint64_t durable = 0;
    Status status = Status::kOk;
    if (!connect(item.holder)) {
      continue;  // down (counted there): tried again with a later step
    } else {
      try {
        // A holder whose limits cannot carry one record refuses this replica for good.
        if (tokens_per_append(item.holder->client->limits(), options_.record_bytes) == 0) {
          status = Status::kRejected;
        } else {
          durable = item.holder->client->open(item.request_id, options_.shard, item.epoch,
                                              options_.record_bytes, options_.fingerprints.data(),
                                              item.capability, item.expected_tokens,
                                              options_.ack_timeout_s);
        }
      } catch (const TransportError& e) {
        status = e.status();
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (status == Status::kPeerGone || status == Status::kTimeout) {
      mark_down(item.holder);
    } else {
      mark_up(item.holder);  // it answered
    }
    auto it = requests_.find(item.request_id);
    if (it == requests_.end() || it->second.replicas.size() <= item.replica) continue;
    Replica& replica = it->second.replicas[item.replica];
    if (replica.holder != item.holder) continue;  // moved meanwhile
    // Renewed meanwhile: the connection's grant is the old capability, so open again with the
    // new one before any append carries it (an append with another capability is refused).
    if (replica.capability != item.capability) continue;
    if (status == Status::kOk) {
      replica.opened = true;
      replica.durable = durable;
      replica.sent = std::min<uint64_t>(durable, it->second.slots.size());
    } else if (status != Status::kPeerGone && status != Status::kTimeout) {
      replica.lost = true;
      ++stats_.replicas_lost;
    }
  }
}

void Streamer::done_gathering(const std::vector<uint64_t>& request_ids) {
  for (uint64_t id : request_ids) {
    auto it = requests_.find(id);
    if (it != requests_.end() && it->second.queued_steps > 0) --it->second.queued_steps;
  }
}

void Streamer::process_step(const Work& work) {
  open_replicas(work.request_ids);
  int64_t buffer = pool_.acquire(0.0);
  while (buffer < 0 && !batches_.empty()) {
    reap_oldest();
    buffer = pool_.acquire(0.0);
  }
  const uint64_t record_bytes = options_.record_bytes;
  const uint64_t capacity = static_cast<uint64_t>(options_.staging_bytes) / record_bytes;
  // What each request sends: [from, to) of its history, to each replica from its own point.
  struct Range {
    uint64_t request_id;
    uint64_t from;
    uint64_t to;
    uint64_t offset;                                    // into the gathered records
    std::vector<std::pair<Holder*, uint64_t>> targets;  // holder, first position to send
  };
  std::vector<Range> ranges;
  std::vector<int64_t> slots;
  Batch batch;
  batch.buffer = buffer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (uint64_t id : work.request_ids) {
      auto it = requests_.find(id);
      if (it == requests_.end()) continue;
      Request& request = it->second;
      const uint64_t to = request.slots.size();
      Range range{id, to, to, slots.size(), {}};
      for (Replica& replica : request.replicas) {
        if (replica.opened && !replica.lost && replica.sent < request.readable_from) {
          replica.lost = true;  // its next records were in pages freed since
          ++stats_.replicas_lost;
        }
        if (replica.opened && !replica.lost && !replica.holder->gone && replica.sent < to) {
          range.from = std::min(range.from, replica.sent);
          range.targets.push_back({replica.holder, replica.sent});
        }
      }
      if (range.targets.empty()) continue;
      if (buffer < 0 || slots.size() + (range.to - range.from) > capacity) {
        stats_.tokens_deferred += range.to - range.from;
        stats_.bytes_dropped += (range.to - range.from) * record_bytes;
        continue;
      }
      slots.insert(slots.end(), request.slots.begin() + range.from, request.slots.end());
      batch.token_ids.insert(batch.token_ids.end(), request.token_ids.begin() + range.from,
                             request.token_ids.end());
      ranges.push_back(std::move(range));
    }
  }
  uint8_t* records = buffer >= 0 ? pool_.buffer(buffer) : nullptr;
  const auto num_tokens = static_cast<int64_t>(slots.size());
  bool gathered = true;
  try {
    gather_->gather(records, slots.data(), num_tokens, work.mark);
  } catch (const std::exception&) {
    gathered = false;  // a CUDA failure: nothing of this step is sent
  }
  if (gathered && num_tokens > 0) {
    batch.crcs.resize(slots.size());
    checksum_records(batch.crcs.data(), records, num_tokens, record_bytes, options_.gather_threads);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!gathered) {
      ++stats_.gather_failures;
      for (const Range& range : ranges) {
        stats_.tokens_deferred += range.to - range.from;
        stats_.bytes_dropped += (range.to - range.from) * record_bytes;
      }
      ranges.clear();
    }
    done_gathering(work.request_ids);
    gathered_fence_ = std::max(gathered_fence_, work.fence);
  }
  changed_.notify_all();
  for (const Range& range : ranges) {
    uint32_t epoch = 0;
    std::vector<std::pair<Holder*, transport::CapabilityBytes>> capabilities;  // by replica
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = requests_.find(range.request_id);
      if (it == requests_.end()) continue;
      epoch = it->second.epoch;
      for (const Replica& replica : it->second.replicas) {
        capabilities.push_back({replica.holder, replica.capability});
      }
    }
    for (const auto& [holder, first] : range.targets) {
      auto cap = std::find_if(capabilities.begin(), capabilities.end(),
                              [holder = holder](const auto& c) { return c.first == holder; });
      if (cap == capabilities.end()) continue;  // moved to another holder meanwhile
      const bool connected = connect(holder);
      // The holder's limits and ours (the connection has both): it opened, so at least 1.
      const uint64_t max_tokens =
          connected
              ? std::max<uint64_t>(1, tokens_per_append(holder->client->limits(), record_bytes))
              : 1;
      bool ok = connected;
      uint64_t sent_to = first;
      uint64_t started = 0;
      uint64_t started_bytes = 0;
      for (uint64_t pos = first; ok && pos < range.to;) {
        const uint64_t count = std::min(max_tokens, range.to - pos);
        const uint64_t index = range.offset + (pos - range.from);
        transport::AppendArgs args;
        args.request_id = range.request_id;
        args.shard = options_.shard;
        args.epoch = epoch;
        args.start_pos = pos;
        args.num_tokens = static_cast<uint32_t>(count);
        args.record_bytes = static_cast<uint32_t>(record_bytes);
        args.token_ids = batch.token_ids.data() + index;
        args.crcs = batch.crcs.data() + index;
        args.records = records + index * record_bytes;
        args.capability = cap->second;
        try {
          const uint64_t op_id = holder->client->start_append(args);
          batch.ops.push_back({holder, holder->client, range.request_id, op_id, pos + count,
                               count * (record_bytes + 8)});
          ++started;
          started_bytes += count * (record_bytes + 8);
          pos += count;
          sent_to = pos;
        } catch (const TransportError&) {
          ok = false;
        } catch (const std::invalid_argument&) {  // a reconnection that announced smaller limits
          ok = false;
        }
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (connected && !ok) mark_down(holder);
      stats_.appends_started += started;
      stats_.bytes_sent += started_bytes;
      auto it = requests_.find(range.request_id);
      if (it == requests_.end()) continue;
      for (Replica& replica : it->second.replicas) {
        if (replica.holder == holder && replica.sent == first) replica.sent = sent_to;
      }
    }
  }
  if (batch.ops.empty()) {
    if (buffer >= 0) pool_.release(buffer);
  } else {
    batches_.push_back(std::move(batch));
  }
}

void Streamer::reap_oldest() {
  Batch batch = std::move(batches_.front());
  batches_.pop_front();
  for (const Op& op : batch.ops) {
    uint64_t durable = 0;
    Status status = Status::kOk;
    try {
      durable = op.client->wait(op.op_id, options_.ack_timeout_s);
    } catch (const TransportError& e) {
      status = e.status();
    }
    const bool failed = status == Status::kPeerGone || status == Status::kTimeout;
    // Only the current connection speaks for the holder: an append of one replaced since
    // failed because it was closed.
    const bool current = op.client == op.holder->client;
    // The later appends on a stalled connection fail at once instead of each timing out.
    if (failed && current) op.client->close();
    std::lock_guard<std::mutex> lock(mutex_);
    if (status == Status::kOk) {
      stats_.bytes_acked += op.bytes;
    } else {
      ++stats_.appends_failed;
    }
    if (current) {
      if (failed) {
        mark_down(op.holder);
      } else {
        mark_up(op.holder);
      }
    }
    auto it = requests_.find(op.request_id);
    if (it == requests_.end()) continue;
    for (Replica& replica : it->second.replicas) {
      if (replica.holder != op.holder || replica.lost) continue;
      if (status == Status::kOk) {
        replica.durable = std::max(replica.durable, durable);
      } else if (status == Status::kAborted) {
        replica.sent = std::min(replica.sent, replica.durable);  // resend from what is durable
      } else if (!failed) {
        replica.lost = true;  // evicted, refused, conflicting or fenced
        ++stats_.replicas_lost;
      }
    }
  }
  pool_.release(batch.buffer);
}

void Streamer::process_release(const Work& work) {
  for (const auto& [holder, cap] : work.releases) {
    const bool connected = connect(holder);
    Status status = Status::kOk;
    if (connected) {
      try {
        holder->client->release(work.request_ids[0], options_.shard, cap.second, cap.first,
                                options_.ack_timeout_s);
      } catch (const TransportError& e) {
        status = e.status();
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!connected || status != Status::kOk) ++stats_.releases_failed;
    if (!connected) continue;
    if (status == Status::kPeerGone || status == Status::kTimeout) {
      mark_down(holder);
    } else {
      mark_up(holder);  // it answered
    }
  }
}

void Streamer::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    if (stopping_) break;
    if (queue_.empty()) {
      if (!batches_.empty()) {
        busy_ = true;
        lock.unlock();
        reap_oldest();
        lock.lock();
        continue;
      }
      busy_ = false;
      changed_.notify_all();
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      continue;
    }
    Work work = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    if (work.fence > 0) {
      process_step(work);
    } else {
      process_release(work);
    }
    lock.lock();
  }
  // Closing: steps not sent are dropped (their slots may be reused once close returns), but the
  // releases queued still go to holders that are connected and up, so that a finished
  // request's checkpoint does not stay on its holder until it expires. A holder that fails one
  // is marked down and skipped: at most one ack timeout a holder.
  std::deque<Work> left = std::move(queue_);
  queue_.clear();
  lock.unlock();
  for (Work& work : left) {
    if (work.fence > 0) continue;
    auto unreachable = [this](const auto& release) {
      std::lock_guard<std::mutex> guard(mutex_);
      const Holder* holder = release.first;
      return holder->gone || holder->down || !holder->client || !holder->client->connected();
    };
    auto& releases = work.releases;
    releases.erase(std::remove_if(releases.begin(), releases.end(), unreachable), releases.end());
    process_release(work);
  }
  lock.lock();
  busy_ = false;
  lock.unlock();
  changed_.notify_all();
}

StreamerStats Streamer::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

std::vector<RequestState> Streamer::requests() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<RequestState> out;
  out.reserve(requests_.size());
  for (const auto& [id, request] : requests_) {
    RequestState state;
    state.request_id = id;
    state.saved_tokens = request.slots.size();
    for (const Replica& replica : request.replicas) {
      state.replicas.push_back({replica.holder->address, replica.sent, replica.durable,
                                replica.opened && !replica.lost && !replica.holder->gone,
                                replica.lost});
    }
    out.push_back(std::move(state));
  }
  return out;
}

std::vector<HolderAddress> Streamer::gone_holders() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<HolderAddress> out;
  for (const auto& holder : holders_) {
    if (holder->gone) out.push_back(holder->address);
  }
  return out;
}

}  // namespace lumen::holder
