// The sending side of the data plane: one authenticated connection to a Server. Calls come
// from any thread; each builds an operation that the progress thread sends straight from the
// caller's memory (appends) or receives straight into it (reads). Every wait has a deadline;
// a failure raises TransportError with its Status. The caller's buffers must stay valid until
// the operation's wait returns (it returns only once UCX no longer touches them).
#pragma once
#include <array>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lumen/transport/auth.h"
#include "lumen/transport/wire.h"
#include "lumen/transport/worker.h"

namespace lumen::transport {

// kProve: the connection proves the secret before anything else (every real client).
// kSkip: it does not, for tests of what a server does with unauthenticated peers; only
// send_raw is of use then.
enum class Handshake { kProve, kSkip };

// How send_raw sends: with UCX's reply endpoint, as every client message is sent, or without
// it, so the server cannot tell which connection the message came on (for tests).
enum class RawReply { kWithReplyEp, kWithoutReplyEp };

// How send_raw seals a header of kHeaderBytes after the handshake (lumen/transport/auth.h):
// as the next message (kSeal: what every call sends), with the number of the message sealed
// before it and a valid MAC (kRepeatSequence: what a replayed or reordered message carries),
// or not at all (kAsIs: what a forger without the session key sends).
enum class RawSeal { kSeal, kRepeatSequence, kAsIs };

struct ClientOptions {
  std::string address = "127.0.0.1";
  uint16_t port = 0;
  std::string secret;
  std::string tls;
  WireLimits limits;
  double connect_timeout_s = 10.0;
  Handshake handshake = Handshake::kProve;
  // The worker this connection speaks for (capabilities bound to it need it); none: the
  // connection proves the secret only.
  std::optional<Identity> identity;
  // Bulk payloads (appends' and reads' records) in AES-256-GCM both ways (auth.h).
  bool encrypt = false;
};

struct AppendArgs {
  uint64_t request_id = 0;
  uint32_t shard = 0;
  uint32_t epoch = 0;
  uint64_t start_pos = 0;
  uint32_t num_tokens = 0;
  uint32_t record_bytes = 0;
  const uint32_t* token_ids = nullptr;  // [num_tokens]
  const uint32_t* crcs = nullptr;       // [num_tokens]
  const uint8_t* records = nullptr;     // [num_tokens * record_bytes]
  CapabilityBytes capability{};
};

struct ReadArgs {
  uint64_t request_id = 0;
  uint32_t shard = 0;
  uint32_t epoch = 0;
  uint64_t start_pos = 0;
  uint32_t max_tokens = 0;
  uint32_t record_bytes = 0;
  uint32_t* token_ids = nullptr;    // [max_tokens], written
  uint32_t* crcs = nullptr;         // [max_tokens], written
  uint8_t* records = nullptr;       // [max_tokens * record_bytes], written
  uint8_t* fingerprints = nullptr;  // [2 * kFingerprintBytes], written
  CapabilityBytes capability{};
};

struct ReadReply {
  uint64_t start_pos = 0;
  uint32_t num_tokens = 0;
  uint64_t durable_tokens = 0;
};

struct ClientStats {
  uint64_t ops_started = 0;
  uint64_t ops_failed = 0;
  uint64_t bytes_sent = 0;         // append payload bytes acknowledged
  uint64_t bytes_read = 0;         // read payload bytes received
  uint64_t malformed_replies = 0;  // replies that failed validation or their seal
};

class Client {
 public:
  // Connects and authenticates; throws std::invalid_argument without a valid secret and
  // TransportError (kRejected, kPeerGone, kTimeout) when the handshake fails.
  explicit Client(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Each returns the checkpoint's durable length reported by the server.
  // open also asks the holder to reserve reserve_tokens records (refused: kRejected).
  uint64_t open(uint64_t request_id, uint32_t shard, uint32_t epoch, uint32_t record_bytes,
                const uint8_t* fingerprints, const CapabilityBytes& capability,
                uint64_t reserve_tokens, double timeout_s);
  uint64_t append(const AppendArgs& args, double timeout_s);
  // Starts an append and returns its operation id for wait(); several may be in flight.
  uint64_t start_append(const AppendArgs& args);
  uint64_t wait(uint64_t op_id, double timeout_s);
  void release(uint64_t request_id, uint32_t shard, uint32_t epoch,
               const CapabilityBytes& capability, double timeout_s);
  ReadReply read(const ReadArgs& args, double timeout_s);
  // Sends header (any bytes) and payload as one message and waits for the answer to op_id
  // (>= 2**63, or for the connection to fail): for tests of the server's validation.
  uint64_t send_raw(const std::vector<uint8_t>& header, const std::vector<uint8_t>& payload,
                    uint64_t op_id, double timeout_s, RawReply reply = RawReply::kWithReplyEp,
                    RawSeal seal = RawSeal::kSeal);

  // Streams count appends of message_bytes (zero records of up to 32 KiB with their crcs) to
  // a scratch checkpoint (request_id 2**64 - 1, the given shard, epoch 0, which capability must
  // grant), releases it, and returns the payload bytes per second achieved with `window`
  // appends in flight.
  double measure_bandwidth(uint64_t message_bytes, uint32_t count, uint32_t window, uint32_t shard,
                           const CapabilityBytes& capability, double timeout_s);

  // The (transport, device) pairs UCX chose for this connection, e.g. ("tcp", "lo").
  std::vector<std::pair<std::string, std::string>> transports();

  // What calls may send: field by field the smaller of options.limits and the limits the
  // server announced in its handshake (options.limits alone without one); calls beyond them
  // throw std::invalid_argument before sending.
  WireLimits limits() const;
  bool connected() const;
  ClientStats stats() const;
  void close();

 private:
  struct Op {
    uint64_t id = 0;
    MessageKind kind = MessageKind::kOpen;
    int inflight = 0;  // UCX requests still using the caller's memory
    bool replied = false;
    bool finished = false;  // guarded by mutex_
    Status status = Status::kOk;
    std::string message;
    uint64_t durable_tokens = 0;
    uint64_t payload_bytes = 0;
    ReadArgs read;
    ReadReply read_reply;
    RawReply reply = RawReply::kWithReplyEp;
    RawSeal seal = RawSeal::kSeal;
    ucp_dt_iov_t iov[5];    // a read's: fingerprints, ids, crcs, records, then its GCM tag
    bool decrypt = false;   // a read whose received payload is still encrypted
    uint64_t sequence = 0;  // the seal number of its READ_DATA (the GCM nonce)
    std::array<uint8_t, kCipherTagBytes> tag{};
    std::vector<uint8_t> owned_header;
    std::vector<uint8_t> owned_payload;
  };
  using OpPtr = std::shared_ptr<Op>;

  static ucs_status_t on_message(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void on_send_done(void* request, ucs_status_t status, void* user_data);
  static void on_recv_done(void* request, ucs_status_t status, size_t length, void* user_data);
  // Shared tail of both callbacks: a failed transfer means the endpoint is dead.
  static void finish_transfer(void* request, ucs_status_t status, void* user_data,
                              const char* what);

  OpPtr new_op(MessageKind kind);
  uint64_t run(const OpPtr& op, const WireHeader& h, const void* header_bytes,
               const ucp_dt_iov_t* iov, size_t iov_count, double timeout_s);
  void submit(const OpPtr& op, const WireHeader& h, const void* header_bytes,
              const ucp_dt_iov_t* iov, size_t iov_count);
  uint64_t await(const OpPtr& op, double timeout_s);
  void fail(const OpPtr& op, Status status, const std::string& message);
  void maybe_finish(const OpPtr& op);
  void fail_connection(Status status, const std::string& message);
  ucs_status_t handle(const WireHeader& h, void* data, bool rndv);
  ucs_status_t handle_read_data(const OpPtr& op, const WireHeader& h, void* data, bool rndv);
  void handle_challenge(const uint8_t* payload);  // the server's nonce and exchange key
  void handle_auth_ok(const uint8_t* payload);    // proof, then the server's limits
  // Seals a header about to be sent as op says (progress thread, in send order).
  void seal_for_send(std::vector<uint8_t>* header, const Op& op, size_t iov_count);
  void shutdown();

  ClientOptions options_;
  // Written once, by the handshake, before the constructor returns: read freely after.
  WireLimits limits_;
  Worker worker_;
  ucp_ep_h ep_ = nullptr;  // progress thread only
  bool ep_open_ = false;
  // The handshake and the session it keys; progress thread only.
  HandshakeTranscript transcript_;
  SealState seal_;
  bool sealed_ = false;  // the handshake is done: every message in and out is sealed
  std::unordered_map<uint64_t, OpPtr> ops_;      // in flight; progress thread only
  std::unordered_map<uint64_t, OpPtr> started_;  // started appends not yet waited; mutex_
  mutable std::mutex mutex_;
  std::condition_variable finished_cv_;
  uint64_t next_op_id_ = 1;  // guarded by mutex_
  bool connected_ = false;   // guarded by mutex_
  ClientStats stats_;        // guarded by mutex_
};

}  // namespace lumen::transport
