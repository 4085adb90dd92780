// Client: connect, authenticate, and run operations with deadlines (lumen/transport/client.h).
#include "lumen/transport/client.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "lumen/checksum.h"
#include "lumen/transport/error.h"
#include "lumen/transport/le.h"

namespace lumen::transport {
namespace {

constexpr uint64_t kHandshakeOp = 0;
constexpr uint64_t kFirstRawOpId = 1ull << 63;

std::chrono::nanoseconds to_duration(double seconds) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(seconds));
}

// The header of a request about checkpoint (request_id, shard) at epoch.
WireHeader request_header(MessageKind kind, uint64_t op_id, uint64_t request_id, uint32_t shard,
                          uint32_t epoch, const CapabilityBytes& capability) {
  WireHeader h;
  h.kind = kind;
  h.request_id = request_id;
  h.op_id = op_id;
  h.shard = shard;
  h.epoch = epoch;
  h.capability = capability;
  return h;
}

}  // namespace

// Context of one UCX request of an operation.
struct RequestContext {
  Client* client;
  std::shared_ptr<void> op;
};

Client::Client(const ClientOptions& options)
    : options_(options), limits_(options.limits), worker_(WorkerOptions{options.tls}) {
  check_secret(options_.secret);
  check_timeout("connect_timeout_s", options_.connect_timeout_s);
  socklen_t address_length = 0;
  const sockaddr_storage address =
      resolve_address(options_.address, options_.port, &address_length);
  worker_.set_message_handler(&Client::on_message, this);

  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address);
  params.sockaddr.addrlen = address_length;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Client::on_ep_error;
  params.err_handler.arg = this;
  const ucs_status_t status = ucp_ep_create(worker_.handle(), &params, &ep_);
  if (status != UCS_OK) {
    throw TransportError(Status::kPeerGone, "connect to " + options_.address + ":" +
                                                std::to_string(options_.port) + ": " +
                                                ucs_status_string(status));
  }
  ep_open_ = true;
  if (options_.handshake == Handshake::kSkip) {
    connected_ = true;
    worker_.start([this] { shutdown(); }, [this] { return !ops_.empty(); }, nullptr);
    return;
  }
  auto handshake = std::make_shared<Op>();
  handshake->id = kHandshakeOp;
  handshake->kind = MessageKind::kAuth;
  ops_[kHandshakeOp] = handshake;
  worker_.start([this] { shutdown(); }, [this] { return !ops_.empty(); }, nullptr);
  try {
    await(handshake, options_.connect_timeout_s);
  } catch (...) {
    close();
    throw;
  }
}

Client::~Client() { close(); }

void Client::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    connected_ = false;
  }
  worker_.stop();
}

double Client::measure_bandwidth(uint64_t message_bytes, uint32_t count, uint32_t window,
                                 uint32_t shard, const CapabilityBytes& capability,
                                 double timeout_s) {
  check_timeout("timeout_s", timeout_s);
  constexpr uint64_t kSelfTestRequest = ~uint64_t{0};
  const uint64_t record_bytes = std::min<uint64_t>(message_bytes, 32768);
  const uint64_t num_tokens = message_bytes / std::max<uint64_t>(record_bytes, 1);
  uint64_t payload_bytes = 0;
  if (window == 0) throw std::invalid_argument("window must be >= 1, got 0");
  if (count == 0 || num_tokens == 0 || num_tokens > limits_.max_tokens_per_message ||
      record_bytes > limits_.max_record_bytes ||
      !append_payload_bytes(&payload_bytes, num_tokens, record_bytes) ||
      payload_bytes > limits_.max_payload_bytes) {
    throw std::invalid_argument(
        "message_bytes and count must give 1 to " + std::to_string(limits_.max_tokens_per_message) +
        " records per message and count >= 1, got " + std::to_string(message_bytes) + " bytes x " +
        std::to_string(count));
  }
  std::vector<uint8_t> records(num_tokens * record_bytes, 0);
  std::vector<uint32_t> token_ids(num_tokens, 0);
  std::vector<uint32_t> crcs(num_tokens, crc32c(records.data(), record_bytes));
  const std::vector<uint8_t> fingerprints(2 * kFingerprintBytes, 0);
  open(kSelfTestRequest, shard, 0, static_cast<uint32_t>(record_bytes), fingerprints.data(),
       capability, /*reserve_tokens=*/0, timeout_s);
  AppendArgs args;
  args.request_id = kSelfTestRequest;
  args.shard = shard;
  args.num_tokens = static_cast<uint32_t>(num_tokens);
  args.record_bytes = static_cast<uint32_t>(record_bytes);
  args.token_ids = token_ids.data();
  args.crcs = crcs.data();
  args.records = records.data();
  args.capability = capability;
  const auto start = std::chrono::steady_clock::now();
  std::vector<uint64_t> in_flight;
  for (uint32_t i = 0; i < count; ++i) {
    args.start_pos = i * num_tokens;
    in_flight.push_back(start_append(args));
    if (in_flight.size() >= window) {
      wait(in_flight.front(), timeout_s);
      in_flight.erase(in_flight.begin());
    }
  }
  for (uint64_t op_id : in_flight) wait(op_id, timeout_s);
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  release(kSelfTestRequest, shard, 0, capability, timeout_s);
  return static_cast<double>(payload_bytes) * count / elapsed;
}

