// verify_draft on CUDA. Thread mapping: one block of kThreads threads per request. The block
// walks the request's positions in order (the acceptance chain is sequential); for each
// vocabulary-wide step (row validation, max, argmax, softmax normaliser, sampling) the
// threads stride over the vocabulary and reduce through shared memory. Sampling follows the
// chunk rule of lumen/verify_draft.h: thread j sums chunks j, j + kThreads, ... left to
// right (so each chunk sum equals the CPU's to the bit); thread 0 walks the chunk sums, the
// block stages the chosen chunk in shared memory, and thread 0 scans it. Reductions whose
// order does not matter (validation sums, max, argmax with lowest-id ties) use the usual tree.
// Every check behind lumen/verify_draft.h's VerifyStatus runs in the kernel, so one launch
// validates and verifies and nothing waits on the host; the block writes outputs and status.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "lumen/cuda_check.h"
#include "lumen/philox.h"
#include "lumen/verify_draft.h"

namespace lumen {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct BlockShared {
  double value[kWarps];
  int64_t index[kWarps];
  int flag[kWarps];
  double broadcast_value;
  int64_t broadcast_index;
  int broadcast_flag;
  // block_sample's chosen chunk and the prefix before it: fields of their own, because the
  // block_chunk_total just before may still have threads reading broadcast_value.
  double sample_prefix;
  int64_t sample_chunk;
};

__device__ double block_sum(double v, BlockShared& sh) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) sh.value[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0.0;
    for (int w = 0; w < kWarps; ++w) s += sh.value[w];
    sh.broadcast_value = s;
  }
  __syncthreads();
  return sh.broadcast_value;
}

__device__ double block_max(double v, BlockShared& sh) {
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmax(v, __shfl_down_sync(0xffffffffu, v, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) sh.value[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double m = sh.value[0];
    for (int w = 1; w < kWarps; ++w) m = fmax(m, sh.value[w]);
    sh.broadcast_value = m;
  }
  __syncthreads();
  return sh.broadcast_value;
}

__device__ bool block_all(bool ok, BlockShared& sh) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int all = __all_sync(0xffffffffu, ok ? 1 : 0);
  __syncthreads();
  if (lane == 0) sh.flag[warp] = all;
  __syncthreads();
  if (threadIdx.x == 0) {
    int r = 1;
    for (int w = 0; w < kWarps; ++w) r &= sh.flag[w];
    sh.broadcast_flag = r;
  }
  __syncthreads();
  return sh.broadcast_flag != 0;
}

