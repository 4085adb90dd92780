// Server: listener, handshake, capability checks, appends into a RecordSink
// (lumen/transport/server.h). Everything below runs on the worker's progress thread except
// the constructor's setup call, stats() and close().
#include "lumen/transport/server.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <unordered_set>

#include "lumen/checksum.h"
#include "lumen/transport/error.h"

namespace lumen::transport {
namespace {

// Context of one server send: keeps its payload alive until UCX is done with it.
struct SendContext {
  std::shared_ptr<const std::vector<uint8_t>> payload;
};

void on_send_done(void* request, ucs_status_t /*status*/, void* user_data) {
  delete static_cast<SendContext*>(user_data);
  ucp_request_free(request);
}

// Each record's crc32c against target.crcs; a record may run on from one piece into the next.
bool records_match(const AppendTarget& target, uint32_t num_tokens, uint32_t record_bytes) {
  uint32_t index = 0;
  uint64_t done = 0;  // bytes of record `index` already chained into crc
  uint32_t crc = 0;
  for (const MemoryPiece& piece : target.records) {
    const uint8_t* p = piece.data;
    uint64_t left = piece.bytes;
    while (left > 0 && index < num_tokens) {
      const uint64_t take = std::min<uint64_t>(left, record_bytes - done);
      crc = crc32c(p, take, crc);
      p += take;
      left -= take;
      done += take;
      if (done == record_bytes) {
        if (crc != target.crcs[index]) return false;
        ++index;
        done = 0;
        crc = 0;
      }
    }
  }
  return index == num_tokens;
}

// How long close() waits for its flushing closes and the receives they fail. A client still
// there sees its close within milliseconds; one that went away unnoticed (a client's own
// close does not tell the server) never completes it, so the wait is short.
constexpr double kShutdownGraceS = 0.5;
// Closing the listener's gate (shutdown()): sweeps 5 ms apart, for at most 1 s.
constexpr auto kGateSweep = std::chrono::milliseconds(5);
constexpr double kGateTimeoutS = 1.0;

bool is_request(MessageKind kind) {
  return kind == MessageKind::kOpen || kind == MessageKind::kAppend ||
         kind == MessageKind::kRelease || kind == MessageKind::kRead;
}

bool is_handshake(MessageKind kind) {
  return kind == MessageKind::kChallenge || kind == MessageKind::kAuth ||
         kind == MessageKind::kAuthOk;
}

}  // namespace

Server::Server(const ServerOptions& options, std::shared_ptr<RecordSink> sink)
    : options_(options), sink_(std::move(sink)), worker_(WorkerOptions{options.tls}) {
  check_secret(options_.secret);
  if (options_.issuer_public_key) {
    verifier_ = std::make_unique<CapabilityVerifier>(*options_.issuer_public_key);
  }
  if (!sink_) throw std::invalid_argument("sink must be a RecordSink, got null");
  check_timeout("handshake_timeout_s", options_.handshake_timeout_s);
  check_timeout("receive_timeout_s", options_.receive_timeout_s);
  socklen_t address_length = 0;
  const sockaddr_storage address =
      resolve_address(options_.address, options_.port, &address_length);

  worker_.set_message_handler(&Server::on_message, this);

  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address);
  params.sockaddr.addrlen = address_length;
  params.conn_handler.cb = &Server::on_conn_request;
  params.conn_handler.arg = this;
  ucs_status_t status = ucp_listener_create(worker_.handle(), &params, &listener_);
  if (status != UCS_OK) {
    throw_ucs("listen on " + options_.address + ":" + std::to_string(options_.port), status);
  }
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  status = ucp_listener_query(listener_, &attr);
  if (status != UCS_OK) {
    ucp_listener_destroy(listener_);
    throw_ucs("ucp_listener_query", status);
  }
  port_ = port_of(attr.sockaddr);
  try {
    admission_ = std::make_unique<Admission>(
        attr.sockaddr,
        AdmissionOptions{options_.handshake_timeout_s, options_.max_unauthenticated});
  } catch (...) {
    ucp_listener_destroy(listener_);
    throw;
  }
  worker_.start([this] { shutdown(); }, [this] { return !appends_.empty(); }, [this] { expire(); });
}