std::vector<std::pair<std::string, std::string>> Client::transports() {
  std::vector<std::pair<std::string, std::string>> out;
  worker_.call([&] {
    if (!ep_open_) throw TransportError(Status::kPeerGone, "the connection is closed");
    ucp_transport_entry_t entries[32];
    ucp_ep_attr_t attr{};
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = entries;
    attr.transports.num_entries = 32;
    attr.transports.entry_size = sizeof(ucp_transport_entry_t);
    const ucs_status_t status = ucp_ep_query(ep_, &attr);
    if (status != UCS_OK) throw_ucs("ucp_ep_query", status);
    for (unsigned i = 0; i < attr.transports.num_entries; ++i) {
      out.emplace_back(entries[i].transport_name, entries[i].device_name);
    }
  });
  return out;
}

WireLimits Client::limits() const { return limits_; }

bool Client::connected() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return connected_;
}

ClientStats Client::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void Client::shutdown() {
  fail_connection(Status::kPeerGone, "the client was closed");
  worker_.progress_until([this] { return worker_.closing_endpoints() == 0 && ops_.empty(); }, 5.0);
}

Client::OpPtr Client::new_op(MessageKind kind) {
  auto op = std::make_shared<Op>();
  op->kind = kind;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!connected_) throw TransportError(Status::kPeerGone, "the connection is closed");
  op->id = next_op_id_++;
  stats_.ops_started++;
  return op;
}

void Client::submit(const OpPtr& op, const WireHeader& h, const void* header_bytes,
                    const ucp_dt_iov_t* iov, size_t iov_count) {
  std::vector<uint8_t> header;
  if (header_bytes == nullptr) {
    header.resize(kHeaderBytes);
    encode_header(header.data(), h);
  } else {
    header = op->owned_header;
  }
  for (size_t i = 0; i < iov_count; ++i) op->iov[i] = iov[i];
  // An append's records leave encrypted on a connection that encrypts (not a raw message).
  const bool encrypt =
      options_.encrypt && header_bytes == nullptr && h.kind == MessageKind::kAppend;
  const bool posted =
      worker_.post([this, op, header = std::move(header), iov_count, encrypt]() mutable {
        if (!ep_open_) {
          fail(op, Status::kPeerGone, "the connection is closed");
          return;
        }
        // Sealed here, on the progress thread, so sequence numbers follow the order of sends;
        // the seal's number is the payload's nonce.
        if (sealed_) seal_for_send(&header, *op, iov_count);
        if (sealed_ && encrypt) {
          std::vector<Span> pieces;
          size_t total = 0;
          for (size_t i = 0; i < iov_count; ++i) {
            pieces.push_back({static_cast<uint8_t*>(op->iov[i].buffer), op->iov[i].length});
            total += op->iov[i].length;
          }
          op->owned_payload.resize(total + kCipherTagBytes);
          seal_.send_cipher.encrypt(seal_.sent, pieces, op->owned_payload.data(),
                                    op->owned_payload.data() + total);
          op->iov[0] = {op->owned_payload.data(), op->owned_payload.size()};
          iov_count = 1;
        }
        ops_[op->id] = op;
        auto* context = new RequestContext{this, op};
        ucp_request_param_t param{};
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                             UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
        param.flags = UCP_AM_SEND_FLAG_COPY_HEADER |
                      (op->reply == RawReply::kWithReplyEp ? UCP_AM_SEND_FLAG_REPLY : 0);
        param.datatype = ucp_dt_make_iov();
        param.cb.send = &Client::on_send_done;
        param.user_data = context;
        ucs_status_ptr_t request =
            ucp_am_send_nbx(ep_, kAmId, header.data(), header.size(), op->iov, iov_count, &param);
        if (UCS_PTR_IS_PTR(request)) {
          op->inflight++;
          return;
        }
        delete context;
        if (UCS_PTR_IS_ERR(request)) {
          fail_connection(Status::kPeerGone, std::string("send failed: ") +
                                                 ucs_status_string(UCS_PTR_STATUS(request)));
        }
      });
  if (!posted) {  // closing: the op never reaches the progress thread, so finish it here
    std::lock_guard<std::mutex> lock(mutex_);
    op->status = Status::kPeerGone;
    op->message = "the client is closed";
    op->finished = true;
    stats_.ops_failed++;
    finished_cv_.notify_all();
  }
}

