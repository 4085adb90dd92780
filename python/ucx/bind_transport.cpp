// Bindings of the native transport: Server (made over a HolderStore by bind_holder.cpp), Client,
// Ed25519 capabilities and the wire header codec. Unpack, check cheap invariants, release the GIL,
// call csrc.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "lumen/transport/auth.h"
#include "lumen/transport/capability.h"
#include "lumen/transport/client.h"
#include "lumen/transport/error.h"
#include "lumen/transport/server.h"
#include "lumen/transport/sink.h"
#include "lumen/transport/wire.h"
#include "ucx_args.h"

namespace py = pybind11;
namespace lt = lumen::transport;

namespace {

using U32Array = py::array_t<uint32_t, py::array::c_style>;
using U8Array = py::array_t<uint8_t, py::array::c_style>;

using lumen_bind::to_bytes;
using lumen_bind::to_capability;
using lumen_bind::to_limits;

py::dict stats_dict(const lt::ServerStats& s) {
  py::dict d;
  d["connections_accepted"] = s.connections_accepted;
  d["connections_refused"] = s.connections_refused;
  d["connections_failed"] = s.connections_failed;
  d["connections_unauthenticated"] = s.connections_unauthenticated;
  d["connections_active"] = s.connections_active;
  d["handshakes_ok"] = s.handshakes_ok;
  d["handshakes_failed"] = s.handshakes_failed;
  d["handshake_timeouts"] = s.handshake_timeouts;
  d["malformed"] = s.malformed;
  d["unauthenticated"] = s.unauthenticated;
  d["bad_seals"] = s.bad_seals;
  d["out_of_sequence"] = s.out_of_sequence;
  d["bad_capability"] = s.bad_capability;
  d["identified"] = s.identified;
  d["bad_credentials"] = s.bad_credentials;
  d["encrypted"] = s.encrypted;
  d["decrypt_failures"] = s.decrypt_failures;
  d["capability_refused"] = s.capability_refused;
  d["stale_epoch"] = s.stale_epoch;
  d["rejected"] = s.rejected;
  d["conflicts"] = s.conflicts;
  d["crc_failures"] = s.crc_failures;
  d["receive_timeouts"] = s.receive_timeouts;
  d["receives_in_flight"] = s.receives_in_flight;
  d["appends_committed"] = s.appends_committed;
  d["appends_aborted"] = s.appends_aborted;
  d["tokens_committed"] = s.tokens_committed;
  d["bytes_received"] = s.bytes_received;
  d["opens"] = s.opens;
  d["releases"] = s.releases;
  d["reads"] = s.reads;
  return d;
}

// The client plus the arrays its started appends send from. Declaration order matters: the
// client is destroyed first (which finishes every operation), then the arrays it used.
struct PyClient {
  std::map<uint64_t, py::object> sending;
  std::unique_ptr<lt::Client> client;
};

// The wire's token counts and record sizes are u32: a larger dimension must not be cut.
void check_u32_shape(const U8Array& records, const char* name) {
  for (int axis = 0; axis < 2; ++axis) {
    if (static_cast<uint64_t>(records.shape(axis)) > UINT32_MAX) {
      throw py::value_error(std::string(name) + " must have dimensions under 2**32, got " +
                            std::to_string(records.shape(axis)));
    }
  }
}

}  // namespace

