// verify_draft: exact batched chain speculative sampling (docs/verify_draft.md).
//
// One signature for the CPU (csrc/verify_draft.cpp) and CUDA (csrc/verify_draft.cu) paths.
// Every pointer of VerifyDraftArgs is on the device that runs the op. Request b owns
// num_draft_tokens[b] = k_b drafts and k_b + 1 target rows (rows target_row_start[b] + i,
// i = 0..k_b; draft i at draft_start[b] + i); null layout arrays mean the padded layout (below).
// Rules (identical in src/lumen_core/reference.py):
//   p = target row (probabilities), or softmax((logits - max) / T) computed in float64 with the
//     normaliser Z summed by the chunk rule below; T = 0 makes p one-hot at the argmax
//     (ties -> lowest id) and ignores q (greedy verification).
//   accept draft d at position i when u0 * q(d) < p(d) in float64, and q(d) > 0;
//   at the first rejection emit a token sampled with u1 from max(p - q, 0) (p when that mass is
//     <= kResidualMinMass); after k_b acceptances emit a bonus token sampled with u1 from row k_b.
//   u0 = uniform(b, i, 0), u1 = uniform(b, i, 1): explicit uniforms[row][2] or
//     philox_uniform(seeds[b], positions[b] + i, 0 or 1).
// Sampling rule (inverse CDF, fixed summation order so that every implementation agrees to the
// bit): weights w[0..V) in float64 are cut into chunks of kSampleChunk tokens; each chunk sum is
// accumulated left to right from 0.0; the total is the left-to-right sum of chunk sums. With
// x = u * total, the chosen chunk is the first whose running prefix of chunk sums exceeds x,
// and inside it the running sum starts at the prefix before that chunk and adds w[t] left to
// right; the first t where it exceeds x is chosen. If rounding leaves no such t, the last
// token with w[t] > 0 in the chosen chunk (or in the last non-empty chunk) is chosen.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define LUMEN_VD_HOST_DEVICE __host__ __device__
#else
#define LUMEN_VD_HOST_DEVICE
#endif

