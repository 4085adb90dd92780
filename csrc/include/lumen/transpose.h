// Blocked transposes of element matrices, for planes whose consecutive slots are consecutive
// elements (vLLM's CPU cache keeps K per (block, head) as [head_dim, block_size]): a run of
// slots of one block is then a [num_pieces, run] matrix that a gather transposes into the run's
// records ([run, num_pieces] at record_bytes apart) and a scatter transposes back.
//
// The matrix is cut into square tiles of one 64-byte line per row (32 x 32 elements of 2 bytes,
// 16 x 16 of 4 bytes, 8 x 8 of 8). A full tile of 2- or 4-byte elements is transposed in
// AVX-512 registers: its rows are loaded as one line each, shuffled in log2(tile) stages and
// stored as one line per output row, streaming where the caller asks. Edge tiles, other element
// sizes and CPUs without AVX-512 take the portable loop over each tile, element by element: the
// same bytes (tests compare the two), at a quarter of the speed or less. Tiles keep the loop's
// strided side within a few lines and pages: a scatter's run walked whole, each element read
// from another record 32 KiB away, went at half the speed of the tiled loop.
//
// Header-only, like thread_pool.h, so that every module compiling gather.cpp gets it.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace lumen {

enum class TransposeIsa { kPortable, kAvx512 };

namespace transpose_detail {

constexpr int64_t kLineBytes = 64;

template <typename T>
inline void transpose_portable_typed(uint8_t* dst, int64_t dst_stride, const uint8_t* src,
                                     int64_t src_stride, int64_t num_rows, int64_t num_cols) {
  for (int64_t c = 0; c < num_cols; ++c) {
    uint8_t* out = dst + c * dst_stride;
    for (int64_t r = 0; r < num_rows; ++r) {
      T value;
      std::memcpy(&value, src + r * src_stride + c * static_cast<int64_t>(sizeof(T)), sizeof(T));
      std::memcpy(out + r * static_cast<int64_t>(sizeof(T)), &value, sizeof(T));
    }
  }
}

// dst[c][r] = src[r][c], element by element.
inline void transpose_portable(uint8_t* dst, int64_t dst_stride, const uint8_t* src,
                               int64_t src_stride, int64_t num_rows, int64_t num_cols,
                               int64_t elem_bytes) {
  switch (elem_bytes) {
    case 1:
      return transpose_portable_typed<uint8_t>(dst, dst_stride, src, src_stride, num_rows,
                                               num_cols);
    case 2:
      return transpose_portable_typed<uint16_t>(dst, dst_stride, src, src_stride, num_rows,
                                                num_cols);
    case 4:
      return transpose_portable_typed<uint32_t>(dst, dst_stride, src, src_stride, num_rows,
                                                num_cols);
    case 8:
      return transpose_portable_typed<uint64_t>(dst, dst_stride, src, src_stride, num_rows,
                                                num_cols);
    default:
      for (int64_t c = 0; c < num_cols; ++c) {
        for (int64_t r = 0; r < num_rows; ++r) {
          std::memcpy(dst + c * dst_stride + r * elem_bytes, src + r * src_stride + c * elem_bytes,
                      static_cast<size_t>(elem_bytes));
        }
      }
  }
}

__attribute__((target("avx512f"))) inline void store_line(uint8_t* dst, __m512i line, bool stream) {
  if (stream) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), line);
  } else {
    _mm512_storeu_si512(dst, line);
  }
}