void Client::seal_for_send(std::vector<uint8_t>* header, const Op& op, size_t iov_count) {
  if (op.seal == RawSeal::kAsIs || header->size() != kHeaderBytes) return;
  // The payload the seal covers (none for bulk kinds): small, so gathered into one buffer.
  std::vector<uint8_t> payload;
  const auto kind = static_cast<MessageKind>(get_le<uint16_t>(header->data() + 6));
  if (seal_covers_payload(kind)) {
    for (size_t i = 0; i < iov_count; ++i) {
      const auto* part = static_cast<const uint8_t*>(op.iov[i].buffer);
      payload.insert(payload.end(), part, part + op.iov[i].length);
    }
  }
  if (op.seal == RawSeal::kRepeatSequence) {
    const uint64_t sent = seal_.sent;
    seal_.sent = sent == 0 ? 0 : sent - 1;  // seals the last number sent again
    seal_header(header->data(), &seal_, payload.data(), payload.size());
    seal_.sent = sent;
    return;
  }
  seal_header(header->data(), &seal_, payload.data(), payload.size());
}

void Client::on_send_done(void* request, ucs_status_t status, void* user_data) {
  finish_transfer(request, status, user_data, "send failed: ");
}

void Client::on_recv_done(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  finish_transfer(request, status, user_data, "receive failed: ");
}

void Client::finish_transfer(void* request, ucs_status_t status, void* user_data,
                             const char* what) {
  auto* context = static_cast<RequestContext*>(user_data);
  auto op = std::static_pointer_cast<Op>(context->op);
  Client* self = context->client;
  delete context;
  ucp_request_free(request);
  op->inflight--;
  if (status != UCS_OK) {
    self->fail_connection(Status::kPeerGone, std::string(what) + ucs_status_string(status));
  }
  self->maybe_finish(op);
}

void Client::fail(const OpPtr& op, Status status, const std::string& message) {
  if (op->status == Status::kOk) {
    op->status = status;
    op->message = message;
  }
  op->replied = true;
  maybe_finish(op);
}

void Client::maybe_finish(const OpPtr& op) {
  if (!op->replied || op->inflight > 0) return;
  bool forged = false;
  if (op->decrypt) {
    op->decrypt = false;
    std::vector<Span> pieces;
    for (size_t i = 0; i < 4; ++i) {
      pieces.push_back({static_cast<uint8_t*>(op->iov[i].buffer), op->iov[i].length});
    }
    if (op->status == Status::kOk &&
        !seal_.receive_cipher.decrypt(op->sequence, pieces, op->tag.data())) {
      forged = true;
      op->status = Status::kMalformed;
      op->message = "the server's read reply does not decrypt (altered in flight)";
    }
  }
  if (forged) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.malformed_replies++;
    }
    fail_connection(Status::kMalformed, op->message);
  }
  auto it = ops_.find(op->id);
  if (it != ops_.end() && it->second == op) ops_.erase(it);
  std::lock_guard<std::mutex> lock(mutex_);
  if (op->finished) return;
  op->finished = true;
  if (op->status != Status::kOk) {
    stats_.ops_failed++;
  } else if (op->kind == MessageKind::kAppend) {
    stats_.bytes_sent += op->payload_bytes;
  } else if (op->kind == MessageKind::kRead) {
    stats_.bytes_read += op->payload_bytes;
  }
  finished_cv_.notify_all();
}

