// verify_draft on the CPU: threads take whole requests (an atomic cursor), so a request's
// result never depends on the thread count or on the other requests. Per request the target
// rows are validated once (one streaming pass each), the accept test reads p(d) and q(d)
// only, and a full pass over the vocabulary happens only where a token is sampled (the first
// rejection or the bonus position), plus the softmax normaliser of each logits row the
// acceptance chain reaches. Sampling follows the chunk rule of lumen/verify_draft.h.
#include "lumen/verify_draft.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "lumen/philox.h"

namespace lumen {
namespace {

// Chunk sums of w[0..n) (read as float64) by the chunk rule; four chunks advance together so
// the four left-to-right chains overlap in the pipeline without changing any chain's order.
template <typename S>
int64_t chunk_sums(const S* w, int64_t n, double* sums) {
  const int64_t num_chunks = (n + kSampleChunk - 1) / kSampleChunk;
  int64_t c = 0;
  for (; (c + 4) * kSampleChunk <= n; c += 4) {
    const S* w0 = w + c * kSampleChunk;
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    for (int64_t j = 0; j < kSampleChunk; ++j) {
      s0 += static_cast<double>(w0[j]);
      s1 += static_cast<double>(w0[kSampleChunk + j]);
      s2 += static_cast<double>(w0[2 * kSampleChunk + j]);
      s3 += static_cast<double>(w0[3 * kSampleChunk + j]);
    }
    sums[c] = s0;
    sums[c + 1] = s1;
    sums[c + 2] = s2;
    sums[c + 3] = s3;
  }
  for (; c < num_chunks; ++c) {
    double s = 0.0;
    const int64_t end = std::min(n, (c + 1) * kSampleChunk);
    for (int64_t t = c * kSampleChunk; t < end; ++t) s += static_cast<double>(w[t]);
    sums[c] = s;
  }
  return num_chunks;
}

double sum_left_to_right(const double* x, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

template <typename S>
int64_t last_positive(const S* w, int64_t begin, int64_t end) {
  for (int64_t t = end - 1; t >= begin; --t) {
    if (w[t] > 0.0) return t;
  }
  return begin;
}

// Inverse-CDF sample from w[0..n) (total > 0) with uniform u, by the chunk rule.
template <typename S>
int64_t sample_chunked(const S* w, int64_t n, const double* sums, int64_t num_chunks, double total,
                       double u) {
  const double x = u * total;
  double prefix = 0.0;
  const int64_t chosen = choose_chunk(sums, num_chunks, x, &prefix);
  if (chosen >= 0) {
    const int64_t begin = chosen * kSampleChunk;
    return begin + scan_chunk(w + begin, std::min(n, begin + kSampleChunk) - begin, prefix, x);
  }
  for (int64_t c = num_chunks - 1; c >= 0; --c) {
    if (sums[c] > 0.0) {
      return last_positive(w, c * kSampleChunk, std::min(n, (c + 1) * kSampleChunk));
    }
  }
  return 0;
}

template <typename T>
int64_t argmax_lowest(const T* row, int64_t n) {
  int64_t best = 0;
  T best_value = row[0];
  for (int64_t t = 1; t < n; ++t) {
    if (row[t] > best_value) {
      best_value = row[t];
      best = t;
    }
  }
  return best;
}

// Probability row check: min >= 0 and |sum - 1| <= tolerance (a NaN or +inf makes the sum
// fail). The order of this sum is free (it only validates), so it runs 8 float64 lanes; the
// AVX2 build of the loop is picked at run time (3-4x the portable loop on this machine).
template <typename T>
void min_sum_portable(const T* row, int64_t n, double* min_out, double* sum_out) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  double low[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    for (int j = 0; j < 8; ++j) {
      const double v = static_cast<double>(row[t + j]);
      low[j] = v < low[j] ? v : low[j];
      acc[j] += v;
    }
  }
  for (; t < n; ++t) {
    const double v = static_cast<double>(row[t]);
    low[0] = v < low[0] ? v : low[0];
    acc[0] += v;
  }
  double m = 0.0, s = 0.0;
  for (int j = 0; j < 8; ++j) {
    m = low[j] < m ? low[j] : m;
    s += acc[j];
  }
  *min_out = m;
  *sum_out = s;
}

#if defined(__x86_64__) && defined(__GNUC__)
using V4d = double __attribute__((vector_size(32)));
using V4f = float __attribute__((vector_size(16)));

template <typename T>
__attribute__((target("avx2"))) V4d load4(const T* p) {
  if constexpr (sizeof(T) == 4) {
    V4f f;
    __builtin_memcpy(&f, p, sizeof(f));
    return __builtin_convertvector(f, V4d);
  } else {
    V4d d;
    __builtin_memcpy(&d, p, sizeof(d));
    return d;
  }
}

template <typename T>
__attribute__((target("avx2"))) void min_sum_avx2(const T* row, int64_t n, double* min_out,
                                                  double* sum_out) {
  V4d acc0 = {0, 0, 0, 0}, acc1 = {0, 0, 0, 0}, low0 = {0, 0, 0, 0}, low1 = {0, 0, 0, 0};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const V4d a = load4(row + t), b = load4(row + t + 4);
    acc0 += a;
    acc1 += b;
    low0 = a < low0 ? a : low0;
    low1 = b < low1 ? b : low1;
  }
  double m = 0.0, s = 0.0;
  for (int j = 0; j < 4; ++j) {
    m = low0[j] < m ? low0[j] : m;
    m = low1[j] < m ? low1[j] : m;
    s += acc0[j] + acc1[j];
  }
  for (; t < n; ++t) {
    const double v = static_cast<double>(row[t]);
    m = v < m ? v : m;
    s += v;
  }
  *min_out = m;
  *sum_out = s;
}
#endif

template <typename T>
bool row_ok(const T* row, int64_t n, double tolerance, SimdPath path) {
  double m = 0.0, s = 0.0;
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  if (has_avx2 && path == SimdPath::kAuto) {
    min_sum_avx2(row, n, &m, &s);
  } else {
    min_sum_portable(row, n, &m, &s);
  }
#else
  min_sum_portable(row, n, &m, &s);
#endif
  return m >= 0.0 && std::fabs(s - 1.0) <= tolerance;
}

// Logits row check: no NaN or +inf and at least one finite entry; returns the max (or NaN).
template <typename T>
double logits_row_max(const T* row, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  bool ok = true;
  for (int64_t t = 0; t < n; ++t) {
    const double v = static_cast<double>(row[t]);
    ok &= !(std::isnan(v) || v == std::numeric_limits<double>::infinity());
    m = v > m ? v : m;
  }
  return ok && std::isfinite(m) ? m : std::numeric_limits<double>::quiet_NaN();
}

struct Scratch {
  std::vector<double> p, w, sums;
  std::vector<double> row_max;
};

template <typename T>
class RequestVerifier {
 public:
  RequestVerifier(const VerifyDraftArgs& a, Scratch& s) : a_(a), s_(s), vocab_(a.vocab_size) {}