void bind_transport(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const lt::TransportError& e) {
      py::object classes = py::module_::import("lumen_core.transport.errors").attr("BY_STATUS");
      py::object cls = classes.attr("get")(static_cast<uint32_t>(e.status()));
      if (cls.is_none()) {
        cls = py::module_::import("lumen_core.transport.errors").attr("TransportError");
      }
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  m.attr("HEADER_BYTES") = lt::kHeaderBytes;
  m.attr("WIRE_VERSION") = lt::kWireVersion;
  m.attr("MIN_SECRET_BYTES") = lt::kMinSecretBytes;

  m.attr("CAPABILITY_BYTES") = lt::kCapabilityBytes;
  m.attr("ISSUER_KEY_BYTES") = lt::kIssuerKeyBytes;
  m.attr("RIGHT_WRITE") = static_cast<uint32_t>(lt::kRightWrite);
  m.attr("RIGHT_READ") = static_cast<uint32_t>(lt::kRightRead);

  m.def(
      "generate_exchange_key",
      [] {
        const lt::EphemeralKey key = lt::generate_ephemeral_key();
        return py::make_tuple(to_bytes(key.private_key), to_bytes(key.public_key));
      },
      "A fresh X25519 key pair (private, public), 32 bytes each.");
  m.def(
      "exchange_shared_secret",
      [](const py::bytes& private_key, const py::bytes& peer_public_key) {
        return to_bytes(lt::exchange_shared_secret(
            lumen_bind::to_byte_array<lt::kExchangeKeyBytes>(private_key, "private_key"),
            lumen_bind::to_byte_array<lt::kExchangeKeyBytes>(peer_public_key, "peer_public_key")));
      },
      py::arg("private_key"), py::arg("peer_public_key"),
      "The 32-byte X25519 shared secret; RuntimeError for a peer key OpenSSL refuses.");
  m.def(
      "measure_seal_ns",
      [](uint32_t count) {
        py::gil_scoped_release release;
        return lt::measure_seal_ns(count);
      },
      py::arg("count"),
      "Nanoseconds one seal plus one check of a message header take here (mean of count).");

  m.attr("CREDENTIAL_BYTES") = lt::kCredentialBytes;
  m.def(
      "measure_cipher_bytes_per_s",
      [](size_t bytes, uint32_t count) {
        py::gil_scoped_release release;
        return lt::measure_cipher_bytes_per_s(bytes, count);
      },
      py::arg("bytes"), py::arg("count"),
      "Bytes per second of one AES-256-GCM encryption plus one decryption here (payload cipher).");
  m.def(
      "generate_ed25519_key", [] { return to_bytes(lt::generate_ed25519_key()); },
      "A fresh 32-byte Ed25519 private key (an issuer's or a worker's identity).");
  m.def(
      "ed25519_public_key",
      [](const py::bytes& private_key) {
        const lt::Ed25519Signer signer(
            lumen_bind::to_byte_array<lt::kEd25519KeyBytes>(private_key, "private_key"));
        return to_bytes(signer.public_key());
      },
      py::arg("private_key"), "The 32-byte public key of an Ed25519 private key.");

  py::class_<lt::CapabilityIssuer>(m, "CapabilityIssuer")
      .def(py::init([](const py::bytes& private_key) {
             return std::make_unique<lt::CapabilityIssuer>(
                 lumen_bind::to_byte_array<lt::kIssuerKeyBytes>(private_key, "private_key"));
           }),
           py::arg("private_key"))
      .def_property_readonly("public_key",
                             [](const lt::CapabilityIssuer& i) { return to_bytes(i.public_key()); })
      .def(
          "issue",
          [](const lt::CapabilityIssuer& issuer, uint64_t request_id, uint32_t shard,
             uint32_t epoch, uint64_t holder_id, uint32_t rights, uint64_t expires_at_ms,
             std::optional<uint64_t> bearer) {
            lt::Capability c;
            c.bearer = bearer;
            c.request_id = request_id;
            c.shard = shard;
            c.epoch = epoch;
            c.holder_id = holder_id;
            c.rights = rights;
            c.expires_at_ms = expires_at_ms;
            return to_bytes(issuer.issue(c));
          },
          py::kw_only(), py::arg("request_id"), py::arg("shard"), py::arg("epoch"),
          py::arg("holder_id"), py::arg("rights"), py::arg("expires_at_ms"),
          py::arg("bearer") = py::none(),
          "The signed capability bytes (lumen/transport/capability.h has the layout).")
      .def(
          "issue_credential",
          [](const lt::CapabilityIssuer& issuer, uint64_t worker_id, uint32_t epoch,
             const py::bytes& public_key) {
            lt::Credential c;
            c.worker_id = worker_id;
            c.epoch = epoch;
            c.public_key =
                lumen_bind::to_byte_array<lt::kEd25519KeyBytes>(public_key, "public_key");
            return to_bytes(issuer.issue_credential(c));
          },
          py::kw_only(), py::arg("worker_id"), py::arg("epoch"), py::arg("public_key"),
          "The signed worker credential bytes (lumen/transport/capability.h has the layout).");

  m.def(
      "verify_credential",
      [](const py::bytes& public_key, const py::bytes& credential) {
        const lt::CapabilityVerifier verifier(
            lumen_bind::to_byte_array<lt::kIssuerKeyBytes>(public_key, "public_key"));
        lt::Credential c;
        std::string why;
        if (!verifier.verify_credential(
                &c, &why,
                lumen_bind::to_byte_array<lt::kCredentialBytes>(credential, "credential"))) {
          throw py::value_error("credential must be signed by the issuer, got: " + why);
        }
        py::dict d;
        d["worker_id"] = c.worker_id;
        d["epoch"] = c.epoch;
        d["public_key"] = to_bytes(c.public_key);
        return d;
      },
      py::arg("public_key"), py::arg("credential"),
      "The fields of a worker credential whose signature public_key verifies; ValueError "
      "otherwise.");

  m.def(
      "verify_capability",
      [](const py::bytes& public_key, const py::bytes& capability) {
        const lt::CapabilityVerifier verifier(
            lumen_bind::to_byte_array<lt::kIssuerKeyBytes>(public_key, "public_key"));
        lt::Capability c;
        std::string why;
        if (!verifier.verify(&c, &why, to_capability(capability, "capability"))) {
          throw py::value_error("capability must be signed by the issuer, got: " + why);
        }
        py::dict d;
        d["request_id"] = c.request_id;
        d["shard"] = c.shard;
        d["epoch"] = c.epoch;
        d["holder_id"] = c.holder_id;
        d["rights"] = c.rights;
        d["expires_at_ms"] = c.expires_at_ms;
        d["bearer"] = c.bearer ? py::cast(*c.bearer) : py::none();
        return d;
      },
      py::arg("public_key"), py::arg("capability"),
      "The fields of a capability whose signature public_key verifies; ValueError otherwise.");

  m.def(
      "encode_header",
      [](uint16_t kind, uint64_t request_id, uint64_t op_id, uint32_t shard, uint32_t epoch,
         uint64_t start_pos, uint32_t num_tokens, uint32_t record_bytes, uint64_t payload_bytes,
         uint64_t durable_tokens, uint32_t status, const py::bytes& capability, uint16_t version) {
        lt::WireHeader h;
        h.version = version;
        h.kind = static_cast<lt::MessageKind>(kind);
        h.request_id = request_id;
        h.op_id = op_id;
        h.shard = shard;
        h.epoch = epoch;
        h.start_pos = start_pos;
        h.num_tokens = num_tokens;
        h.record_bytes = record_bytes;
        h.payload_bytes = payload_bytes;
        h.durable_tokens = durable_tokens;
        h.status = static_cast<lt::Status>(status);
        h.capability = to_capability(capability, "capability");
        std::string out(lt::kHeaderBytes, '\0');
        lt::encode_header(reinterpret_cast<uint8_t*>(out.data()), h);
        return py::bytes(out);
      },
      py::arg("kind"), py::arg("request_id") = 0, py::arg("op_id") = 0, py::arg("shard") = 0,
      py::arg("epoch") = 0, py::arg("start_pos") = 0, py::arg("num_tokens") = 0,
      py::arg("record_bytes") = 0, py::arg("payload_bytes") = 0, py::arg("durable_tokens") = 0,
      py::arg("status") = 0,
      py::arg("capability") = py::bytes(std::string(lt::kCapabilityBytes, '\0')),
      py::arg("version") = lt::kWireVersion,
      "Encodes any field values (valid or not) into a wire header with a correct crc.");

  m.def(
      "decode_header",
      [](const py::bytes& header, uint64_t payload_length, uint32_t max_tokens,
         uint32_t max_record_bytes, uint64_t max_payload_bytes) {
        const std::string bytes = header;
        lt::WireHeader h;
        std::string why;
        if (!lt::decode_header(&h, &why, bytes.data(), bytes.size(), payload_length,
                               to_limits(max_tokens, max_record_bytes, max_payload_bytes))) {
          throw py::value_error("header must be valid, got: " + why);
        }
        py::dict d;
        d["kind"] = static_cast<uint16_t>(h.kind);
        d["request_id"] = h.request_id;
        d["op_id"] = h.op_id;
        d["shard"] = h.shard;
        d["epoch"] = h.epoch;
        d["start_pos"] = h.start_pos;
        d["num_tokens"] = h.num_tokens;
        d["record_bytes"] = h.record_bytes;
        d["payload_bytes"] = h.payload_bytes;
        d["durable_tokens"] = h.durable_tokens;
        d["status"] = static_cast<uint32_t>(h.status);
        d["capability"] =
            py::bytes(reinterpret_cast<const char*>(h.capability.data()), h.capability.size());
        return d;
      },
      py::arg("header"), py::arg("payload_length"), py::arg("max_tokens_per_message"),
      py::arg("max_record_bytes"), py::arg("max_payload_bytes"),
      "Validates a header as a receiver does; ValueError says what is wrong.");

  // What serve_holder_store (bind_holder.cpp) builds a Server with; Python checked each value,
  // the Server re-checks the secret and the deadlines.
  py::class_<lt::ServerOptions>(m, "ServerOptions")
      .def(py::init([](const py::bytes& secret, uint64_t holder_id,
                       const std::optional<py::bytes>& issuer_public_key,
                       const std::string& address, uint16_t port, const std::string& tls,
                       uint32_t max_tokens, uint32_t max_record_bytes, uint64_t max_payload_bytes,
                       bool verify_records, double handshake_timeout_s,
                       uint32_t max_unauthenticated, double receive_timeout_s) {
             lt::ServerOptions options;
             options.secret = secret;
             options.holder_id = holder_id;
             if (issuer_public_key) {
               options.issuer_public_key = lumen_bind::to_byte_array<lt::kIssuerKeyBytes>(
                   *issuer_public_key, "issuer_public_key");
             }
             options.address = address;
             options.port = port;
             options.tls = tls;
             options.limits = to_limits(max_tokens, max_record_bytes, max_payload_bytes);
             options.verify_records = verify_records;
             options.handshake_timeout_s = handshake_timeout_s;
             options.max_unauthenticated = max_unauthenticated;
             options.receive_timeout_s = receive_timeout_s;
             return options;
           }),
           py::kw_only(), py::arg("secret"), py::arg("holder_id"), py::arg("issuer_public_key"),
           py::arg("address"), py::arg("port"), py::arg("tls"), py::arg("max_tokens_per_message"),
           py::arg("max_record_bytes"), py::arg("max_payload_bytes"), py::arg("verify_records"),
           py::arg("handshake_timeout_s"), py::arg("max_unauthenticated"),
           py::arg("receive_timeout_s"));

  // Constructed by serve_holder_store (bind_holder.cpp) over its HolderStore.
  py::class_<lt::Server>(m, "Server")
      .def_property_readonly("port", &lt::Server::port)
      .def(
          "trust_issuer",
          [](lt::Server& s, const py::bytes& public_key) {
            const lt::IssuerKey key =
                lumen_bind::to_byte_array<lt::kIssuerKeyBytes>(public_key, "public_key");
            py::gil_scoped_release release;
            s.trust_issuer(key);
          },
          py::arg("public_key"))
      .def("stats",
           [](lt::Server& s) {
             lt::ServerStats stats;
             {
               py::gil_scoped_release release;
               stats = s.stats();
             }
             return stats_dict(stats);
           })
      .def("close", &lt::Server::close, py::call_guard<py::gil_scoped_release>());

  py::class_<PyClient>(m, "Client")
      .def(py::init([](const std::string& address, uint16_t port, const py::bytes& secret,
                       const std::string& tls, double connect_timeout_s, uint32_t max_tokens,
                       uint32_t max_record_bytes, uint64_t max_payload_bytes, bool skip_handshake,
                       const py::bytes& credential, const py::bytes& identity_key, bool encrypt) {
             lt::ClientOptions options;
             options.address = address;
             options.port = port;
             options.secret = secret;
             options.tls = tls;
             options.connect_timeout_s = connect_timeout_s;
             options.limits = to_limits(max_tokens, max_record_bytes, max_payload_bytes);
             options.handshake = skip_handshake ? lt::Handshake::kSkip : lt::Handshake::kProve;
             options.encrypt = encrypt;
             if (py::len(credential) > 0 || py::len(identity_key) > 0) {
               options.identity = lumen_bind::to_identity(credential, identity_key);
             }
             auto out = std::make_unique<PyClient>();
             py::gil_scoped_release release;
             out->client = std::make_unique<lt::Client>(options);
             return out;
           }),
           py::kw_only(), py::arg("address"), py::arg("port"), py::arg("secret"), py::arg("tls"),
           py::arg("connect_timeout_s"), py::arg("max_tokens_per_message"),
           py::arg("max_record_bytes"), py::arg("max_payload_bytes"),
           py::arg("skip_handshake") = false, py::arg("credential") = py::bytes(),
           py::arg("identity_key") = py::bytes(), py::arg("encrypt") = false)
      .def(
          "open",
          [](PyClient& c, uint64_t request_id, uint32_t shard, uint32_t epoch,
             uint32_t record_bytes, const py::bytes& fingerprints, const py::bytes& capability,
             uint64_t reserve_tokens, double timeout_s) {
            const std::string fp = fingerprints;
            if (fp.size() != 2 * lt::kFingerprintBytes) {
              throw py::value_error("fingerprints must be 64 bytes, got " +
                                    std::to_string(fp.size()));
            }
            const lt::CapabilityBytes cap = to_capability(capability, "capability");
            py::gil_scoped_release release;
            return c.client->open(request_id, shard, epoch, record_bytes,
                                  reinterpret_cast<const uint8_t*>(fp.data()), cap, reserve_tokens,
                                  timeout_s);
          },
          py::arg("request_id"), py::arg("shard"), py::arg("epoch"), py::arg("record_bytes"),
          py::arg("fingerprints"), py::arg("capability"), py::arg("reserve_tokens"),
          py::arg("timeout_s"))
      .def(
          "start_append",
          [](PyClient& c, uint64_t request_id, uint32_t shard, uint32_t epoch, uint64_t start_pos,
             const U32Array& token_ids, const U32Array& crcs, const U8Array& records,
             const py::bytes& capability) {
            // Python validated shapes; re-check what memory safety depends on.
            if (records.ndim() != 2 || token_ids.ndim() != 1 || crcs.ndim() != 1 ||
                token_ids.shape(0) != records.shape(0) || crcs.shape(0) != records.shape(0)) {
              throw py::value_error("records must be [n, record_bytes] with n token_ids and crcs");
            }
            check_u32_shape(records, "records");
            lt::AppendArgs a;
            a.request_id = request_id;
            a.shard = shard;
            a.epoch = epoch;
            a.start_pos = start_pos;
            a.num_tokens = static_cast<uint32_t>(records.shape(0));
            a.record_bytes = static_cast<uint32_t>(records.shape(1));
            a.token_ids = token_ids.data();
            a.crcs = crcs.data();
            a.records = records.data();
            a.capability = to_capability(capability, "capability");
            uint64_t op_id = 0;
            {
              py::gil_scoped_release release;
              op_id = c.client->start_append(a);
            }
            c.sending[op_id] = py::make_tuple(token_ids, crcs, records);
            return op_id;
          },
          py::arg("request_id"), py::arg("shard"), py::arg("epoch"), py::arg("start_pos"),
          py::arg("token_ids").noconvert(), py::arg("crcs").noconvert(),
          py::arg("records").noconvert(), py::arg("capability"))
      .def(
          "wait",
          [](PyClient& c, uint64_t op_id, double timeout_s) {
            uint64_t durable = 0;
            try {
              py::gil_scoped_release release;
              durable = c.client->wait(op_id, timeout_s);
            } catch (...) {
              c.sending.erase(op_id);
              throw;
            }
            c.sending.erase(op_id);
            return durable;
          },
          py::arg("op_id"), py::arg("timeout_s"))
      .def(
          "release",
          [](PyClient& c, uint64_t request_id, uint32_t shard, uint32_t epoch,
             const py::bytes& capability, double timeout_s) {
            const lt::CapabilityBytes cap = to_capability(capability, "capability");
            py::gil_scoped_release release;
            c.client->release(request_id, shard, epoch, cap, timeout_s);
          },
          py::arg("request_id"), py::arg("shard"), py::arg("epoch"), py::arg("capability"),
          py::arg("timeout_s"))
      .def(
          "read",
          [](PyClient& c, uint64_t request_id, uint32_t shard, uint32_t epoch, uint64_t start_pos,
             U32Array& token_ids, U32Array& crcs, U8Array& records, const py::bytes& capability,
             double timeout_s) {
            if (records.ndim() != 2 || token_ids.ndim() != 1 || crcs.ndim() != 1 ||
                token_ids.shape(0) != records.shape(0) || crcs.shape(0) != records.shape(0)) {
              throw py::value_error("records must be [n, record_bytes] with n token_ids and crcs");
            }
            check_u32_shape(records, "records");
            std::string fingerprints(2 * lt::kFingerprintBytes, '\0');
            lt::ReadArgs a;
            a.request_id = request_id;
            a.shard = shard;
            a.epoch = epoch;
            a.start_pos = start_pos;
            a.max_tokens = static_cast<uint32_t>(records.shape(0));
            a.record_bytes = static_cast<uint32_t>(records.shape(1));
            a.token_ids = token_ids.mutable_data();
            a.crcs = crcs.mutable_data();
            a.records = records.mutable_data();
            a.fingerprints = reinterpret_cast<uint8_t*>(fingerprints.data());
            a.capability = to_capability(capability, "capability");
            lt::ReadReply reply;
            {
              py::gil_scoped_release release;
              reply = c.client->read(a, timeout_s);
            }
            return py::make_tuple(reply.start_pos, reply.num_tokens, reply.durable_tokens,
                                  py::bytes(fingerprints));
          },
          py::arg("request_id"), py::arg("shard"), py::arg("epoch"), py::arg("start_pos"),
          py::arg("token_ids").noconvert(), py::arg("crcs").noconvert(),
          py::arg("records").noconvert(), py::arg("capability"), py::arg("timeout_s"))
      .def(
          "send_raw",
          [](PyClient& c, const py::bytes& header, const py::bytes& payload, uint64_t op_id,
             double timeout_s, bool reply_ep, const std::string& seal) {
            const std::map<std::string, lt::RawSeal> seals = {
                {"seal", lt::RawSeal::kSeal},
                {"repeat_sequence", lt::RawSeal::kRepeatSequence},
                {"as_is", lt::RawSeal::kAsIs}};
            const auto it = seals.find(seal);
            if (it == seals.end()) {
              throw py::value_error("seal must be 'seal', 'repeat_sequence' or 'as_is', got '" +
                                    seal + "'");
            }
            const std::string h = header;
            const std::string p = payload;
            py::gil_scoped_release release;
            return c.client->send_raw(
                std::vector<uint8_t>(h.begin(), h.end()), std::vector<uint8_t>(p.begin(), p.end()),
                op_id, timeout_s,
                reply_ep ? lt::RawReply::kWithReplyEp : lt::RawReply::kWithoutReplyEp, it->second);
          },
          py::arg("header"), py::arg("payload"), py::arg("op_id"), py::arg("timeout_s"),
          py::kw_only(), py::arg("reply_ep") = true, py::arg("seal") = "seal")
      .def(
          "measure_bandwidth",
          [](PyClient& c, uint64_t message_bytes, uint32_t count, uint32_t window, uint32_t shard,
             const py::bytes& capability, double timeout_s) {
            const lt::CapabilityBytes cap = to_capability(capability, "capability");
            py::gil_scoped_release release;
            return c.client->measure_bandwidth(message_bytes, count, window, shard, cap, timeout_s);
          },
          py::arg("message_bytes"), py::arg("count"), py::arg("window"), py::arg("shard"),
          py::arg("capability"), py::arg("timeout_s"))
      .def("transports",
           [](PyClient& c) {
             py::gil_scoped_release release;
             return c.client->transports();
           })
      .def_property_readonly("connected", [](PyClient& c) { return c.client->connected(); })
      .def_property_readonly("limits",
                             [](PyClient& c) {
                               const lt::WireLimits l = c.client->limits();
                               return py::make_tuple(l.max_tokens_per_message, l.max_record_bytes,
                                                     l.max_payload_bytes);
                             })
      .def("stats",
           [](PyClient& c) {
             const lt::ClientStats s = c.client->stats();
             py::dict d;
             d["ops_started"] = s.ops_started;
             d["ops_failed"] = s.ops_failed;
             d["bytes_sent"] = s.bytes_sent;
             d["bytes_read"] = s.bytes_read;
             d["malformed_replies"] = s.malformed_replies;
             return d;
           })
      .def("close", [](PyClient& c) {
        {
          py::gil_scoped_release release;
          c.client->close();
        }
        c.sending.clear();
      });
}