void Client::fail_connection(Status status, const std::string& message) {
  if (ep_open_) {
    ep_open_ = false;
    worker_.close_endpoint(ep_, /*force=*/true);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    connected_ = false;
  }
  std::vector<OpPtr> open;
  for (auto& [id, op] : ops_) open.push_back(op);
  for (const OpPtr& op : open) fail(op, status, message);
}

uint64_t Client::await(const OpPtr& op, double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!finished_cv_.wait_for(lock, to_duration(timeout_s), [&] { return op->finished; })) {
    lock.unlock();
    // If the client is closing this is not posted, but its shutdown fails every operation,
    // so the wait below ends either way.
    worker_.post([this, op, timeout_s] {
      {
        std::lock_guard<std::mutex> guard(mutex_);
        if (op->finished) return;
      }
      const std::string message = "no answer within " + std::to_string(timeout_s) + " s";
      if (op->status == Status::kOk) {
        op->status = Status::kTimeout;
        op->message = message;
      }
      // A transfer still in flight would go on touching the caller's memory after we return:
      // dropping the connection cancels it.
      if (op->inflight > 0)
        fail_connection(Status::kPeerGone, "connection dropped after: " + message);
      fail(op, Status::kTimeout, message);
    });
    lock.lock();
    finished_cv_.wait(lock, [&] { return op->finished; });
  }
  if (op->status != Status::kOk) {
    throw TransportError(op->status, std::string(status_name(op->status)) + ": " + op->message);
  }
  return op->durable_tokens;
}

uint64_t Client::run(const OpPtr& op, const WireHeader& h, const void* header_bytes,
                     const ucp_dt_iov_t* iov, size_t iov_count, double timeout_s) {
  check_timeout("timeout_s", timeout_s);
  submit(op, h, header_bytes, iov, iov_count);
  return await(op, timeout_s);
}

uint64_t Client::open(uint64_t request_id, uint32_t shard, uint32_t epoch, uint32_t record_bytes,
                      const uint8_t* fingerprints, const CapabilityBytes& capability,
                      uint64_t reserve_tokens, double timeout_s) {
  check_timeout("timeout_s", timeout_s);
  if (record_bytes == 0 || record_bytes > limits_.max_record_bytes) {
    throw std::invalid_argument("record_bytes must be in [1, " +
                                std::to_string(limits_.max_record_bytes) + "], got " +
                                std::to_string(record_bytes));
  }
  OpPtr op = new_op(MessageKind::kOpen);
  op->owned_payload.assign(fingerprints, fingerprints + 2 * kFingerprintBytes);
  WireHeader h = request_header(MessageKind::kOpen, op->id, request_id, shard, epoch, capability);
  h.record_bytes = record_bytes;
  h.durable_tokens = reserve_tokens;
  h.payload_bytes = op->owned_payload.size();
  const ucp_dt_iov_t iov{op->owned_payload.data(), op->owned_payload.size()};
  return run(op, h, nullptr, &iov, 1, timeout_s);
}

uint64_t Client::start_append(const AppendArgs& a) {
  uint64_t payload_bytes = 0;
  const WireLimits& limits = limits_;
  if (a.num_tokens == 0 || a.num_tokens > limits.max_tokens_per_message) {
    throw std::invalid_argument("append must hold 1 to " +
                                std::to_string(limits.max_tokens_per_message) + " tokens, got " +
                                std::to_string(a.num_tokens));
  }
  if (a.record_bytes == 0 || a.record_bytes > limits.max_record_bytes) {
    throw std::invalid_argument("record_bytes must be in [1, " +
                                std::to_string(limits.max_record_bytes) + "], got " +
                                std::to_string(a.record_bytes));
  }
  if (!append_payload_bytes(&payload_bytes, a.num_tokens, a.record_bytes) ||
      payload_bytes > limits.max_payload_bytes) {
    throw std::invalid_argument("append must hold 1 to " +
                                std::to_string(limits.max_payload_bytes) + " payload bytes, got " +
                                std::to_string(a.num_tokens) + " tokens of " +
                                std::to_string(a.record_bytes) + " bytes");
  }
  OpPtr op = new_op(MessageKind::kAppend);
  op->payload_bytes = payload_bytes;
  WireHeader h =
      request_header(MessageKind::kAppend, op->id, a.request_id, a.shard, a.epoch, a.capability);
  h.start_pos = a.start_pos;
  h.num_tokens = a.num_tokens;
  h.record_bytes = a.record_bytes;
  h.payload_bytes = payload_bytes + (options_.encrypt ? kCipherTagBytes : 0);
  const uint64_t n = a.num_tokens;
  const ucp_dt_iov_t iov[3] = {{const_cast<uint32_t*>(a.token_ids), 4 * n},
                               {const_cast<uint32_t*>(a.crcs), 4 * n},
                               {const_cast<uint8_t*>(a.records), n * a.record_bytes}};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    started_[op->id] = op;
  }
  submit(op, h, nullptr, iov, 3);
  return op->id;
}