Server::~Server() { close(); }

void Server::trust_issuer(const IssuerKey& public_key) {
  auto verifier = std::make_unique<CapabilityVerifier>(public_key);
  worker_.call([&] { verifier_ = std::move(verifier); });
}

void Server::close() { worker_.stop(); }

ServerStats Server::stats() const {
  ServerStats copy;
  worker_.call([&] {
    copy = stats_;
    for (const auto& [ticket, pending] : appends_) copy.receives_in_flight += pending->receiving;
    const AdmissionStats& admission = admission_->stats();
    copy.connections_refused = admission.refused;
    copy.connections_unauthenticated = admission.pending;
    copy.handshake_timeouts += admission.expired;
  });
  return copy;
}

void Server::shutdown() {
  if (listener_ != nullptr) {
    // The listener goes only once no socket it accepted can still bring a connection
    // request (admission.h, "Closing"): new ones are refused, those without a request shut.
    closing_ = true;
    admission_->close_gate();
    auto next_sweep = std::chrono::steady_clock::now();
    worker_.progress_until(
        [&] {
          const auto now = std::chrono::steady_clock::now();
          if (now < next_sweep) return false;
          next_sweep = now + kGateSweep;
          sweep_admission();
          return admission_->stats().unrequested == 0;
        },
        kGateTimeoutS);
    ucp_listener_destroy(listener_);
    listener_ = nullptr;
  }
  // A flushing close tells each client its connection is gone (it sees PeerGone at once; a
  // forced close would leave it to time out). Closed endpoints complete their receives with
  // errors, which settles the appends.
  std::vector<Conn*> open;
  for (auto& [id, conn] : conns_) open.push_back(conn.get());
  for (Conn* conn : open) drop(conn, /*force=*/false);
  worker_.progress_until([this] { return worker_.closing_endpoints() == 0 && appends_.empty(); },
                         kShutdownGraceS);
}

Server::Conn* Server::find(ucp_ep_h ep) {
  auto it = conn_of_ep_.find(ep);
  return it == conn_of_ep_.end() ? nullptr : find(it->second);
}

Server::Conn* Server::find(uint64_t conn_id) {
  auto it = conns_.find(conn_id);
  return it == conns_.end() ? nullptr : it->second.get();
}

void Server::on_conn_request(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<Server*>(arg);
  if (self->closing_) {  // the listener is about to go (shutdown())
    ucp_listener_reject(self->listener_, request);
    return;
  }
  auto conn = std::make_unique<Conn>();
  conn->id = self->next_conn_id_++;
  conn->accepted_at = std::chrono::steady_clock::now();
  ucp_conn_request_attr_t request_attr{};
  request_attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  if (ucp_conn_request_query(request, &request_attr) == UCS_OK) {
    conn->peer = endpoint_name(request_attr.client_address);
  }
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.conn_request = request;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Server::on_ep_error;
  params.err_handler.arg = self;
  if (ucp_ep_create(self->worker_.handle(), &params, &conn->ep) != UCS_OK) {
    // UCX has released the request itself (rejecting it again used freed memory: a holder
    // stopped while connections queued crashed when it resumed).
    self->stats_.connections_failed++;
    return;
  }
  self->stats_.connections_accepted++;
  self->stats_.connections_active++;
  conn->transcript.server_nonce = random_nonce();
  conn->exchange = generate_ephemeral_key();
  conn->transcript.server_key = conn->exchange.public_key;
  Conn* raw = conn.get();
  self->conn_of_ep_[conn->ep] = conn->id;
  self->conns_[conn->id] = std::move(conn);
  auto payload = std::make_shared<std::vector<uint8_t>>(raw->transcript.server_nonce.begin(),
                                                        raw->transcript.server_nonce.end());
  payload->insert(payload->end(), raw->exchange.public_key.begin(), raw->exchange.public_key.end());
  WireHeader challenge;
  challenge.kind = MessageKind::kChallenge;
  challenge.payload_bytes = payload->size();
  self->send(raw, challenge, payload);
}

