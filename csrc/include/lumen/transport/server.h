// The receiving side of the data plane: a UCP listener (whose connections not yet
// authenticated are bounded by lumen/transport/admission.h) whose connections must prove the
// cluster secret (and agree on
// session keys that seal every later message, lumen/transport/auth.h), then
// open/append/release/read checkpoints held by a RecordSink, each as far as a capability signed
// by the trusted issuer grants it (lumen/transport/capability.h). Appends are received straight
// into the sink's buffers by the progress thread; no Python runs on it.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "lumen/transport/admission.h"
#include "lumen/transport/auth.h"
#include "lumen/transport/capability.h"
#include "lumen/transport/sink.h"
#include "lumen/transport/wire.h"
#include "lumen/transport/worker.h"

namespace lumen::transport {

struct ServerOptions {
  std::string address = "127.0.0.1";
  uint16_t port = 0;  // 0: any free port; port() tells which
  std::string secret;
  // This holder's id (the one capabilities name) and the issuer's public key; without a key
  // every capability is refused until trust_issuer() sets one.
  uint64_t holder_id = 0;
  std::optional<IssuerKey> issuer_public_key;
  std::string tls;
  WireLimits limits;
  bool verify_records = true;  // recompute each record's crc32c on receipt
  // A connection not authenticated this long after it was accepted (whatever it sent, UCX
  // or not) is dropped; past max_unauthenticated such connections, new ones are closed at once.
  double handshake_timeout_s = 10.0;
  uint32_t max_unauthenticated = 64;
  // An append whose payload has not all arrived by then (its writer stalled or died without
  // its connection failing) drops the connection; the receive fails and its memory returns.
  double receive_timeout_s = 30.0;
};

// Counters; every refusal and failure is visible here.
struct ServerStats {
  uint64_t connections_accepted = 0;         // UCX connection requests
  uint64_t connections_refused = 0;          // closed at once: max_unauthenticated were waiting
  uint64_t connections_failed = 0;           // UCX could not create their endpoint
  uint64_t connections_unauthenticated = 0;  // accepted, not yet authenticated (now)
  uint64_t connections_active = 0;
  uint64_t handshakes_ok = 0;
  uint64_t handshakes_failed = 0;
  uint64_t handshake_timeouts = 0;  // before or after UCX's connection request
  uint64_t identified = 0;          // handshakes that proved a worker's credential
  uint64_t bad_credentials = 0;     // handshakes refused for the identity they claimed
  uint64_t encrypted = 0;           // handshakes of connections that encrypt their payloads
  uint64_t decrypt_failures = 0;    // encrypted appends whose tag did not verify (refused)
  uint64_t malformed = 0;           // messages that failed validation (connection dropped)
  uint64_t unauthenticated = 0;     // messages before the handshake (connection dropped)
  uint64_t bad_seals = 0;           // after it, a seal that does not verify (connection dropped)
  uint64_t out_of_sequence = 0;     // a valid seal on a replayed or reordered message (dropped)
  uint64_t bad_capability = 0;      // not signed by the trusted issuer (or none trusted yet)
  uint64_t capability_refused = 0;  // signed, but not for this checkpoint, epoch, holder or
                                    // operation, or expired; or an append its open did not grant
  uint64_t stale_epoch = 0;
  uint64_t rejected = 0;  // refused by the sink: not open, gap, unknown checkpoint
  uint64_t conflicts = 0;
  uint64_t crc_failures = 0;        // appends whose records did not match their crcs
  uint64_t receive_timeouts = 0;    // appends not received within receive_timeout_s (dropped)
  uint64_t receives_in_flight = 0;  // appends whose payload is still arriving (now)
  uint64_t appends_committed = 0;
  uint64_t appends_aborted = 0;  // failed in flight (peer gone) or after a failed append
  uint64_t tokens_committed = 0;
  uint64_t bytes_received = 0;  // payload bytes of committed appends
  uint64_t opens = 0;
  uint64_t releases = 0;
  uint64_t reads = 0;
};

class Server {
 public:
  // Throws std::invalid_argument without a valid secret, std::runtime_error if UCX fails.
  Server(const ServerOptions& options, std::shared_ptr<RecordSink> sink);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  uint16_t port() const { return port_; }
  // Verifies capabilities with public_key from now on (a gateway hands its key over at
  // registration; a restarted one may bring another). Throws std::runtime_error if OpenSSL
  // refuses the key.
  void trust_issuer(const IssuerKey& public_key);
  ServerStats stats() const;
  void close();

