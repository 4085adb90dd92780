// The engine side of checkpoint streaming (docs/streaming.md): save_step() only records the
// step's slots and enqueues it; a background thread gathers every new record of the step with
// one gather_tokens call into a staging buffer, checksums them, and appends them to each
// request's holders (replicas) over the transport. When the queue or the staging pool is full
// or a holder is slow or gone, tokens are not sent (the request is stale from that position,
// caught up on its next step when there is room) and the engine is never blocked. A holder
// that fails (no ack in time, connection lost) is reconnected with back-off and each of its
// replicas resumes from the durable length the holder reports; one that stays unreachable for
// give_up_after_s is gone for good and its replicas are reported lost.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "lumen/holder/step_gather.h"
#include "lumen/slot_index.h"
#include "lumen/staging.h"
#include "lumen/transport/auth.h"
#include "lumen/transport/client.h"

namespace lumen::holder {

struct HolderAddress {
  std::string address;
  uint16_t port = 0;
  bool operator==(const HolderAddress& other) const {
    return address == other.address && port == other.port;
  }
};

struct StreamerOptions {
  std::string secret;
  std::string tls;
  uint32_t shard = 0;
  std::vector<PlaneDesc> planes;  // the engine's KV cache, validated by the caller
  uint32_t record_bytes = 0;
  std::vector<uint8_t> fingerprints;  // layout then model, 2 * kFingerprintBytes
  int64_t staging_buffers = 4;
  int64_t staging_bytes = 64 << 20;
  int64_t max_queued_steps = 8;
  double ack_timeout_s = 2.0;
  double connect_timeout_s = 2.0;
  double reconnect_backoff_s = 0.1;  // first wait before reconnecting; doubles per failure
  double give_up_after_s = 30.0;     // failing for this long: the holder is gone for good
  int gather_threads = 1;            // CPU cache
  int cuda_device = -1;              // the cache's CUDA device; -1: the cache is in host memory
  transport::WireLimits limits;
  std::optional<transport::Identity> identity;  // see Streamer::set_identity
  bool encrypt = false;  // appends' records in AES-256-GCM (transport::ClientOptions)
};

struct StreamerStats {
  uint64_t steps_enqueued = 0;
  uint64_t steps_dropped = 0;  // queue full: not enqueued
  uint64_t tokens_saved = 0;
  uint64_t tokens_dropped = 0;   // tokens of dropped steps
  uint64_t tokens_deferred = 0;  // left for a later step: staging buffer full
  uint64_t bytes_sent = 0;       // payload bytes of appends started
  uint64_t bytes_acked = 0;      // payload bytes of appends acknowledged durable
  uint64_t bytes_dropped = 0;    // record bytes of dropped and deferred tokens
  uint64_t appends_started = 0;
  uint64_t appends_failed = 0;
  uint64_t holders_gone = 0;     // failing for give_up_after_s: gone for good
  uint64_t holder_failures = 0;  // a holder stalled past ack_timeout_s or lost its connection
  uint64_t reconnects = 0;       // of which reconnected
  uint64_t replicas_lost = 0;    // on holders gone for good, or refused by a live holder
  uint64_t replacements = 0;
  uint64_t releases_failed = 0;
  uint64_t gather_failures = 0;  // steps whose gather failed (CUDA error): not sent
};

struct ReplicaState {
  HolderAddress holder;
  uint64_t sent_tokens = 0;
  uint64_t durable_tokens = 0;
  bool live = false;  // holder reachable and the checkpoint not refused
  bool lost = false;  // for good: refused by its holder, or the holder is gone for good
};

struct RequestState {
  uint64_t request_id = 0;
  uint64_t saved_tokens = 0;
  std::vector<ReplicaState> replicas;
};

class Streamer {
 public:
  // Throws std::invalid_argument for malformed options.
  explicit Streamer(const StreamerOptions& options);
  ~Streamer();
  Streamer(const Streamer&) = delete;
  Streamer& operator=(const Streamer&) = delete;

