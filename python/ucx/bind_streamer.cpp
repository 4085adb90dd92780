// Bindings of the native checkpoint streamer (lumen/holder/streamer.h). Python validates;
// this unpacks, re-checks cheap invariants, releases the GIL and calls csrc.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lumen/holder/streamer.h"
#include "lumen/transport/wire.h"
#include "ucx_args.h"

namespace py = pybind11;
namespace lh = lumen::holder;
namespace lt = lumen::transport;

namespace {

using I64Array = py::array_t<int64_t, py::array::c_style>;
using U64Array = py::array_t<uint64_t, py::array::c_style>;
using U32Array = py::array_t<uint32_t, py::array::c_style>;
using Address = std::pair<std::string, uint16_t>;

lh::HolderAddress to_address(const Address& a) { return {a.first, a.second}; }

}  // namespace

void bind_streamer(py::module_& m) {
  // Whether Streamer(cuda_device=...) can read a KV cache on a CUDA device in this build.
  m.attr("STREAMER_CUDA") = lh::cuda_step_gather_built();
  py::class_<lh::Streamer>(m, "Streamer")
      .def(py::init([](const py::bytes& secret, const std::string& tls, uint32_t shard,
                       const I64Array& descriptors, uint32_t record_bytes,
                       const py::bytes& fingerprints, int64_t staging_buffers,
                       int64_t staging_bytes, int64_t max_queued_steps, double ack_timeout_s,
                       double connect_timeout_s, double reconnect_backoff_s, double give_up_after_s,
                       int gather_threads, int cuda_device, uint32_t max_tokens,
                       uint32_t max_record_bytes, uint64_t max_payload_bytes, bool encrypt) {
             const auto [planes, num_planes] = lumen_bind::to_planes(descriptors);
             lh::StreamerOptions options;
             options.secret = secret;
             options.tls = tls;
             options.shard = shard;
             options.planes.assign(planes, planes + num_planes);
             options.record_bytes = record_bytes;
             const std::string fp = fingerprints;
             options.fingerprints.assign(fp.begin(), fp.end());
             options.staging_buffers = staging_buffers;
             options.staging_bytes = staging_bytes;
             options.max_queued_steps = max_queued_steps;
             options.ack_timeout_s = ack_timeout_s;
             options.connect_timeout_s = connect_timeout_s;
             options.reconnect_backoff_s = reconnect_backoff_s;
             options.give_up_after_s = give_up_after_s;
             options.gather_threads = gather_threads;
             options.cuda_device = cuda_device;
             options.limits =
                 lumen_bind::to_limits(max_tokens, max_record_bytes, max_payload_bytes);
             options.encrypt = encrypt;
             // Building the UCX context and pinning the staging buffers takes tens of ms,
             // more on a loaded machine: the process's other threads (heartbeats) go on.
             py::gil_scoped_release release;
             return std::make_unique<lh::Streamer>(options);
           }),
           py::kw_only(), py::arg("secret"), py::arg("tls"), py::arg("shard"),
           py::arg("descriptors"), py::arg("record_bytes"), py::arg("fingerprints"),
           py::arg("staging_buffers"), py::arg("staging_bytes"), py::arg("max_queued_steps"),
           py::arg("ack_timeout_s"), py::arg("connect_timeout_s"), py::arg("reconnect_backoff_s"),
           py::arg("give_up_after_s"), py::arg("gather_threads"), py::arg("cuda_device"),
           py::arg("max_tokens_per_message"), py::arg("max_record_bytes"),
           py::arg("max_payload_bytes"), py::arg("encrypt") = false)
      .def(
          "set_identity",
          [](lh::Streamer& s, const py::bytes& credential, const py::bytes& identity_key) {
            s.set_identity(lumen_bind::to_identity(credential, identity_key));
          },
          py::kw_only(), py::arg("credential"), py::arg("identity_key"))
      .def(
          "add_request",
          [](lh::Streamer& s, uint64_t request_id, const std::vector<Address>& holders,
             const std::vector<py::bytes>& capabilities, uint32_t epoch, uint64_t expected_tokens) {
            std::vector<lt::CapabilityBytes> caps;
            for (const py::bytes& c : capabilities) {
              caps.push_back(lumen_bind::to_capability(c, "capability"));
            }
            std::vector<lh::HolderAddress> addresses;
            for (const Address& a : holders) addresses.push_back(to_address(a));
            s.add_request(request_id, addresses, caps, epoch, expected_tokens);
          },
          py::arg("request_id"), py::arg("holders"), py::arg("capabilities"), py::arg("epoch"),
          py::arg("expected_tokens"))
      .def(
          "renew",
          [](lh::Streamer& s, uint64_t request_id, const std::vector<py::bytes>& capabilities) {
            std::vector<lt::CapabilityBytes> caps;
            for (const py::bytes& c : capabilities) {
              caps.push_back(lumen_bind::to_capability(c, "capability"));
            }
            s.renew(request_id, caps);
          },
          py::arg("request_id"), py::arg("capabilities"))
      .def(
          "save_step",
          [](lh::Streamer& s, const U64Array& request_ids, const U64Array& positions,
             const I64Array& slot_ids, const U32Array& token_ids, uintptr_t engine_stream) {
            const size_t n = static_cast<size_t>(request_ids.size());
            if (static_cast<size_t>(positions.size()) != n ||
                static_cast<size_t>(slot_ids.size()) != n ||
                static_cast<size_t>(token_ids.size()) != n) {
              throw py::value_error("save_step arrays must have one entry per token");
            }
            py::gil_scoped_release release;
            return s.save_step(request_ids.data(), positions.data(), slot_ids.data(),
                               token_ids.data(), n, engine_stream);
          },
          py::arg("request_ids"), py::arg("positions"), py::arg("slot_ids"), py::arg("token_ids"),
          py::arg("engine_stream") = 0)
      .def("wait_for_save", &lh::Streamer::wait_for_save, py::arg("request_id"),
           py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def("wait_fence", &lh::Streamer::wait_fence, py::arg("fence"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("flush", &lh::Streamer::flush, py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("release", &lh::Streamer::release, py::arg("request_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("forget", &lh::Streamer::forget, py::arg("request_id"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "replace_holder",
          [](lh::Streamer& s, const Address& old_holder, const Address& new_holder,
             const std::map<uint64_t, py::bytes>& capabilities) {
            std::map<uint64_t, lt::CapabilityBytes> caps;
            for (const auto& [request_id, c] : capabilities) {
              caps[request_id] = lumen_bind::to_capability(c, "capability");
            }
            return s.replace_holder(to_address(old_holder), to_address(new_holder), caps);
          },
          py::arg("old_holder"), py::arg("new_holder"), py::arg("capabilities"))
      .def("stats",
           [](lh::Streamer& s) {
             const lh::StreamerStats st = s.stats();
             py::dict d;
             d["steps_enqueued"] = st.steps_enqueued;
             d["steps_dropped"] = st.steps_dropped;
             d["tokens_saved"] = st.tokens_saved;
             d["tokens_dropped"] = st.tokens_dropped;
             d["tokens_deferred"] = st.tokens_deferred;
             d["bytes_sent"] = st.bytes_sent;
             d["bytes_acked"] = st.bytes_acked;
             d["bytes_dropped"] = st.bytes_dropped;
             d["appends_started"] = st.appends_started;
             d["appends_failed"] = st.appends_failed;
             d["holders_gone"] = st.holders_gone;
             d["holder_failures"] = st.holder_failures;
             d["reconnects"] = st.reconnects;
             d["replicas_lost"] = st.replicas_lost;
             d["replacements"] = st.replacements;
             d["releases_failed"] = st.releases_failed;
             d["gather_failures"] = st.gather_failures;
             return d;
           })
      .def(
          "requests",
          [](lh::Streamer& s) {
            py::list out;
            for (const lh::RequestState& r : s.requests()) {
              py::list replicas;
              for (const lh::ReplicaState& rep : r.replicas) {
                replicas.append(py::make_tuple(rep.holder.address, rep.holder.port, rep.sent_tokens,
                                               rep.durable_tokens, rep.live, rep.lost));
              }
              out.append(py::make_tuple(r.request_id, r.saved_tokens, replicas));
            }
            return out;
          })
      .def("gone_holders",
           [](lh::Streamer& s) {
             std::vector<Address> out;
             for (const lh::HolderAddress& a : s.gone_holders()) out.push_back({a.address, a.port});
             return out;
           })
      .def("close", &lh::Streamer::close, py::call_guard<py::gil_scoped_release>());
}