bool Server::handshake_expired(const Conn& conn) const {
  return std::chrono::steady_clock::now() - conn.accepted_at >
         std::chrono::duration<double>(options_.handshake_timeout_s);
}

void Server::sweep_admission() {
  std::unordered_set<std::string> authenticated;
  std::unordered_set<std::string> requested;
  for (const auto& [id, conn] : conns_)
    (conn->authenticated ? authenticated : requested).insert(conn->peer);
  admission_->sweep(authenticated, requested);
}

void Server::expire() {
  sweep_admission();
  std::vector<Conn*> expired;
  for (auto& [id, conn] : conns_) {
    if (!conn->authenticated && handshake_expired(*conn)) expired.push_back(conn.get());
  }
  for (Conn* conn : expired) {
    stats_.handshake_timeouts++;
    drop(conn, /*force=*/true);
  }
  // UCX reports no progress of a receive, only its end: one that has not ended by its
  // deadline has a stalled sender. Dropping the connection fails the receive.
  const auto now = std::chrono::steady_clock::now();
  const auto limit = std::chrono::duration<double>(options_.receive_timeout_s);
  std::vector<uint64_t> stalled;
  for (const auto& [ticket, pending] : appends_) {
    if (pending->receiving && now - pending->begun_at > limit) stalled.push_back(pending->conn_id);
  }
  for (uint64_t conn_id : stalled) {
    if (Conn* conn = find(conn_id)) {  // several receives of one connection: dropped once
      stats_.receive_timeouts++;
      drop(conn, /*force=*/true);
    }
  }
}

void Server::drop_unauthenticated() {
  std::vector<Conn*> unauthenticated;
  for (auto& [id, conn] : conns_) {
    if (!conn->authenticated) unauthenticated.push_back(conn.get());
  }
  for (Conn* conn : unauthenticated) drop(conn, /*force=*/true);
}

void Server::on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t /*status*/) {
  auto* self = static_cast<Server*>(arg);
  if (Conn* conn = self->find(ep)) self->drop(conn, /*force=*/true);
}

void Server::drop(Conn* conn, bool force) {
  worker_.close_endpoint(conn->ep, force);
  stats_.connections_active--;
  conn_of_ep_.erase(conn->ep);
  conns_.erase(conn->id);
}

void Server::send(Conn* conn, const WireHeader& h,
                  std::shared_ptr<const std::vector<uint8_t>> payload) {
  uint8_t header[kHeaderBytes];
  const bool encrypt = conn->encrypted && h.kind == MessageKind::kReadData && payload;
  WireHeader sent = h;
  if (encrypt) sent.payload_bytes += kCipherTagBytes;
  encode_header(header, sent);
  // Every message after the handshake is sealed (the refusal of a handshake is not: there
  // are no session keys then).
  if (conn->authenticated && !is_handshake(h.kind)) {
    seal_header(header, &conn->seal, payload ? payload->data() : nullptr,
                payload ? payload->size() : 0);
  }
  if (encrypt) {  // the seal's number is the nonce
    auto sealed = std::make_shared<std::vector<uint8_t>>(payload->size() + kCipherTagBytes);
    auto* plain = const_cast<uint8_t*>(payload->data());  // read only
    conn->seal.send_cipher.encrypt(conn->seal.sent, {{plain, payload->size()}}, sealed->data(),
                                   sealed->data() + payload->size());
    payload = std::move(sealed);
  }
  auto* context = new SendContext{std::move(payload)};
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER;
  param.cb.send = &on_send_done;
  param.user_data = context;
  const void* data = context->payload ? context->payload->data() : nullptr;
  const size_t size = context->payload ? context->payload->size() : 0;
  ucs_status_ptr_t request =
      ucp_am_send_nbx(conn->ep, kAmId, header, kHeaderBytes, data, size, &param);
  // Done at once or failed (the endpoint's error handler drops the connection).
  if (!UCS_PTR_IS_PTR(request)) delete context;
}