// The last stage of both tiles: x[g] holds, in its 128-bit lane k, the part from row group g of
// output row k * lane_row_step (dst points at the output row of k = 0). A 4 x 4 transpose of
// 128-bit lanes puts lane k of x0..x3 together, in group order, and stores it as that row.
__attribute__((target("avx512f"))) inline void store_lane_transpose(
    uint8_t* dst, int64_t dst_stride, int64_t lane_row_step, __m512i x0, __m512i x1, __m512i x2,
    __m512i x3, bool stream) {
  const __m512i y0 =
      _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(1, 0, 1, 0));  // x0.l0 x0.l1 x1.l0 x1.l1
  const __m512i y1 =
      _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(3, 2, 3, 2));  // x0.l2 x0.l3 x1.l2 x1.l3
  const __m512i y2 = _mm512_shuffle_i32x4(x2, x3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i y3 = _mm512_shuffle_i32x4(x2, x3, _MM_SHUFFLE(3, 2, 3, 2));
  const int64_t step = lane_row_step * dst_stride;
  store_line(dst, _mm512_shuffle_i32x4(y0, y2, _MM_SHUFFLE(2, 0, 2, 0)), stream);  // lanes 0
  store_line(dst + step, _mm512_shuffle_i32x4(y0, y2, _MM_SHUFFLE(3, 1, 3, 1)), stream);
  store_line(dst + 2 * step, _mm512_shuffle_i32x4(y1, y3, _MM_SHUFFLE(2, 0, 2, 0)), stream);
  store_line(dst + 3 * step, _mm512_shuffle_i32x4(y1, y3, _MM_SHUFFLE(3, 1, 3, 1)), stream);
}

// 32 x 32 elements of 2 bytes. Each group of 8 rows is transposed within 128-bit lanes (16-,
// 32-, then 64-bit interleaves), after which lane k of register j of group g holds column
// 8k + j of rows 8g..8g+7; the lane transpose assembles each column from the four groups.
__attribute__((target("avx512f,avx512bw"))) inline void transpose_tile_2byte_avx512(
    uint8_t* dst, int64_t dst_stride, const uint8_t* src, int64_t src_stride, bool stream) {
  __m512i r[32];
  for (int i = 0; i < 32; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  for (int g = 0; g < 4; ++g) {
    __m512i* a = r + 8 * g;
    __m512i t[8];
    for (int i = 0; i < 4; ++i) {  // t[2i], t[2i+1]: columns 0-3 and 4-7 of rows 2i, 2i+1
      t[2 * i] = _mm512_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    // u[2h + s]: columns 2(2h + s), +1 of rows 0-3 (h = 0, 1) and, at +4, of rows 4-7.
    const __m512i u0 = _mm512_unpacklo_epi32(t[0], t[2]), u1 = _mm512_unpackhi_epi32(t[0], t[2]);
    const __m512i u2 = _mm512_unpacklo_epi32(t[1], t[3]), u3 = _mm512_unpackhi_epi32(t[1], t[3]);
    const __m512i u4 = _mm512_unpacklo_epi32(t[4], t[6]), u5 = _mm512_unpackhi_epi32(t[4], t[6]);
    const __m512i u6 = _mm512_unpacklo_epi32(t[5], t[7]), u7 = _mm512_unpackhi_epi32(t[5], t[7]);
    a[0] = _mm512_unpacklo_epi64(u0, u4);
    a[1] = _mm512_unpackhi_epi64(u0, u4);
    a[2] = _mm512_unpacklo_epi64(u1, u5);
    a[3] = _mm512_unpackhi_epi64(u1, u5);
    a[4] = _mm512_unpacklo_epi64(u2, u6);
    a[5] = _mm512_unpackhi_epi64(u2, u6);
    a[6] = _mm512_unpacklo_epi64(u3, u7);
    a[7] = _mm512_unpackhi_epi64(u3, u7);
  }
  for (int j = 0; j < 8; ++j) {
    store_lane_transpose(dst + j * dst_stride, dst_stride, 8, r[j], r[8 + j], r[16 + j], r[24 + j],
                         stream);
  }
}

// 16 x 16 elements of 4 bytes: groups of 4 rows transposed within lanes (32-, then 64-bit
// interleaves): lane k of register j of group g holds column 4k + j of rows 4g..4g+3.
__attribute__((target("avx512f"))) inline void transpose_tile_4byte_avx512(
    uint8_t* dst, int64_t dst_stride, const uint8_t* src, int64_t src_stride, bool stream) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  for (int g = 0; g < 4; ++g) {
    __m512i* a = r + 4 * g;
    const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    a[0] = _mm512_unpacklo_epi64(t0, t2);
    a[1] = _mm512_unpackhi_epi64(t0, t2);
    a[2] = _mm512_unpacklo_epi64(t1, t3);
    a[3] = _mm512_unpackhi_epi64(t1, t3);
  }
  for (int j = 0; j < 4; ++j) {
    store_lane_transpose(dst + j * dst_stride, dst_stride, 4, r[j], r[4 + j], r[8 + j], r[12 + j],
                         stream);
  }
}

}  // namespace transpose_detail

