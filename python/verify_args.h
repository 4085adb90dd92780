// Shared by python/bind_verify.cpp and python/cuda/bind_verify.cpp: turns the dict of
// addresses and sizes built by lumen_core.verify.verify_draft into lumen::VerifyDraftArgs,
// re-checking the cheap invariants (enum ranges, sizes, required buffers present; null layout
// arrays select the padded layout of lumen/verify_draft.h).
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "lumen/verify_draft.h"

namespace lumen_bind {

namespace py = pybind11;

template <typename P>
inline P* as_ptr(uintptr_t address) {
  return reinterpret_cast<P*>(address);
}

inline lumen::VerifyDraftArgs make_verify_args(py::dict a) {
  lumen::VerifyDraftArgs args{};
  const auto addr = [&](const char* key) { return a[key].cast<uintptr_t>(); };
  args.output_token_ids = as_ptr<int64_t>(addr("output_token_ids"));
  args.num_accepted = as_ptr<int64_t>(addr("num_accepted"));
  args.num_emitted = as_ptr<int64_t>(addr("num_emitted"));
  args.status = as_ptr<int64_t>(addr("status"));
  args.out_cols = a["out_cols"].cast<int64_t>();
  args.target = as_ptr<const void>(addr("target"));
  const int dtype = a["dtype"].cast<int>();
  const int target_kind = a["target_kind"].cast<int>();
  const int draft_kind = a["draft_kind"].cast<int>();
  if (dtype < 0 || dtype > 1 || target_kind < 0 || target_kind > 1 || draft_kind < 0 ||
      draft_kind > 2) {
    throw std::invalid_argument("verify_draft: dtype, target_kind or draft_kind out of range");
  }
  args.dtype = static_cast<lumen::ScalarType>(dtype);
  args.target_kind = static_cast<lumen::TargetKind>(target_kind);
  args.draft_kind = static_cast<lumen::DraftKind>(draft_kind);
  args.num_requests = a["num_requests"].cast<int64_t>();
  args.vocab_size = a["vocab_size"].cast<int64_t>();
  args.num_draft_tokens = as_ptr<const int64_t>(addr("num_draft_tokens"));
  args.target_row_start = as_ptr<const int64_t>(addr("target_row_start"));
  args.draft_start = as_ptr<const int64_t>(addr("draft_start"));
  args.draft_token_ids = as_ptr<const int64_t>(addr("draft_token_ids"));
  args.draft_probs = as_ptr<const void>(addr("draft_probs"));
  args.draft_topk_ids = as_ptr<const int64_t>(addr("draft_topk_ids"));
  args.topk = a["topk"].cast<int64_t>();
  args.temperature = as_ptr<const double>(addr("temperature"));
  args.uniforms = as_ptr<const double>(addr("uniforms"));
  args.seeds = as_ptr<const uint64_t>(addr("seeds"));
  args.positions = as_ptr<const int64_t>(addr("positions"));
  args.sum_tolerance = a["sum_tolerance"].cast<double>();
  if (args.num_requests < 0 || args.vocab_size < 1 || args.vocab_size > lumen::kMaxVocabSize ||
      args.out_cols < 1 || args.topk < 0) {
    throw std::invalid_argument(
        "verify_draft: negative count, vocab_size outside [1, 2**21] or out_cols < 1");
  }
  const bool needs_rng = args.uniforms == nullptr;
  if (args.num_requests > 0 &&
      (args.target == nullptr || args.output_token_ids == nullptr || args.status == nullptr ||
       (args.target_row_start == nullptr) != (args.draft_start == nullptr) ||
       (args.target_row_start != nullptr && args.num_draft_tokens == nullptr) ||
       (args.target_kind == lumen::TargetKind::kLogits && args.temperature == nullptr) ||
       (args.draft_kind != lumen::DraftKind::kOneHot && args.draft_probs == nullptr) ||
       (args.draft_kind == lumen::DraftKind::kSparse &&
        (args.draft_topk_ids == nullptr || args.topk < 1)) ||
       (needs_rng && (args.seeds == nullptr || args.positions == nullptr)))) {
    throw std::invalid_argument(
        "verify_draft: a required buffer address is null (or only one of target_row_start and "
        "draft_start is)");
  }
  return args;
}

}  // namespace lumen_bind