void Server::reply(Conn* conn, const WireHeader& request, MessageKind kind, Status status,
                   uint64_t durable_tokens) {
  if (conn == nullptr) return;
  WireHeader h;
  h.kind = kind;
  h.request_id = request.request_id;
  h.op_id = request.op_id;
  h.shard = request.shard;
  h.epoch = request.epoch;
  h.start_pos = request.start_pos;
  h.durable_tokens = durable_tokens;
  h.status = status;
  send(conn, h, nullptr);
}

void Server::count_refusal(Status status) {
  switch (status) {
    case Status::kStaleEpoch:
      stats_.stale_epoch++;
      break;
    case Status::kConflict:
      stats_.conflicts++;
      break;
    case Status::kAborted:
    case Status::kPeerGone:
      stats_.appends_aborted++;
      break;
    case Status::kMalformed:
      stats_.crc_failures++;
      break;
    default:
      stats_.rejected++;
      break;
  }
}

ucs_status_t Server::on_message(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Server*>(arg);
  Conn* conn =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? self->find(param->reply_ep) : nullptr;
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    // Sent without a reply endpoint, which no client of ours does, so not by an authenticated
    // peer; UCX does not say which connection it came on, so every connection still in its
    // handshake is dropped (an honest one retries with a fresh connection).
    self->stats_.malformed++;
    self->drop_unauthenticated();
    return UCS_OK;
  }
  if (conn == nullptr) return UCS_OK;  // in flight from a connection already dropped
  WireHeader h;
  std::string why;
  if (!decode_header(&h, &why, header, header_length, length, self->options_.limits,
                     conn->encrypted ? kCipherTagBytes : 0)) {
    self->stats_.malformed++;
    self->drop(conn, /*force=*/true);
    return UCS_OK;
  }
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (conn->authenticated) {
    // Only an append's payload may come by rendezvous; any other is here to be checked.
    if (rndv && h.kind != MessageKind::kAppend) {
      self->stats_.malformed++;
      self->drop(conn, /*force=*/true);
      return UCS_OK;
    }
    const SealCheck seal = check_seal(static_cast<const uint8_t*>(header), &conn->seal, h.kind,
                                      static_cast<const uint8_t*>(data), length);
    if (seal != SealCheck::kOk) {
      (seal == SealCheck::kBadMac ? self->stats_.bad_seals : self->stats_.out_of_sequence)++;
      self->drop(conn, /*force=*/true);
      return UCS_OK;
    }
  }
  return self->handle(conn, h, data, rndv);
}