  void run(int64_t b) {
    const int64_t k = request_num_drafts(a_, b);
    int64_t* out = a_.output_token_ids + b * a_.out_cols;
    std::fill(out, out + a_.out_cols, int64_t{-1});
    a_.num_accepted[b] = 0;
    a_.num_emitted[b] = 0;
    if (k < 0 || k + 1 > a_.out_cols) {
      a_.status[b] = make_status(VerifyStatus::kBadDraftCount, 0);
      return;
    }
    const int64_t status = validate(b, k);
    a_.status[b] = status;
    if (status != 0) return;
    const bool greedy = a_.temperature != nullptr && a_.temperature[b] == 0.0;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t d = a_.draft_token_ids[request_draft_start(a_, b) + i];
      // -1 means accepted: a rejection may resample the draft itself (q(d) = 0, or the
      // fallback to p), so token != d cannot tell the two apart.
      const int64_t token = greedy ? verify_greedy(b, i, d) : verify_sampled(b, i, d);
      out[i] = token < 0 ? d : token;
      if (token >= 0) {
        a_.num_accepted[b] = i;
        a_.num_emitted[b] = i + 1;
        return;
      }
    }
    out[k] = greedy ? argmax_lowest(row(b, k), vocab_) : sample_bonus(b, k);
    a_.num_accepted[b] = k;
    a_.num_emitted[b] = k + 1;
  }

 private:
  const T* row(int64_t b, int64_t i) const {
    return static_cast<const T*>(a_.target) + (request_row_start(a_, b) + i) * vocab_;
  }

  double uniform(int64_t b, int64_t i, uint32_t index) const {
    if (a_.uniforms != nullptr) return a_.uniforms[(request_row_start(a_, b) + i) * 2 + index];
    return philox_uniform(a_.seeds[b], static_cast<uint64_t>(a_.positions[b] + i), index);
  }