uint64_t Client::wait(uint64_t op_id, double timeout_s) {
  check_timeout("timeout_s", timeout_s);
  OpPtr op;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = started_.find(op_id);
    if (it == started_.end()) {
      throw std::invalid_argument("op_id must be a started, unwaited append, got " +
                                  std::to_string(op_id));
    }
    op = it->second;
    started_.erase(it);
  }
  return await(op, timeout_s);
}

uint64_t Client::append(const AppendArgs& args, double timeout_s) {
  check_timeout("timeout_s", timeout_s);
  return wait(start_append(args), timeout_s);
}

void Client::release(uint64_t request_id, uint32_t shard, uint32_t epoch,
                     const CapabilityBytes& capability, double timeout_s) {
  check_timeout("timeout_s", timeout_s);
  OpPtr op = new_op(MessageKind::kRelease);
  const WireHeader h =
      request_header(MessageKind::kRelease, op->id, request_id, shard, epoch, capability);
  run(op, h, nullptr, nullptr, 0, timeout_s);
}

ReadReply Client::read(const ReadArgs& args, double timeout_s) {
  check_timeout("timeout_s", timeout_s);
  if (args.max_tokens == 0 || args.max_tokens > limits_.max_tokens_per_message) {
    throw std::invalid_argument("max_tokens must be in [1, " +
                                std::to_string(limits_.max_tokens_per_message) + "], got " +
                                std::to_string(args.max_tokens));
  }
  uint64_t reply_bytes = 0;
  if (args.record_bytes == 0 || args.record_bytes > limits_.max_record_bytes ||
      !append_payload_bytes(&reply_bytes, args.max_tokens, args.record_bytes) ||
      reply_bytes + 2 * kFingerprintBytes > limits_.max_payload_bytes) {
    // The reply would be refused as malformed on arrival, dropping the connection.
    throw std::invalid_argument("read reply must fit " + std::to_string(limits_.max_payload_bytes) +
                                " payload bytes, got " + std::to_string(args.max_tokens) +
                                " tokens of " + std::to_string(args.record_bytes) + " bytes");
  }
  OpPtr op = new_op(MessageKind::kRead);
  op->read = args;
  WireHeader h = request_header(MessageKind::kRead, op->id, args.request_id, args.shard, args.epoch,
                                args.capability);
  h.start_pos = args.start_pos;
  h.num_tokens = args.max_tokens;
  run(op, h, nullptr, nullptr, 0, timeout_s);
  return op->read_reply;
}

uint64_t Client::send_raw(const std::vector<uint8_t>& header, const std::vector<uint8_t>& payload,
                          uint64_t op_id, double timeout_s, RawReply reply, RawSeal seal) {
  check_timeout("timeout_s", timeout_s);
  auto op = std::make_shared<Op>();
  op->kind = MessageKind::kError;  // not a real operation kind: only its answer matters
  op->reply = reply;
  op->seal = seal;
  op->owned_header = header;
  op->owned_payload = payload;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!connected_) throw TransportError(Status::kPeerGone, "the connection is closed");
    if (op_id < kFirstRawOpId) {
      throw std::invalid_argument("op_id must be >= 2**63 (ids below are the client's own), got " +
                                  std::to_string(op_id));
    }
  }
  op->id = op_id;
  const ucp_dt_iov_t iov{op->owned_payload.data(), op->owned_payload.size()};
  return run(op, WireHeader{}, op->owned_header.data(), &iov, payload.empty() ? 0 : 1, timeout_s);
}

void Client::on_ep_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  static_cast<Client*>(arg)->fail_connection(
      Status::kPeerGone, std::string("the peer is gone: ") + ucs_status_string(status));
}