ucs_status_t Server::handle(Conn* conn, const WireHeader& h, void* data, bool rndv) {
  if (!conn->authenticated) {
    if (h.kind != MessageKind::kAuth) {
      stats_.unauthenticated++;
      drop(conn, /*force=*/true);
    } else if (rndv) {
      stats_.malformed++;
      drop(conn, /*force=*/true);
    } else if (handshake_expired(*conn)) {
      stats_.handshake_timeouts++;
      reply(conn, h, MessageKind::kError, Status::kTimeout, 0);
      drop(conn, /*force=*/false);
    } else {
      handle_auth(conn, h, static_cast<const uint8_t*>(data));
    }
    return UCS_OK;
  }
  if (!is_request(h.kind)) {
    stats_.malformed++;
    drop(conn, /*force=*/true);
    return UCS_OK;
  }
  // Signatures are verified once per open, read or release; an append only repeats what its
  // connection's open verified, so the data path does no public-key work.
  const uint32_t needed = h.kind == MessageKind::kRead ? kRightRead : kRightWrite;
  Capability capability;
  const bool granted = h.kind == MessageKind::kAppend
                           ? check_granted(*conn, h)
                           : check_capability(*conn, &capability, h, needed);
  if (!granted) {
    reply(conn, h, MessageKind::kError, Status::kRejected, 0);
    return UCS_OK;  // drops an unreceived rendezvous payload
  }
  const std::tuple<uint64_t, uint32_t, uint32_t> key{h.request_id, h.shard, h.epoch};
  switch (h.kind) {
    case MessageKind::kOpen: {
      uint64_t durable = 0;
      std::vector<AppendOutcome> fenced;
      const Status status = sink_->open(h, static_cast<const uint8_t*>(data), &durable, &fenced);
      settle(fenced);
      if (status == Status::kOk) {
        stats_.opens++;
        conn->grants[key] = Grant{capability, h.capability};  // a re-open renews it
        reply(conn, h, MessageKind::kAck, status, durable);
      } else {
        count_refusal(status);
        reply(conn, h, MessageKind::kError, status, 0);
      }
      return UCS_OK;
    }
    case MessageKind::kAppend:
      return handle_append(conn, h, data, rndv);
    case MessageKind::kRelease: {
      std::vector<AppendOutcome> outcomes;
      const Status status = sink_->release(h, &outcomes);
      settle(outcomes);
      conn->grants.erase(key);
      if (status == Status::kOk) {
        stats_.releases++;
        reply(conn, h, MessageKind::kAck, status, 0);
      } else {
        count_refusal(status);
        reply(conn, h, MessageKind::kError, status, 0);
      }
      return UCS_OK;
    }
    case MessageKind::kRead: {
      ReadResult result;
      std::vector<AppendOutcome> fenced;
      const Status status = sink_->read(h, &result, &fenced);
      settle(fenced);
      if (status != Status::kOk) {
        count_refusal(status);
        reply(conn, h, MessageKind::kError, status, 0);
        return UCS_OK;
      }
      stats_.reads++;
      WireHeader out;
      out.kind = MessageKind::kReadData;
      out.request_id = h.request_id;
      out.op_id = h.op_id;
      out.shard = h.shard;
      out.epoch = h.epoch;
      out.start_pos = result.start_pos;
      out.num_tokens = result.num_tokens;
      out.record_bytes = result.record_bytes;
      out.durable_tokens = result.durable_tokens;
      out.payload_bytes = result.payload->size();
      send(conn, out, result.payload);
      return UCS_OK;
    }
    default:
      return UCS_OK;  // unreachable: is_request() above
  }
}

bool Server::check_capability(const Conn& conn, Capability* out, const WireHeader& h,
                              uint32_t needed) {
  std::string why;
  if (verifier_ == nullptr || !verifier_->verify(out, &why, h.capability)) {
    stats_.bad_capability++;
    return false;
  }
  if (!check_grant(&why, *out, h.request_id, h.shard, h.epoch, options_.holder_id, needed,
                   unix_now_ms(), conn.worker)) {
    stats_.capability_refused++;
    return false;
  }
  return true;
}

bool Server::check_granted(const Conn& conn, const WireHeader& h) {
  auto it = conn.grants.find({h.request_id, h.shard, h.epoch});
  const bool granted = it != conn.grants.end() && it->second.bytes == h.capability &&
                       unix_now_ms() < it->second.capability.expires_at_ms;
  if (!granted) stats_.capability_refused++;
  return granted;
}

bool Server::check_identity(Conn* conn, const uint8_t* credential, const uint8_t* proof) {
  CredentialBytes bytes;
  std::memcpy(bytes.data(), credential, bytes.size());
  Credential claimed;
  std::string why;
  if (verifier_ == nullptr || !verifier_->verify_credential(&claimed, &why, bytes)) return false;
  const std::vector<uint8_t> message = identity_message(conn->transcript);
  try {
    if (!Ed25519Verifier(claimed.public_key).verify(message.data(), message.size(), proof)) {
      return false;
    }
  } catch (const std::runtime_error&) {
    return false;  // a public key OpenSSL refuses
  }
  conn->worker = claimed.worker_id;
  return true;
}