  // Registers a request, its holders (replicas) and, for each holder, its capability of
  // (request_id, shard, epoch) (a capability names the one holder it is valid on); each holder
  // is asked to reserve expected_tokens records when it is opened (a refusal loses that
  // replica). std::invalid_argument if it is already registered, has no holder, or not one
  // capability per holder.
  void add_request(uint64_t request_id, const std::vector<HolderAddress>& holders,
                   const std::vector<transport::CapabilityBytes>& capabilities, uint32_t epoch,
                   uint64_t expected_tokens);
  // Renews request_id's capabilities (one per replica, in add_request's order; the same
  // epoch with a later expiry): each replica re-opens its checkpoint with the new one before
  // its next append, which renews the holder's grant (appends already sent keep the old one).
  // std::invalid_argument: unknown request, or not one capability per replica.
  void renew(uint64_t request_id, const std::vector<transport::CapabilityBytes>& capabilities);
  // The worker identity connections opened from now on prove (each registration brings a new
  // credential); connections already open keep theirs.
  void set_identity(const transport::Identity& identity);
  // n tokens: request_ids[i] wrote position positions[i] (token token_ids[i]) into slot
  // slot_ids[i]; a request's tokens are consecutive positions. On a CUDA cache the step is
  // gathered after the work queued so far on engine_stream (the stream that wrote its KV; 0:
  // the default stream). Returns the step's fence (0 if the step was dropped).
  // std::invalid_argument: unknown request, a gap, non-consecutive; std::runtime_error: CUDA
  // refused to mark the engine's stream (the step is dropped).
  uint64_t save_step(const uint64_t* request_ids, const uint64_t* positions,
                     const int64_t* slot_ids, const uint32_t* token_ids, size_t n,
                     uintptr_t engine_stream = 0);
  // True once no queued step still has to read request_id's pages (false on timeout). The
  // engine may then free them: what was saved so far is never read again (a replica still
  // behind it is lost) until a save rewrites those positions.
  bool wait_for_save(uint64_t request_id, double timeout_s);
  // True once the step of `fence` has been gathered.
  bool wait_fence(uint64_t fence, double timeout_s);
  // True once every queued step is sent and every append answered.
  bool flush(double timeout_s);
  // Forgets request_id and frees its checkpoints on its holders (in the background; close
  // still sends the releases queued to holders that are up).
  void release(uint64_t request_id);
  // Forgets request_id; its checkpoints stay on its holders for whoever granted them to
  // release (a gateway that has not yet learned the request ended may restore from them).
  void forget(uint64_t request_id);
  // Moves every replica on `old_holder` to `new_holder`, with the capability for the new
  // holder in capabilities (by request id); the full saved prefix is re-streamed from the
  // engine's cache with each request's next step. A replica of a request with no capability
  // given is lost. Returns the requests moved.
  uint64_t replace_holder(const HolderAddress& old_holder, const HolderAddress& new_holder,
                          const std::map<uint64_t, transport::CapabilityBytes>& capabilities);

  StreamerStats stats() const;
  std::vector<RequestState> requests() const;
  std::vector<HolderAddress> gone_holders() const;
  void close();

 private:
  struct Holder {
    HolderAddress address;
    // Streamer thread only; shared with the appends started on it, which a replacement
    // client must not strand.
    std::shared_ptr<transport::Client> client;
    bool gone = false;      // for good
    bool down = false;      // failed; reconnected at retry_at
    uint32_t failures = 0;  // consecutive, since the last open or ack
    std::chrono::steady_clock::time_point failing_since{};
    std::chrono::steady_clock::time_point retry_at{};
  };
  struct Replica {
    Holder* holder = nullptr;
    transport::CapabilityBytes capability{};  // valid on this holder only
    bool opened = false;
    bool lost = false;
    uint64_t sent = 0;
    uint64_t durable = 0;
  };
  struct Request {
    uint32_t epoch = 0;
    uint64_t expected_tokens = 0;  // reserved on each holder at open
    std::vector<int64_t> slots;    // by position
    std::vector<uint32_t> token_ids;
    std::vector<Replica> replicas;
    uint64_t queued_steps = 0;  // steps that still have to gather its pages
    // Positions below this may live in freed pages (wait_for_save was called before a free):
    // a replica that has not sent them cannot catch up any more.
    uint64_t readable_from = 0;
  };
  struct Work {
    uint64_t fence = 0;  // a step (> 0) or a release (0)
    uint64_t mark = 0;   // a step's point on the engine's stream (StepGather)
    std::vector<uint64_t> request_ids;
    // a release: (holder, capability, epoch) of each replica of request_ids[0]
    std::vector<std::pair<Holder*, std::pair<transport::CapabilityBytes, uint32_t>>> releases;
  };
  struct Op {
    Holder* holder = nullptr;
    std::shared_ptr<transport::Client> client;  // the one it was started on
    uint64_t request_id = 0;
    uint64_t op_id = 0;
    uint64_t end = 0;
    uint64_t bytes = 0;
  };
  struct Batch {
    int64_t buffer = -1;
    std::vector<uint32_t> token_ids;
    std::vector<uint32_t> crcs;
    std::vector<Op> ops;
  };

  Holder* holder_for(const HolderAddress& address);  // mutex_ held
  void run();
  void process_step(const Work& work);
  void process_release(const Work& work);
  void open_replicas(const std::vector<uint64_t>& request_ids);
  // Streamer thread. False while the holder is down and not due for a retry, or when the
  // connection attempt fails (the holder stays down).
  bool connect(Holder* holder);
  void reap_oldest();
  // mutex_ held. The holder failed: its replicas re-open on reconnection, which is tried after
  // a back-off; failing for give_up_after_s it is gone for good and its replicas are lost.
  void mark_down(Holder* holder);
  // mutex_ held. The holder answered: it is healthy again.
  void mark_up(Holder* holder);
  void done_gathering(const std::vector<uint64_t>& request_ids);

  StreamerOptions options_;
  StagingPool pool_;
  std::unique_ptr<StepGather> gather_;
  std::deque<Batch> batches_;  // streamer thread only
  std::vector<std::unique_ptr<Holder>> holders_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;     // work queued or stopping
  std::condition_variable changed_;  // progress for the waits
  std::deque<Work> queue_;
  std::unordered_map<uint64_t, Request> requests_;
  StreamerStats stats_;
  uint64_t next_fence_ = 1;
  uint64_t gathered_fence_ = 0;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace lumen::holder