ucs_status_t Client::on_message(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Client*>(arg);
  WireHeader h;
  std::string why;
  if (!decode_header(&h, &why, header, header_length, length, self->options_.limits,
                     self->options_.encrypt ? kCipherTagBytes : 0)) {
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      self->stats_.malformed_replies++;
    }
    self->fail_connection(Status::kMalformed, "the server sent a malformed message: " + why);
    return UCS_OK;
  }
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  // After the handshake every message must carry the server's seal; a rendezvous payload is
  // not read here, so only a bulk kind (which the seal does not cover) may come that way.
  if (self->sealed_ && ((rndv && seal_covers_payload(h.kind)) ||
                        check_seal(static_cast<const uint8_t*>(header), &self->seal_, h.kind,
                                   static_cast<const uint8_t*>(data), length) != SealCheck::kOk)) {
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      self->stats_.malformed_replies++;
    }
    self->fail_connection(Status::kMalformed,
                          "the server sent a message whose seal does not verify (altered, "
                          "forged, replayed or reordered)");
    return UCS_OK;
  }
  return self->handle(h, data, rndv);
}

ucs_status_t Client::handle(const WireHeader& h, void* data, bool rndv) {
  auto it = ops_.find(h.op_id);
  OpPtr op = it == ops_.end() ? nullptr : it->second;
  const bool handshaking = op && op->id == kHandshakeOp;
  switch (h.kind) {
    case MessageKind::kChallenge:
      if (options_.handshake == Handshake::kSkip) return UCS_OK;  // left unanswered
      if (!handshaking || rndv) break;
      handle_challenge(static_cast<const uint8_t*>(data));
      return UCS_OK;
    case MessageKind::kAuthOk:
      if (!handshaking || rndv) break;
      handle_auth_ok(static_cast<const uint8_t*>(data));
      return UCS_OK;
    case MessageKind::kAck:
      if (op && !handshaking) {
        op->durable_tokens = h.durable_tokens;
        op->replied = true;
        maybe_finish(op);
      }
      return UCS_OK;  // no op: a late answer to an operation that timed out
    case MessageKind::kError:
      if (op) {
        fail(op, h.status,
             handshaking ? std::string("the server refused the handshake") +
                               (h.status == Status::kRejected ? " (wrong secret?)" : "")
                         : std::string(kind_name(op->kind)) + " of request " +
                               std::to_string(h.request_id) + " shard " + std::to_string(h.shard) +
                               " epoch " + std::to_string(h.epoch) + " refused by the server");
      }
      return UCS_OK;
    case MessageKind::kReadData:
      if (op && op->kind == MessageKind::kRead) return handle_read_data(op, h, data, rndv);
      if (!op) return UCS_OK;
      break;
    default:
      break;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.malformed_replies++;
  }
  fail_connection(Status::kMalformed, "the server sent an unexpected message");
  return UCS_OK;
}

ucs_status_t Client::handle_read_data(const OpPtr& op, const WireHeader& h, void* data, bool rndv) {
  const ReadArgs& a = op->read;
  if (h.num_tokens > a.max_tokens || h.start_pos > a.start_pos ||
      (h.num_tokens > 0 && h.record_bytes != a.record_bytes)) {
    fail(op, Status::kConflict,
         "the checkpoint holds records of " + std::to_string(h.record_bytes) +
             " bytes, the read expects " + std::to_string(a.record_bytes));
    return UCS_OK;
  }
  const uint64_t n = h.num_tokens;
  op->read_reply = {h.start_pos, h.num_tokens, h.durable_tokens};
  op->payload_bytes = h.payload_bytes;
  op->iov[0] = {a.fingerprints, 2 * kFingerprintBytes};
  op->iov[1] = {a.token_ids, 4 * n};
  op->iov[2] = {a.crcs, 4 * n};
  op->iov[3] = {a.records, n * a.record_bytes};
  size_t pieces = 4;
  if (options_.encrypt) {  // decrypted in place once all of it is here (maybe_finish)
    op->iov[pieces++] = {op->tag.data(), op->tag.size()};
    op->decrypt = true;
    op->sequence = seal_.received;
  }
  op->replied = true;
  if (!rndv) {
    const auto* in = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < pieces; ++i) {
      if (op->iov[i].length > 0) std::memcpy(op->iov[i].buffer, in, op->iov[i].length);
      in += op->iov[i].length;
    }
    maybe_finish(op);
    return UCS_OK;
  }
  auto* context = new RequestContext{this, op};
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.datatype = ucp_dt_make_iov();
  param.cb.recv_am = &Client::on_recv_done;
  param.user_data = context;
  ucs_status_ptr_t request = ucp_am_recv_data_nbx(worker_.handle(), data, op->iov, pieces, &param);
  if (UCS_PTR_IS_PTR(request)) {
    op->inflight++;
  } else {
    delete context;
    if (UCS_PTR_IS_ERR(request)) {
      fail(op, Status::kPeerGone,
           std::string("receive failed: ") + ucs_status_string(UCS_PTR_STATUS(request)));
    }
    maybe_finish(op);
  }
  return UCS_INPROGRESS;
}

