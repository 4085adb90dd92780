// Bindings of the holder store: HolderStore (budget, reservations, expiry, verified restore)
// and serve_holder_store(), a transport Server whose sink is that store.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>

#include "lumen/gather.h"
#include "lumen/holder/holder_store.h"
#include "lumen/holder/host_pin.h"
#include "lumen/transport/server.h"
#include "ucx_args.h"

namespace py = pybind11;
namespace lh = lumen::holder;
namespace lt = lumen::transport;

namespace {

using I64Array = py::array_t<int64_t, py::array::c_style>;
using U32Array = py::array_t<uint32_t, py::array::c_style>;
using U8Array = py::array_t<uint8_t, py::array::c_style>;

// The checks every restore binding makes, then `run(fingerprints, planes, num_planes)` without
// the GIL; returns (status, restored_tokens, durable_tokens).
template <typename Run>
py::tuple restore(const py::bytes& fingerprints, const I64Array& descriptors,
                  const I64Array& slot_ids, int64_t record_bytes, const Run& run) {
  const std::string fp = fingerprints;
  if (fp.size() != 2 * lt::kFingerprintBytes) {
    throw py::value_error("fingerprints must be 64 bytes, got " + std::to_string(fp.size()));
  }
  const auto [planes, num_planes] = lumen_bind::to_planes(descriptors);
  lumen::validate_planes(planes, num_planes, record_bytes);
  lumen::validate_slots(planes, num_planes, slot_ids.data(), slot_ids.size());
  lh::RestoreReport report;
  {
    py::gil_scoped_release release;
    report = run(reinterpret_cast<const uint8_t*>(fp.data()), planes, num_planes);
  }
  return py::make_tuple(static_cast<int>(report.status), report.restored_tokens,
                        report.durable_tokens);
}

py::dict stats_dict(const lh::HolderStats& s) {
  py::dict d;
  d["checkpoints"] = s.checkpoints;
  d["budget_bytes"] = s.budget_bytes;
  d["bytes_charged"] = s.bytes_charged;
  d["bytes_held"] = s.bytes_held;
  d["tokens_held"] = s.tokens_held;
  d["reservations"] = s.reservations;
  d["reservations_refused"] = s.reservations_refused;
  d["appends_refused_budget"] = s.appends_refused_budget;
  d["gaps_refused"] = s.gaps_refused;
  d["conflicts"] = s.conflicts;
  d["evictions"] = s.evictions;
  d["evicted_tokens"] = s.evicted_tokens;
  d["evicted_bytes"] = s.evicted_bytes;
  d["evictions_reserved"] = s.evictions_reserved;
  d["expirations"] = s.expirations;
  d["releases"] = s.releases;
  d["tokens_committed"] = s.tokens_committed;
  d["appends_in_place"] = s.appends_in_place;
  d["arena_bytes"] = s.arena_bytes;
  d["arena_free_bytes"] = s.arena_free_bytes;
  d["spare_bytes"] = s.spare_bytes;
  d["pinned"] = s.pinned;
  return d;
}

}  // namespace