// dst[c * dst_stride + r * elem_bytes ...] = src[r * src_stride + c * elem_bytes ...] for every
// row r < num_rows and column c < num_cols (elements of elem_bytes; strides in bytes). The
// ranges must not overlap. stream: full tiles write their lines with non-temporal stores where
// the destination lines are 64-byte aligned (the caller fences). Each output line is whole, so
// this skips the read-for-ownership of plain stores. The tiles go column tile by column tile,
// and each prefetches the source lines of the next: its loads would otherwise issue only as the
// shuffles of the one before retire, one tile of misses in flight at a time. vLLM CPU K of a
// restore batch (bf16, 1 thread): plain stores 7.7 GB/s, streaming 11.6 (gathered; an L1 panel
// written out row by row with the streaming copy did no better than plain stores); without the
// prefetch, gather 8.0 and scatter 8.4 GB/s against 12.9 and 10.1.
inline void transpose_elements(uint8_t* dst, int64_t dst_stride, const uint8_t* src,
                               int64_t src_stride, int64_t num_rows, int64_t num_cols,
                               int64_t elem_bytes, TransposeIsa isa, bool stream) {
  using namespace transpose_detail;
  const bool simd = isa == TransposeIsa::kAvx512 && (elem_bytes == 2 || elem_bytes == 4);
  const int64_t tile = std::max<int64_t>(1, kLineBytes / elem_bytes);
  const int64_t row_tiles = (num_rows + tile - 1) / tile;
  const int64_t num_tiles = row_tiles * ((num_cols + tile - 1) / tile);
  for (int64_t i = 0; i < num_tiles; ++i) {
    const int64_t r0 = i % row_tiles * tile, c0 = i / row_tiles * tile;
    if (i + 1 < num_tiles) {
      const int64_t next_r0 = (i + 1) % row_tiles * tile, next_c0 = (i + 1) / row_tiles * tile;
      const uint8_t* next = src + next_r0 * src_stride + next_c0 * elem_bytes;
      for (int64_t r = 0; r < std::min(tile, num_rows - next_r0); ++r) {
        __builtin_prefetch(next + r * src_stride, 0, 3);
      }
    }
    const int64_t rows = std::min(tile, num_rows - r0), cols = std::min(tile, num_cols - c0);
    uint8_t* out = dst + c0 * dst_stride + r0 * elem_bytes;
    const uint8_t* in = src + r0 * src_stride + c0 * elem_bytes;
    if (!simd || rows < tile || cols < tile) {
      transpose_portable(out, dst_stride, in, src_stride, rows, cols, elem_bytes);
      continue;
    }
    const bool aligned = ((reinterpret_cast<uintptr_t>(out) | static_cast<uint64_t>(dst_stride)) &
                          (kLineBytes - 1)) == 0;
    if (elem_bytes == 2) {
      transpose_tile_2byte_avx512(out, dst_stride, in, src_stride, stream && aligned);
    } else {
      transpose_tile_4byte_avx512(out, dst_stride, in, src_stride, stream && aligned);
    }
  }
}

}  // namespace lumen