// Argmax of row[0..n), ties -> lowest id (each thread scans ascending ids; merges prefer the
// lower id on equal values).
template <typename T>
__device__ int64_t block_argmax(const T* row, int64_t n, BlockShared& sh) {
  double best = -INFINITY;
  int64_t best_id = n;
  for (int64_t t = threadIdx.x; t < n; t += kThreads) {
    const double v = static_cast<double>(row[t]);
    if (v > best || best_id == n) {
      best = v;
      best_id = t;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const double ov = __shfl_down_sync(0xffffffffu, best, offset);
    const int64_t oi = __shfl_down_sync(0xffffffffu, best_id, offset);
    if (ov > best || (ov == best && oi < best_id)) {
      best = ov;
      best_id = oi;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) {
    sh.value[warp] = best;
    sh.index[warp] = best_id;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double b = sh.value[0];
    int64_t bi = sh.index[0];
    for (int w = 1; w < kWarps; ++w) {
      if (sh.value[w] > b || (sh.value[w] == b && sh.index[w] < bi)) {
        b = sh.value[w];
        bi = sh.index[w];
      }
    }
    sh.broadcast_index = bi;
  }
  __syncthreads();
  return sh.broadcast_index;
}

// Probability row check (validation only, so the reduction order is free).
template <typename T>
__device__ bool block_probability_row_ok(const T* row, int64_t n, double tolerance,
                                         BlockShared& sh) {
  double s = 0.0;
  bool ok = true;
  for (int64_t t = threadIdx.x; t < n; t += kThreads) {
    const double v = static_cast<double>(row[t]);
    ok &= v >= 0.0;
    s += v;
  }
  const bool all_ok = block_all(ok, sh);
  const double sum = block_sum(s, sh);
  return all_ok && fabs(sum - 1.0) <= tolerance;
}

// Logits row: max, or NaN when the row holds NaN or +inf or no finite entry.
template <typename T>
__device__ double block_logits_max(const T* row, int64_t n, BlockShared& sh) {
  double m = -INFINITY;
  bool ok = true;
  for (int64_t t = threadIdx.x; t < n; t += kThreads) {
    const double v = static_cast<double>(row[t]);
    ok &= !(isnan(v) || v == INFINITY);
    m = fmax(m, v);
  }
  const bool all_ok = block_all(ok, sh);
  const double mx = block_max(m, sh);
  return all_ok && isfinite(mx) ? mx : NAN;
}

// Chunk sums of w(t) for t in [0, n) into sums[], and their left-to-right total.
template <typename W>
__device__ double block_chunk_total(const W& w, int64_t n, double* sums, BlockShared& sh) {
  const int64_t num_chunks = (n + kSampleChunk - 1) / kSampleChunk;
  __syncthreads();
  for (int64_t c = threadIdx.x; c < num_chunks; c += kThreads) {
    const int64_t end = min(n, (c + 1) * kSampleChunk);
    double s = 0.0;
    for (int64_t t = c * kSampleChunk; t < end; ++t) s += w(t);
    sums[c] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int64_t c = 0; c < num_chunks; ++c) total += sums[c];
    sh.broadcast_value = total;
  }
  __syncthreads();
  return sh.broadcast_value;
}

template <typename W>
__device__ int64_t last_positive(const W& w, int64_t begin, int64_t end) {
  for (int64_t t = end - 1; t >= begin; --t) {
    if (w(t) > 0.0) return t;
  }
  return begin;
}

// Samples by the chunk rule from sums[] (block_chunk_total of the same w) and returns the
// token to every thread. Thread 0 finds the chunk; the block stages that chunk's weights in
// chunk_w (so the one sequential scan reads shared memory, not global rows or recomputed
// logits), and thread 0 scans it left to right from the prefix, as the CPU does.
template <typename W>
__device__ int64_t block_sample(const W& w, int64_t n, const double* sums, double total, double u,
                                double* chunk_w, BlockShared& sh) {
  const int64_t num_chunks = (n + kSampleChunk - 1) / kSampleChunk;
  const double x = u * total;
  if (threadIdx.x == 0) {
    double prefix = 0.0;
    sh.sample_chunk = choose_chunk(sums, num_chunks, x, &prefix);
    sh.sample_prefix = prefix;
  }
  __syncthreads();
  const int64_t chosen = sh.sample_chunk;
  const double prefix = sh.sample_prefix;
  if (chosen >= 0) {
    const int64_t begin = chosen * kSampleChunk, size = min(n, begin + kSampleChunk) - begin;
    for (int64_t t = threadIdx.x; t < size; t += kThreads) chunk_w[t] = w(begin + t);
    __syncthreads();
    if (threadIdx.x == 0) sh.broadcast_index = begin + scan_chunk(chunk_w, size, prefix, x);
  } else if (threadIdx.x == 0) {
    // Rounding left x at or past the total: the last positive weight of the last non-empty chunk.
    int64_t token = -1;
    for (int64_t c = num_chunks - 1; c >= 0 && token < 0; --c) {
      if (sums[c] > 0.0) token = last_positive(w, c * kSampleChunk, min(n, (c + 1) * kSampleChunk));
    }
    sh.broadcast_index = token < 0 ? 0 : token;
  }
  __syncthreads();
  return sh.broadcast_index;
}

template <typename T>
struct TargetP {
  const T* row;
  bool logits;
  double max, temperature, z;
  __device__ double operator()(int64_t t) const {
    const double v = static_cast<double>(row[t]);
    return logits ? exp((v - max) / temperature) / z : v;
  }
};

template <typename T>
struct LogitsWeight {
  const T* row;
  double max, temperature;
  __device__ double operator()(int64_t t) const {
    return exp((static_cast<double>(row[t]) - max) / temperature);
  }
};

template <typename T>
struct Residual {
  TargetP<T> p;
  DraftKind kind;
  int64_t draft_id;
  const T* q;               // dense row or sparse probs
  const int64_t* topk_ids;  // sparse ids
  int64_t topk;
  __device__ double q_at(int64_t t) const {
    if (kind == DraftKind::kOneHot) return t == draft_id ? 1.0 : 0.0;
    if (kind == DraftKind::kDense) return static_cast<double>(q[t]);
    for (int64_t r = 0; r < topk; ++r) {
      if (topk_ids[r] == t) return static_cast<double>(q[r]);
    }
    return 0.0;
  }
  __device__ double operator()(int64_t t) const { return fmax(p(t) - q_at(t), 0.0); }
};

template <typename T>
__global__ void verify_draft_kernel(VerifyDraftArgs a) {
  extern __shared__ double sums[];
  __shared__ double chunk_w[kSampleChunk];
  __shared__ BlockShared sh;
  const int64_t b = blockIdx.x;
  const int64_t V = a.vocab_size;
  const int64_t k = request_num_drafts(a, b);
  int64_t* out = a.output_token_ids + b * a.out_cols;
  for (int64_t c = threadIdx.x; c < a.out_cols; c += kThreads) out[c] = -1;
  const auto row = [&](int64_t i) {
    return static_cast<const T*>(a.target) + (request_row_start(a, b) + i) * V;
  };
  const auto uniform = [&](int64_t i, uint32_t index) {
    if (a.uniforms != nullptr) return a.uniforms[(request_row_start(a, b) + i) * 2 + index];
    return philox_uniform(a.seeds[b], static_cast<uint64_t>(a.positions[b] + i), index);
  };
  const auto finish = [&](int64_t status, int64_t accepted, int64_t emitted) {
    if (threadIdx.x == 0) {
      a.status[b] = status;
      a.num_accepted[b] = accepted;
      a.num_emitted[b] = emitted;
    }
  };
  if (k < 0 || k + 1 > a.out_cols)
    return finish(make_status(VerifyStatus::kBadDraftCount, 0), 0, 0);
  const bool logits = a.target_kind == TargetKind::kLogits;
  const double temp = logits ? a.temperature[b] : 1.0;
  if (!(temp >= 0.0) || !isfinite(temp))
    return finish(make_status(VerifyStatus::kBadTemperature, 0), 0, 0);
  if (const int64_t status = draws_status(a, b, k); status != 0) return finish(status, 0, 0);
  const bool greedy = logits && temp == 0.0;

  // Validation of every row the request owns, before any output.
  for (int64_t i = 0; i <= k; ++i) {
    const bool ok = logits ? !isnan(block_logits_max(row(i), V, sh))
                           : block_probability_row_ok(row(i), V, a.sum_tolerance, sh);
    if (!ok) {
      return finish(
          make_status(logits ? VerifyStatus::kBadLogitsRow : VerifyStatus::kBadTargetRow, i), 0, 0);
    }
  }
  for (int64_t i = 0; i < k; ++i) {
    const int64_t j = request_draft_start(a, b) + i;
    const int64_t d = a.draft_token_ids[j];
    if (d < 0 || d >= V) return finish(make_status(VerifyStatus::kDraftIdRange, i), 0, 0);
    bool ok = true;
    if (a.draft_kind == DraftKind::kDense) {
      ok = block_probability_row_ok(static_cast<const T*>(a.draft_probs) + j * V, V,
                                    a.sum_tolerance, sh);
    } else if (a.draft_kind == DraftKind::kSparse) {
      bool ids_ok = true;
      for (int64_t r = threadIdx.x; r < a.topk; r += kThreads) {
        const int64_t id = a.draft_topk_ids[j * a.topk + r];
        ids_ok &= id >= 0 && id < V;
      }
      if (!block_all(ids_ok, sh)) return finish(make_status(VerifyStatus::kTopkIdRange, i), 0, 0);
      bool distinct = true;
      for (int64_t r = threadIdx.x; r < a.topk; r += kThreads) {
        distinct &= !topk_id_repeats(a.draft_topk_ids + j * a.topk, a.topk, r);
      }
      if (!block_all(distinct, sh)) {
        return finish(make_status(VerifyStatus::kDuplicateTopkId, i), 0, 0);
      }
      ok = block_probability_row_ok(static_cast<const T*>(a.draft_probs) + j * a.topk, a.topk,
                                    a.sum_tolerance, sh);
    }
    if (!ok) return finish(make_status(VerifyStatus::kBadDraftRow, i), 0, 0);
  }

  const auto target_p = [&](int64_t i) {
    TargetP<T> p{row(i), logits, 0.0, temp, 1.0};
    if (logits) {
      p.max = block_logits_max(row(i), V, sh);
      p.z = block_chunk_total(LogitsWeight<T>{row(i), p.max, temp}, V, sums, sh);
    }
    return p;
  };
  for (int64_t i = 0; i < k; ++i) {
    const int64_t j = request_draft_start(a, b) + i;
    const int64_t d = a.draft_token_ids[j];
    int64_t token = d;
    bool accepted = true;
    if (greedy) {
      token = block_argmax(row(i), V, sh);
      accepted = token == d;
    } else {
      const TargetP<T> p = target_p(i);
      Residual<T> r{p, a.draft_kind, d, nullptr, nullptr, a.topk};
      if (a.draft_kind == DraftKind::kDense) r.q = static_cast<const T*>(a.draft_probs) + j * V;
      if (a.draft_kind == DraftKind::kSparse) {
        r.q = static_cast<const T*>(a.draft_probs) + j * a.topk;
        r.topk_ids = a.draft_topk_ids + j * a.topk;
      }
      const double q_d = r.q_at(d);
      if (!(q_d > 0.0 && uniform(i, 0) * q_d < p(d))) {
        // A rejection may resample d itself (q(d) = 0, or the fallback to p).
        accepted = false;
        const double u = uniform(i, 1);
        const double mass = block_chunk_total(r, V, sums, sh);
        if (mass > kResidualMinMass) {
          token = block_sample(r, V, sums, mass, u, chunk_w, sh);
        } else {
          const double total = block_chunk_total(p, V, sums, sh);
          token = block_sample(p, V, sums, total, u, chunk_w, sh);
        }
      }
    }
    if (threadIdx.x == 0) out[i] = token;
    if (!accepted) return finish(0, i, i + 1);
  }
  int64_t bonus;
  if (greedy) {
    bonus = block_argmax(row(k), V, sh);
  } else {
    const TargetP<T> p = target_p(k);
    const double total = block_chunk_total(p, V, sums, sh);
    bonus = block_sample(p, V, sums, total, uniform(k, 1), chunk_w, sh);
  }
  if (threadIdx.x == 0) out[k] = bonus;
  finish(0, k, k + 1);
}

}  // namespace

void verify_draft_cuda(const VerifyDraftArgs& args, void* stream) {
  if (args.num_requests == 0) return;
  const int64_t num_chunks = (args.vocab_size + kSampleChunk - 1) / kSampleChunk;
  const size_t shared_bytes = static_cast<size_t>(num_chunks) * sizeof(double);
  const dim3 grid(static_cast<unsigned>(args.num_requests));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (args.dtype == ScalarType::kFloat32) {
    verify_draft_kernel<float><<<grid, kThreads, shared_bytes, s>>>(args);
  } else {
    verify_draft_kernel<double><<<grid, kThreads, shared_bytes, s>>>(args);
  }
  cuda_check_launch("verify_draft_kernel");
}

}  // namespace lumen