void Server::handle_auth(Conn* conn, const WireHeader& h, const uint8_t* payload) {
  HandshakeTranscript& t = conn->transcript;
  std::memcpy(t.client_nonce.data(), payload, kNonceBytes);
  std::memcpy(t.client_key.data(), payload + kNonceBytes, kExchangeKeyBytes);
  const uint8_t* client_mac = payload + kNonceBytes + kExchangeKeyBytes;
  const Mac expected = handshake_mac(options_.secret, "client", t);
  const uint64_t flags = h.start_pos;  // bound into the session keys below
  bool proven = mac_equal(expected.data(), client_mac) && (flags & ~kAuthFlags) == 0;
  if (proven && h.payload_bytes == kAuthIdentifiedBytes) {
    const uint8_t* claimed = payload + kAuthBytes;
    if (!check_identity(conn, claimed, claimed + kCredentialBytes)) {
      stats_.bad_credentials++;
      proven = false;
    }
  }
  if (proven) {
    try {
      const SessionKeys keys =
          derive_session_keys(options_.secret, conn->exchange.private_key, t.client_key, t, flags);
      conn->seal.send_key = MacKey(keys.server_to_client);
      conn->seal.receive_key = MacKey(keys.client_to_server);
      if (flags & kAuthEncrypt) {
        conn->seal.send_cipher = PayloadCipher(keys.server_to_client_cipher);
        conn->seal.receive_cipher = PayloadCipher(keys.client_to_server_cipher);
        conn->encrypted = true;
      }
    } catch (const std::runtime_error&) {
      proven = false;  // a client key OpenSSL refuses (a low-order point): no session
    }
  }
  conn->exchange.private_key.fill(0);  // used once
  if (!proven) {
    stats_.handshakes_failed++;
    reply(conn, h, MessageKind::kError, Status::kRejected, 0);
    drop(conn, /*force=*/false);  // flush: the refusal reaches the client first
    return;
  }
  conn->authenticated = true;
  stats_.handshakes_ok++;
  if (conn->worker) stats_.identified++;
  if (conn->encrypted) stats_.encrypted++;
  // The proof, then the limits it covers: the client sends nothing these would refuse.
  auto proof_and_limits = std::make_shared<std::vector<uint8_t>>(kMacBytes + kLimitsBytes);
  encode_limits(proof_and_limits->data() + kMacBytes, options_.limits);
  const Mac proof = handshake_mac(options_.secret, "server", t,
                                  proof_and_limits->data() + kMacBytes, kLimitsBytes);
  std::copy(proof.begin(), proof.end(), proof_and_limits->begin());
  WireHeader ok;
  ok.kind = MessageKind::kAuthOk;
  ok.op_id = h.op_id;
  ok.payload_bytes = proof_and_limits->size();
  send(conn, ok, proof_and_limits);
}

ucs_status_t Server::handle_append(Conn* conn, const WireHeader& h, void* data, bool rndv) {
  auto pending = std::make_unique<PendingAppend>();
  const Status status = sink_->begin_append(h, &pending->target);
  if (status != Status::kOk) {
    count_refusal(status);
    reply(conn, h, MessageKind::kError, status, 0);
    return UCS_OK;
  }
  pending->server = this;
  pending->conn_id = conn->id;
  pending->header = h;
  pending->begun_at = std::chrono::steady_clock::now();
  const uint64_t n = h.num_tokens;
  pending->iov.push_back({pending->target.token_ids, 4 * n});
  pending->iov.push_back({pending->target.crcs, 4 * n});
  for (const MemoryPiece& piece : pending->target.records) {
    pending->iov.push_back({piece.data, piece.bytes});
  }
  if (conn->encrypted) {  // decrypted in place once all of it is here (complete_append)
    pending->encrypted = true;
    pending->sequence = conn->seal.received;
    pending->iov.push_back({pending->tag.data(), pending->tag.size()});
  }
  const uint64_t ticket = pending->target.ticket;
  PendingAppend* raw = pending.get();
  appends_[ticket] = std::move(pending);
  if (!rndv) {  // eager: the payload is here, valid during this callback only
    const auto* in = static_cast<const uint8_t*>(data);
    for (const ucp_dt_iov_t& part : raw->iov) {
      std::memcpy(part.buffer, in, part.length);
      in += part.length;
    }
    complete_append(ticket);
    return UCS_OK;
  }
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.datatype = ucp_dt_make_iov();
  param.cb.recv_am = &Server::on_append_received;
  param.user_data = raw;
  ucs_status_ptr_t request =
      ucp_am_recv_data_nbx(worker_.handle(), data, raw->iov.data(), raw->iov.size(), &param);
  if (UCS_PTR_IS_ERR(request)) {
    raw->failure = Status::kPeerGone;
    complete_append(ticket);
  } else if (request == nullptr) {
    complete_append(ticket);
  } else {
    raw->receiving = true;
  }
  return UCS_INPROGRESS;
}