  int64_t validate(int64_t b, int64_t k) {
    if (a_.temperature != nullptr) {
      const double temp = a_.temperature[b];
      if (!(temp >= 0.0) || !std::isfinite(temp))
        return make_status(VerifyStatus::kBadTemperature, 0);
    }
    if (const int64_t status = draws_status(a_, b, k); status != 0) return status;
    s_.row_max.assign(static_cast<size_t>(k + 1), 0.0);
    for (int64_t i = 0; i <= k; ++i) {
      if (a_.target_kind == TargetKind::kProbs) {
        if (!probability_row_ok(row(b, i), vocab_, a_.sum_tolerance, SimdPath::kAuto)) {
          return make_status(VerifyStatus::kBadTargetRow, i);
        }
      } else {
        s_.row_max[i] = logits_row_max(row(b, i), vocab_);
        if (std::isnan(s_.row_max[i])) return make_status(VerifyStatus::kBadLogitsRow, i);
      }
    }
    for (int64_t i = 0; i < k; ++i) {
      const int64_t j = request_draft_start(a_, b) + i;
      const int64_t d = a_.draft_token_ids[j];
      if (d < 0 || d >= vocab_) return make_status(VerifyStatus::kDraftIdRange, i);
      if (a_.draft_kind == DraftKind::kDense) {
        if (!probability_row_ok(dense_q(j), vocab_, a_.sum_tolerance, SimdPath::kAuto)) {
          return make_status(VerifyStatus::kBadDraftRow, i);
        }
      } else if (a_.draft_kind == DraftKind::kSparse) {
        for (int64_t r = 0; r < a_.topk; ++r) {
          const int64_t id = a_.draft_topk_ids[j * a_.topk + r];
          if (id < 0 || id >= vocab_) return make_status(VerifyStatus::kTopkIdRange, i);
        }
        for (int64_t r = 0; r < a_.topk; ++r) {
          if (topk_id_repeats(a_.draft_topk_ids + j * a_.topk, a_.topk, r)) {
            return make_status(VerifyStatus::kDuplicateTopkId, i);
          }
        }
        if (!probability_row_ok(sparse_q(j), a_.topk, a_.sum_tolerance, SimdPath::kAuto)) {
          return make_status(VerifyStatus::kBadDraftRow, i);
        }
      }
    }
    return 0;
  }

  const T* dense_q(int64_t j) const { return static_cast<const T*>(a_.draft_probs) + j * vocab_; }
  const T* sparse_q(int64_t j) const { return static_cast<const T*>(a_.draft_probs) + j * a_.topk; }

  double q_of(int64_t j, int64_t d) const {
    switch (a_.draft_kind) {
      case DraftKind::kOneHot:
        return 1.0;
      case DraftKind::kDense:
        return static_cast<double>(dense_q(j)[d]);
      case DraftKind::kSparse:
        for (int64_t r = 0; r < a_.topk; ++r) {
          if (a_.draft_topk_ids[j * a_.topk + r] == d) return static_cast<double>(sparse_q(j)[r]);
        }
        return 0.0;
    }
    return 0.0;
  }

  // -1 when draft d is accepted at position i, else the token emitted in its place.
  int64_t verify_greedy(int64_t b, int64_t i, int64_t d) const {
    const int64_t best = argmax_lowest(row(b, i), vocab_);
    return best == d ? -1 : best;
  }

  // Logits row i as p = softmax((row - max) / T) in float64 into s_.p, the normaliser summed
  // by the chunk rule. (Probability rows are read in place.)
  void load_logits_p(int64_t b, int64_t i) {
    const T* r = row(b, i);
    double* p = s_.p.data();
    const double m = s_.row_max[i], temp = a_.temperature[b];
    for (int64_t t = 0; t < vocab_; ++t) p[t] = std::exp((static_cast<double>(r[t]) - m) / temp);
    const int64_t num_chunks = chunk_sums(p, vocab_, s_.sums.data());
    const double z = sum_left_to_right(s_.sums.data(), num_chunks);
    for (int64_t t = 0; t < vocab_; ++t) p[t] = p[t] / z;
  }

  template <typename S>
  int64_t sample(const S* w, double u) {
    const int64_t num_chunks = chunk_sums(w, vocab_, s_.sums.data());
    const double total = sum_left_to_right(s_.sums.data(), num_chunks);
    return sample_chunked(w, vocab_, s_.sums.data(), num_chunks, total, u);
  }