void Client::handle_challenge(const uint8_t* payload) {
  OpPtr op = ops_.at(kHandshakeOp);  // handle() checked it is there
  HandshakeTranscript& t = transcript_;
  std::memcpy(t.server_nonce.data(), payload, kNonceBytes);
  std::memcpy(t.server_key.data(), payload + kNonceBytes, kExchangeKeyBytes);
  t.client_nonce = random_nonce();
  EphemeralKey exchange = generate_ephemeral_key();
  t.client_key = exchange.public_key;
  const uint64_t flags = options_.encrypt ? kAuthEncrypt : 0;
  try {
    const SessionKeys keys =
        derive_session_keys(options_.secret, exchange.private_key, t.server_key, t, flags);
    seal_.send_key = MacKey(keys.client_to_server);
    seal_.receive_key = MacKey(keys.server_to_client);
    if (options_.encrypt) {
      seal_.send_cipher = PayloadCipher(keys.client_to_server_cipher);
      seal_.receive_cipher = PayloadCipher(keys.server_to_client_cipher);
    }
  } catch (const std::runtime_error& e) {
    fail_connection(Status::kRejected, std::string("the server's exchange key: ") + e.what());
    return;
  }
  exchange.private_key.fill(0);  // used once
  const Mac mac = handshake_mac(options_.secret, "client", t);
  op->owned_payload.assign(t.client_nonce.begin(), t.client_nonce.end());
  op->owned_payload.insert(op->owned_payload.end(), t.client_key.begin(), t.client_key.end());
  op->owned_payload.insert(op->owned_payload.end(), mac.begin(), mac.end());
  if (options_.identity) {
    const Identity& identity = *options_.identity;
    const std::vector<uint8_t> message = identity_message(t);
    Ed25519Signature proof{};
    try {
      proof = Ed25519Signer(identity.private_key).sign(message.data(), message.size());
    } catch (const std::runtime_error& e) {
      fail_connection(Status::kRejected, std::string("signing the identity proof: ") + e.what());
      return;
    }
    op->owned_payload.insert(op->owned_payload.end(), identity.credential.begin(),
                             identity.credential.end());
    op->owned_payload.insert(op->owned_payload.end(), proof.begin(), proof.end());
  }
  WireHeader h;
  h.kind = MessageKind::kAuth;
  h.op_id = kHandshakeOp;
  h.start_pos = flags;
  h.payload_bytes = op->owned_payload.size();
  const ucp_dt_iov_t iov{op->owned_payload.data(), op->owned_payload.size()};
  // On the progress thread already: the posted send runs right after this callback returns.
  submit(op, h, nullptr, &iov, 1);
}

void Client::handle_auth_ok(const uint8_t* payload) {
  const uint8_t* announced = payload + kMacBytes;
  const Mac expected =
      handshake_mac(options_.secret, "server", transcript_, announced, kLimitsBytes);
  if (!mac_equal(expected.data(), payload)) {
    fail_connection(Status::kRejected, "the server did not prove the cluster secret");
    return;
  }
  WireLimits server_limits;
  if (!decode_limits(&server_limits, announced)) {
    fail_connection(Status::kMalformed, "the server announced a limit of 0");
    return;
  }
  limits_ = min_limits(options_.limits, server_limits);
  sealed_ = true;  // the server proved the secret over the transcript the keys are bound to
  {
    std::lock_guard<std::mutex> lock(mutex_);
    connected_ = true;
  }
  OpPtr op = ops_.at(kHandshakeOp);  // handle() checked it is there
  op->replied = true;
  maybe_finish(op);
}

}  // namespace lumen::transport