void Server::on_append_received(void* request, ucs_status_t status, size_t /*length*/,
                                void* user_data) {
  auto* pending = static_cast<PendingAppend*>(user_data);
  Server* self = pending->server;
  const uint64_t ticket = pending->target.ticket;
  ucp_request_free(request);
  pending->receiving = false;
  if (status != UCS_OK && pending->failure == Status::kOk) pending->failure = Status::kPeerGone;
  if (!pending->settled) {
    self->complete_append(ticket);
    return;
  }
  // Aborted while in flight (its answer is sent): let the sink free its buffers now.
  std::vector<AppendOutcome> outcomes;
  self->sink_->finish_append(ticket, /*received_ok=*/false, &outcomes);
  self->appends_.erase(ticket);
  self->settle(outcomes);
}

void Server::complete_append(uint64_t ticket) {
  PendingAppend* pending = appends_.at(ticket).get();
  const WireHeader& h = pending->header;
  if (pending->encrypted && pending->failure == Status::kOk) {
    Conn* conn = find(pending->conn_id);
    std::vector<Span> pieces;
    for (size_t i = 0; i + 1 < pending->iov.size(); ++i) {
      pieces.push_back({static_cast<uint8_t*>(pending->iov[i].buffer), pending->iov[i].length});
    }
    if (conn == nullptr) {
      pending->failure = Status::kPeerGone;  // its key went with it
    } else if (!conn->seal.receive_cipher.decrypt(pending->sequence, pieces, pending->tag.data())) {
      stats_.decrypt_failures++;
      pending->failure = Status::kMalformed;
    }
  }
  if (pending->failure == Status::kOk && options_.verify_records &&
      !records_match(pending->target, h.num_tokens, h.record_bytes)) {
    pending->failure = Status::kMalformed;
  }
  std::vector<AppendOutcome> outcomes;
  sink_->finish_append(ticket, pending->failure == Status::kOk, &outcomes);
  settle(outcomes);
}

void Server::settle(const std::vector<AppendOutcome>& outcomes) {
  for (const AppendOutcome& outcome : outcomes) {
    auto it = appends_.find(outcome.ticket);
    if (it == appends_.end() || it->second->settled) continue;
    PendingAppend* pending = it->second.get();
    // The append that failed says why; those aborted behind it say kAborted.
    const Status status = outcome.status == Status::kAborted && pending->failure != Status::kOk
                              ? pending->failure
                              : outcome.status;
    if (status == Status::kOk) {
      stats_.appends_committed++;
      stats_.tokens_committed += pending->header.num_tokens;
      stats_.bytes_received += pending->header.payload_bytes;
      reply(find(pending->conn_id), pending->header, MessageKind::kAck, status,
            outcome.durable_tokens);
    } else {
      count_refusal(status);
      reply(find(pending->conn_id), pending->header, MessageKind::kError, status,
            outcome.durable_tokens);
    }
    if (pending->receiving) {
      pending->settled = true;
    } else {
      appends_.erase(it);
    }
  }
}

}  // namespace lumen::transport
