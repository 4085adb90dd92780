// scatter_with_crc (lumen/holder/verify_scatter.h): crc32 over three chains of 8-byte loads;
// non-temporal 64-byte stores where the kernels copy with AVX-512 (cpu_copy_kind) and the
// destinations are 64-byte aligned (a restore that verified while it wrote ran at 0.95-1.04x
// memcpy instead of 0.75-0.93x with 8-byte ones; restore now verifies each group before it
// writes it, issue 17), else non-temporal 8-byte stores.
#include "lumen/holder/verify_scatter.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "lumen/gather.h"

namespace lumen::holder {

std::vector<int> fused_plane_order(const PlaneDesc* planes, int num_planes, int64_t record_bytes) {
  std::vector<int> order;
  if (!__builtin_cpu_supports("sse4.2")) return order;
  for (int i = 0; i < num_planes; ++i) order.push_back(i);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return planes[a].record_offset < planes[b].record_offset; });
  int64_t end = 0;
  for (int i : order) {
    if (planes[i].record_offset != end) return {};
    end += plane_row_bytes(planes[i]);
  }
  if (end != record_bytes) return {};
  return order;
}

namespace {

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

__attribute__((target("sse4.2"))) void copy_piece3(const uint8_t* const* src, uint8_t* const* dst,
                                                   int64_t bytes, uint64_t* crc) {
  uint64_t c0 = crc[0], c1 = crc[1], c2 = crc[2];
  int64_t k = 0;
  for (; k + 8 <= bytes; k += 8) {
    const uint64_t a = load64(src[0] + k);
    const uint64_t b = load64(src[1] + k);
    const uint64_t c = load64(src[2] + k);
    c0 = _mm_crc32_u64(c0, a);
    c1 = _mm_crc32_u64(c1, b);
    c2 = _mm_crc32_u64(c2, c);
    _mm_stream_si64(reinterpret_cast<long long*>(dst[0] + k), static_cast<long long>(a));
    _mm_stream_si64(reinterpret_cast<long long*>(dst[1] + k), static_cast<long long>(b));
    _mm_stream_si64(reinterpret_cast<long long*>(dst[2] + k), static_cast<long long>(c));
  }
  for (; k < bytes; ++k) {
    c0 = _mm_crc32_u8(static_cast<uint32_t>(c0), src[0][k]);
    c1 = _mm_crc32_u8(static_cast<uint32_t>(c1), src[1][k]);
    c2 = _mm_crc32_u8(static_cast<uint32_t>(c2), src[2][k]);
    dst[0][k] = src[0][k];
    dst[1][k] = src[1][k];
    dst[2][k] = src[2][k];
  }
  crc[0] = c0;
  crc[1] = c1;
  crc[2] = c2;
}

// The same for 64-byte-aligned destinations: each line moves with one 64-byte load and one
// 64-byte streaming store; the crc reads the line again from L1, 8 bytes at a time.
__attribute__((target("avx512f,sse4.2"))) void copy_piece3_avx512(const uint8_t* const* src,
                                                                  uint8_t* const* dst,
                                                                  int64_t bytes, uint64_t* crc) {
  uint64_t c0 = crc[0], c1 = crc[1], c2 = crc[2];
  int64_t k = 0;
  for (; k + 64 <= bytes; k += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst[0] + k), _mm512_loadu_si512(src[0] + k));
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst[1] + k), _mm512_loadu_si512(src[1] + k));
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst[2] + k), _mm512_loadu_si512(src[2] + k));
    for (int64_t j = k; j < k + 64; j += 8) {
      c0 = _mm_crc32_u64(c0, load64(src[0] + j));
      c1 = _mm_crc32_u64(c1, load64(src[1] + j));
      c2 = _mm_crc32_u64(c2, load64(src[2] + j));
    }
  }
  crc[0] = c0;
  crc[1] = c1;
  crc[2] = c2;
  if (k < bytes) {
    const uint8_t* s[3] = {src[0] + k, src[1] + k, src[2] + k};
    uint8_t* d[3] = {dst[0] + k, dst[1] + k, dst[2] + k};
    copy_piece3(s, d, bytes - k, crc);
  }
}

__attribute__((target("sse4.2"))) void copy_piece1(const uint8_t* src, uint8_t* dst, int64_t bytes,
                                                   uint64_t* crc) {
  uint64_t c = *crc;
  int64_t k = 0;
  for (; k + 8 <= bytes; k += 8) {
    const uint64_t a = load64(src + k);
    c = _mm_crc32_u64(c, a);
    _mm_stream_si64(reinterpret_cast<long long*>(dst + k), static_cast<long long>(a));
  }
  for (; k < bytes; ++k) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), src[k]);
    dst[k] = src[k];
  }
  *crc = c;
}

}  // namespace

void scatter_with_crc(const uint8_t* const* records, const int64_t* slot_ids, int count,
                      const PlaneDesc* planes, const std::vector<int>& order, uint32_t* crcs) {
  // The kernels' routine choice (LUMEN_CPU_COPY included) decides whether stores are wide.
  static const bool wide = std::strcmp(cpu_copy_kind(), "avx512") == 0;
  uint64_t crc[3] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
  for (int index : order) {
    const PlaneDesc& plane = planes[index];
    auto* base = reinterpret_cast<uint8_t*>(plane.base_address);
    for (int64_t piece = 0; piece < plane.num_pieces; ++piece) {
      const uint8_t* src[3] = {};
      uint8_t* dst[3] = {};
      for (int t = 0; t < count; ++t) {
        src[t] = records[t] + plane.record_offset + piece * plane.piece_bytes;
        dst[t] = base + slot_piece_offset(plane, slot_ids[t], piece);
      }
      if (count == 3 && wide &&
          ((reinterpret_cast<uintptr_t>(dst[0]) | reinterpret_cast<uintptr_t>(dst[1]) |
            reinterpret_cast<uintptr_t>(dst[2])) &
           63) == 0) {
        copy_piece3_avx512(src, dst, plane.piece_bytes, crc);
      } else if (count == 3) {
        copy_piece3(src, dst, plane.piece_bytes, crc);
      } else {
        for (int t = 0; t < count; ++t) copy_piece1(src[t], dst[t], plane.piece_bytes, &crc[t]);
      }
    }
  }
  _mm_sfence();
  for (int t = 0; t < count; ++t) crcs[t] = static_cast<uint32_t>(~crc[t]);
}

}  // namespace lumen::holder