void bind_holder(py::module_& m) {
  py::class_<lh::HolderStore, std::shared_ptr<lh::HolderStore>>(m, "HolderStore")
      .def(py::init([](uint64_t budget_bytes, int policy, uint64_t chunk_bytes, bool pinned,
                       uint64_t reserve_bytes) {
             if (policy < 0 || policy > 2) throw py::value_error("policy must be 0, 1 or 2");
             lh::HolderOptions options;
             options.budget_bytes = budget_bytes;
             options.policy = static_cast<lh::EvictionPolicy>(policy);
             options.chunk_bytes = chunk_bytes;
             options.pinned = pinned;
             options.reserve_bytes = reserve_bytes;
             py::gil_scoped_release release;  // a reserve is populated (and pinned) now
             return std::make_shared<lh::HolderStore>(options);
           }),
           py::kw_only(), py::arg("budget_bytes"), py::arg("policy"), py::arg("chunk_bytes"),
           py::arg("pinned"), py::arg("reserve_bytes") = 0)
      .def("reserve", &lh::HolderStore::reserve, py::arg("request_id"), py::arg("shard"),
           py::arg("num_tokens"), py::arg("record_bytes"), py::call_guard<py::gil_scoped_release>())
      .def("expire", &lh::HolderStore::expire, py::arg("request_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("expire_idle", &lh::HolderStore::expire_idle, py::arg("max_idle_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("stats", [](lh::HolderStore& s) { return stats_dict(s.stats()); })
      .def("take_evictions",
           [](lh::HolderStore& s) {
             py::list out;
             for (const lh::Eviction& e : s.take_evictions()) {
               out.append(py::make_tuple(e.request_id, e.shard, e.epoch, e.durable_tokens,
                                         e.reserved_tokens, e.bytes));
             }
             return out;
           })
      .def("durable_tokens", &lh::HolderStore::durable_tokens, py::arg("request_id"),
           py::arg("shard"), py::call_guard<py::gil_scoped_release>())
      .def("checkpoints",
           [](lh::HolderStore& s) {
             py::list out;
             for (const lh::CheckpointInfo& c : s.checkpoints()) {
               py::dict d;
               d["request_id"] = c.request_id;
               d["shard"] = c.shard;
               d["epoch"] = c.epoch;
               d["record_bytes"] = c.record_bytes;
               d["opened"] = c.opened;
               d["durable_tokens"] = c.durable_tokens;
               d["reserved_tokens"] = c.reserved_tokens;
               d["fingerprints"] = py::bytes(reinterpret_cast<const char*>(c.fingerprints.data()),
                                             c.fingerprints.size());
               out.append(d);
             }
             return out;
           })
      .def(
          "restore_into",
          [](lh::HolderStore& s, uint64_t request_id, uint32_t shard, const py::bytes& fingerprints,
             const U32Array& token_ids, const I64Array& descriptors, const I64Array& slot_ids,
             int64_t record_bytes) {
            return restore(fingerprints, descriptors, slot_ids, record_bytes,
                           [&](const uint8_t* fp, const lumen::PlaneDesc* planes, int num_planes) {
                             return s.restore_into(request_id, shard, fp, token_ids.data(),
                                                   token_ids.size(), planes, num_planes,
                                                   slot_ids.data(), slot_ids.size());
                           });
          },
          py::arg("request_id"), py::arg("shard"), py::arg("fingerprints"), py::arg("token_ids"),
          py::arg("descriptors"), py::arg("slot_ids"), py::arg("record_bytes"))
      .def(
          "restore_into_cuda",
          [](lh::HolderStore& s, uint64_t request_id, uint32_t shard, const py::bytes& fingerprints,
             const U32Array& token_ids, const I64Array& descriptors, const I64Array& slot_ids,
             int64_t record_bytes, int device, uintptr_t stream, int num_threads) {
            return restore(fingerprints, descriptors, slot_ids, record_bytes,
                           [&](const uint8_t* fp, const lumen::PlaneDesc* planes, int num_planes) {
                             return s.restore_into_cuda(request_id, shard, fp, token_ids.data(),
                                                        token_ids.size(), planes, num_planes,
                                                        slot_ids.data(), slot_ids.size(), device,
                                                        stream, num_threads);
                           });
          },
          py::arg("request_id"), py::arg("shard"), py::arg("fingerprints"), py::arg("token_ids"),
          py::arg("descriptors"), py::arg("slot_ids"), py::arg("record_bytes"), py::kw_only(),
          py::arg("device"), py::arg("stream"), py::arg("num_threads"));

  m.def("holder_can_pin", &lh::can_pin_host_memory,
        "True when this build can page-lock holder memory and a CUDA device is present.");

  m.def(
      "serve_holder_store",
      [](std::shared_ptr<lh::HolderStore> store, const lt::ServerOptions& options) {
        py::gil_scoped_release release;
        return std::make_unique<lt::Server>(options, std::move(store));
      },
      py::arg("store"), py::arg("options"),
      "A transport Server (built with a ServerOptions) that keeps what it receives in `store`.");
}