 private:
  struct Grant {
    Capability capability;
    CapabilityBytes bytes{};
  };
  struct Conn {
    uint64_t id = 0;
    ucp_ep_h ep = nullptr;
    std::string peer;  // endpoint_name of its socket's peer, as admission_ sees it
    std::chrono::steady_clock::time_point accepted_at;
    HandshakeTranscript transcript;
    EphemeralKey exchange;  // its private half is wiped once the session keys are derived
    bool authenticated = false;
    std::optional<uint64_t> worker;  // the worker id its handshake proved, if it claimed one
    bool encrypted = false;          // its bulk payloads travel in AES-256-GCM
    SealState seal;  // keyed by the handshake; every later message in and out is sealed
    // What this connection's opens were granted, by (request_id, shard, epoch): an append
    // must present the same capability, before its expiry. (An older epoch's grant stays, so
    // the store, not the grant, tells a fenced writer it is stale.)
    std::map<std::tuple<uint64_t, uint32_t, uint32_t>, Grant> grants;
  };
  // An accepted append; lives until it is settled and its receive (if any) has completed.
  struct PendingAppend {
    Server* server = nullptr;
    uint64_t conn_id = 0;
    WireHeader header;
    AppendTarget target;
    std::vector<ucp_dt_iov_t> iov;  // token ids, crcs, then the record pieces
    std::chrono::steady_clock::time_point begun_at;
    Status failure = Status::kOk;  // why the payload did not arrive intact
    bool encrypted = false;        // target holds ciphertext until its tag is checked
    uint64_t sequence = 0;         // the seal number of the APPEND (the GCM nonce)
    std::array<uint8_t, kCipherTagBytes> tag{};
    bool receiving = false;  // UCX is still writing into target
    bool settled = false;    // the sender has its answer
  };

  static void on_conn_request(ucp_conn_request_h request, void* arg);
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t on_message(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static void on_append_received(void* request, ucs_status_t status, size_t length,
                                 void* user_data);

  ucs_status_t handle(Conn* conn, const WireHeader& h, void* data, bool rndv);
  void handle_auth(Conn* conn, const WireHeader& h, const uint8_t* payload);
  // Whether the credential an AUTH claims is signed by the issuer and the proof is signed by
  // its key over this connection's transcript; if so the connection is that worker's.
  bool check_identity(Conn* conn, const uint8_t* credential, const uint8_t* proof);
  // Whether h.capability is signed by the issuer and grants `needed` on h's checkpoint here,
  // now, to this connection (counted in the stats when not); *out is the capability.
  bool check_capability(const Conn& conn, Capability* out, const WireHeader& h, uint32_t needed);
  // Whether an append is covered by its connection's open.
  bool check_granted(const Conn& conn, const WireHeader& h);
  ucs_status_t handle_append(Conn* conn, const WireHeader& h, void* data, bool rndv);
  void complete_append(uint64_t ticket);
  void settle(const std::vector<AppendOutcome>& outcomes);
  void reply(Conn* conn, const WireHeader& request, MessageKind kind, Status status,
             uint64_t durable_tokens);
  void send(Conn* conn, const WireHeader& h, std::shared_ptr<const std::vector<uint8_t>> payload);
  void drop(Conn* conn, bool force);
  Conn* find(ucp_ep_h ep);
  Conn* find(uint64_t conn_id);
  void count_refusal(Status status);
  bool handshake_expired(const Conn& conn) const;
  // Every tick: sweeps admission_, drops connections past their handshake deadline or with a
  // receive past its receive deadline.
  void expire();
  // One admission_ sweep, told which peers have a connection and which authenticated.
  void sweep_admission();
  // Drops every connection that has not authenticated (force: nothing is flushed to it).
  void drop_unauthenticated();
  void shutdown();

  ServerOptions options_;
  std::shared_ptr<RecordSink> sink_;
  std::unique_ptr<CapabilityVerifier> verifier_;  // progress thread only
  mutable Worker worker_;                         // stats() hands a copy job to its thread
  ucp_listener_h listener_ = nullptr;             // on options_.address
  std::unique_ptr<Admission> admission_;          // progress thread only
  bool closing_ = false;                          // shutdown() began: requests are rejected
  uint16_t port_ = 0;
  uint64_t next_conn_id_ = 1;
  std::unordered_map<uint64_t, std::unique_ptr<Conn>> conns_;
  std::unordered_map<ucp_ep_h, uint64_t> conn_of_ep_;
  std::map<uint64_t, std::unique_ptr<PendingAppend>> appends_;  // by sink ticket
  ServerStats stats_;  // progress thread only; stats() copies it there
};

}  // namespace lumen::transport