namespace lumen {

constexpr int64_t kSampleChunk = 1024;
constexpr double kResidualMinMass = 1e-12;
// Largest supported vocabulary: bounds the CUDA kernel's shared chunk-sum array.
constexpr int64_t kMaxVocabSize = int64_t{1} << 21;

enum class ScalarType : int { kFloat32 = 0, kFloat64 = 1 };
enum class TargetKind : int { kProbs = 0, kLogits = 1 };
enum class DraftKind : int { kOneHot = 0, kDense = 1, kSparse = 2 };

// Per-request status codes (status[b] = code << 32 | position, 0 = ok). Every value the op
// reads is checked here, so a bad call never reads out of bounds or samples from garbage; the
// Python layer checks host-resident inputs first and maps these codes to its exceptions for
// device-resident ones (lumen_core.verify.VerifyResult.check).
enum class VerifyStatus : int64_t {
  kOk = 0,
  kBadTargetRow = 1,      // probabilities: NaN, negative, or sum outside 1 +- sum_tolerance
  kBadLogitsRow = 2,      // logits: NaN, +inf, or no finite entry
  kBadDraftRow = 3,       // draft probabilities: NaN, negative, or sum outside 1 +- sum_tolerance
  kDraftIdRange = 4,      // draft token id outside [0, V)
  kTopkIdRange = 5,       // sparse draft id outside [0, V)
  kBadTemperature = 6,    // negative or non-finite temperature
  kBadDraftCount = 7,     // num_draft_tokens[b] < 0 or + 1 > out_cols
  kBadUniform = 8,        // an explicit uniform outside [0, 1) (NaN included)
  kBadPosition = 9,       // positions[b] outside [0, 2**63 - out_cols)
  kDuplicateTopkId = 10,  // a sparse draft row repeats an id
};

LUMEN_VD_HOST_DEVICE inline int64_t make_status(VerifyStatus code, int64_t position) {
  return (static_cast<int64_t>(code) << 32) | position;
}

struct VerifyDraftArgs {
  // Outputs, [num_requests, out_cols] and [num_requests]; rows are fully written.
  int64_t* output_token_ids;
  int64_t* num_accepted;
  int64_t* num_emitted;
  int64_t* status;
  int64_t out_cols;
  // Target rows [*, vocab_size] of `dtype`; draft probabilities share `dtype`.
  const void* target;
  ScalarType dtype;
  TargetKind target_kind;
  int64_t num_requests;
  int64_t vocab_size;
  // Layout, [num_requests] each. target_row_start and draft_start are both null for the padded
  // layout (rows b * out_cols + i, drafts b * (out_cols - 1) + i); a null num_draft_tokens
  // means k_b = out_cols - 1 for every request.
  const int64_t* num_draft_tokens;
  const int64_t* target_row_start;
  const int64_t* draft_start;
  const int64_t* draft_token_ids;  // [*]
  DraftKind draft_kind;
  const void* draft_probs;        // dense [*, vocab_size] or sparse [*, topk]; else null
  const int64_t* draft_topk_ids;  // sparse [*, topk]; else null
  int64_t topk;
  const double* temperature;  // [num_requests] for logits; null for probabilities
  const double* uniforms;     // [*, 2] indexed by target row; null -> Philox
  const uint64_t* seeds;      // [num_requests] when uniforms is null
  const int64_t* positions;   // [num_requests] when uniforms is null
  double sum_tolerance;
};

// Per-request logic shared by the CPU loop and the CUDA kernel (one definition, so the host
// tests of the CPU path cover the index math and checks the kernel runs).
LUMEN_VD_HOST_DEVICE inline int64_t request_num_drafts(const VerifyDraftArgs& a, int64_t b) {
  return a.num_draft_tokens != nullptr ? a.num_draft_tokens[b] : a.out_cols - 1;
}

LUMEN_VD_HOST_DEVICE inline int64_t request_row_start(const VerifyDraftArgs& a, int64_t b) {
  return a.target_row_start != nullptr ? a.target_row_start[b] : b * a.out_cols;
}

LUMEN_VD_HOST_DEVICE inline int64_t request_draft_start(const VerifyDraftArgs& a, int64_t b) {
  return a.draft_start != nullptr ? a.draft_start[b] : b * (a.out_cols - 1);
}

// Status of request b's draws (k drafts): its explicit uniforms (rows 0..k, both draws) in
// [0, 1), or its Philox position in [0, 2**63 - out_cols) so positions[b] + i never overflows.
LUMEN_VD_HOST_DEVICE inline int64_t draws_status(const VerifyDraftArgs& a, int64_t b, int64_t k) {
  if (a.uniforms != nullptr) {
    const double* u = a.uniforms + request_row_start(a, b) * 2;
    for (int64_t i = 0; i < 2 * (k + 1); ++i) {
      if (!(u[i] >= 0.0 && u[i] < 1.0)) return make_status(VerifyStatus::kBadUniform, i / 2);
    }
    return 0;
  }
  const int64_t position = a.positions[b];
  if (position < 0 || position > INT64_MAX - a.out_cols) {
    return make_status(VerifyStatus::kBadPosition, 0);
  }
  return 0;
}

// Whether sparse id r of a top-K row appears again later in it (K is small: a linear scan).
LUMEN_VD_HOST_DEVICE inline bool topk_id_repeats(const int64_t* ids, int64_t topk, int64_t r) {
  for (int64_t s = r + 1; s < topk; ++s) {
    if (ids[s] == ids[r]) return true;
  }
  return false;
}

// The two walks of the sampling rule, shared by the CPU loop and the kernel (which runs
// scan_chunk over the chunk staged in shared memory). choose_chunk: the first chunk whose
// running prefix of chunk sums exceeds x, or -1; *prefix is the sum of the chunk sums before it.
LUMEN_VD_HOST_DEVICE inline int64_t choose_chunk(const double* sums, int64_t num_chunks, double x,
                                                 double* prefix) {
  double s = 0.0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const double next = s + sums[c];
    if (next > x) {
      *prefix = s;
      return c;
    }
    s = next;
  }
  *prefix = s;
  return -1;
}

// Inside the chosen chunk w[0..size): the first t where prefix + w[0] + ... + w[t] (in float64,
// left to right) exceeds x; if rounding leaves none, the last t with w[t] > 0, else 0.
template <typename S>
LUMEN_VD_HOST_DEVICE int64_t scan_chunk(const S* w, int64_t size, double prefix, double x) {
  double s = prefix;
  for (int64_t t = 0; t < size; ++t) {
    s += static_cast<double>(w[t]);
    if (s > x) return t;
  }
  for (int64_t t = size - 1; t >= 0; --t) {
    if (w[t] > 0.0) return t;
  }
  return 0;
}

// The CPU row check (every entry >= 0, |sum - 1| <= tolerance; NaN and +inf fail). kAuto uses
// AVX2 where the CPU has it; kPortable forces the plain loop (so tests cover both paths).
enum class SimdPath : int { kAuto = 0, kPortable = 1 };
bool probability_row_ok(const float* row, int64_t n, double tolerance, SimdPath path);
bool probability_row_ok(const double* row, int64_t n, double tolerance, SimdPath path);

// CPU: threads over requests (dynamic assignment; results do not depend on num_threads).
void verify_draft_cpu(const VerifyDraftArgs& args, int num_threads);

// CUDA: one launch, one block per request on `stream` (a cudaStream_t), no host
// synchronisation; throws std::runtime_error on a launch failure. Asynchronous: status and
// outputs are ready when the stream is.
void verify_draft_cuda(const VerifyDraftArgs& args, void* stream);

}  // namespace lumen