  // -1 when draft d is accepted at position i, else the token sampled in its place.
  int64_t verify_sampled(int64_t b, int64_t i, int64_t d) {
    const int64_t j = request_draft_start(a_, b) + i;
    const bool logits = a_.target_kind == TargetKind::kLogits;
    if (logits) load_logits_p(b, i);
    const double p_d = logits ? s_.p[d] : static_cast<double>(row(b, i)[d]);
    const double q_d = q_of(j, d);
    if (q_d > 0.0 && uniform(b, i, 0) * q_d < p_d) return -1;
    double* w = s_.w.data();
    if (logits) {
      fill_residual(s_.p.data(), j, d, w);
    } else {
      fill_residual(row(b, i), j, d, w);  // probabilities: straight from the row
    }
    const double u = uniform(b, i, 1);
    const int64_t num_chunks = chunk_sums(w, vocab_, s_.sums.data());
    const double mass = sum_left_to_right(s_.sums.data(), num_chunks);
    if (mass > kResidualMinMass)
      return sample_chunked(w, vocab_, s_.sums.data(), num_chunks, mass, u);
    if (!logits) return sample(row(b, i), u);
    return sample(s_.p.data(), u);
  }

  // w = max(p - q, 0) in float64 for draft j (token d), p read from S (the row or s_.p).
  template <typename S>
  void fill_residual(const S* p, int64_t j, int64_t d, double* w) const {
    switch (a_.draft_kind) {
      case DraftKind::kOneHot:
        for (int64_t t = 0; t < vocab_; ++t) w[t] = static_cast<double>(p[t]);
        w[d] = std::max(static_cast<double>(p[d]) - 1.0, 0.0);
        break;
      case DraftKind::kDense: {
        const T* q = dense_q(j);
        for (int64_t t = 0; t < vocab_; ++t) {
          w[t] = std::max(static_cast<double>(p[t]) - static_cast<double>(q[t]), 0.0);
        }
        break;
      }
      case DraftKind::kSparse:
        for (int64_t t = 0; t < vocab_; ++t) w[t] = static_cast<double>(p[t]);
        for (int64_t r = 0; r < a_.topk; ++r) {
          const int64_t id = a_.draft_topk_ids[j * a_.topk + r];
          w[id] = std::max(static_cast<double>(p[id]) - static_cast<double>(sparse_q(j)[r]), 0.0);
        }
        break;
    }
  }

  int64_t sample_bonus(int64_t b, int64_t k) {
    if (a_.target_kind == TargetKind::kProbs) return sample(row(b, k), uniform(b, k, 1));
    load_logits_p(b, k);
    return sample(s_.p.data(), uniform(b, k, 1));
  }

  const VerifyDraftArgs& a_;
  Scratch& s_;
  int64_t vocab_;
};

template <typename T>
void run_all(const VerifyDraftArgs& args, int num_threads) {
  const int64_t num_workers =
      std::max<int64_t>(1, std::min<int64_t>(num_threads, args.num_requests));
  std::vector<Scratch> scratch(static_cast<size_t>(num_workers));
  const int64_t num_chunks = (args.vocab_size + kSampleChunk - 1) / kSampleChunk;
  for (Scratch& s : scratch) {
    s.p.resize(static_cast<size_t>(args.vocab_size));
    s.w.resize(static_cast<size_t>(args.vocab_size));
    s.sums.resize(static_cast<size_t>(num_chunks));
    s.row_max.reserve(
        static_cast<size_t>(args.out_cols));  // k + 1 <= out_cols: no allocation in threads
  }
  std::atomic<int64_t> cursor{0};
  auto work = [&](int64_t worker) {
    RequestVerifier<T> verifier(args, scratch[static_cast<size_t>(worker)]);
    for (int64_t b = cursor.fetch_add(1); b < args.num_requests; b = cursor.fetch_add(1)) {
      verifier.run(b);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(num_workers - 1));
  for (int64_t w = 1; w < num_workers; ++w) threads.emplace_back(work, w);
  work(0);
  for (std::thread& t : threads) t.join();
}

}  // namespace

bool probability_row_ok(const float* row, int64_t n, double tolerance, SimdPath path) {
  return row_ok(row, n, tolerance, path);
}

bool probability_row_ok(const double* row, int64_t n, double tolerance, SimdPath path) {
  return row_ok(row, n, tolerance, path);
}

void verify_draft_cpu(const VerifyDraftArgs& args, int num_threads) {
  if (args.num_requests == 0) return;
  if (args.dtype == ScalarType::kFloat32) {
    run_all<float>(args, num_threads);
  } else {
    run_all<double>(args, num_threads);
  }
}

}  // namespace lumen
