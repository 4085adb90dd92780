// CPU token-record gather/scatter.
//
// Work is a flat list of items split into one contiguous range per thread:
// - scatter: (token, plane) units in token-major order, so records are read sequentially;
// - gather: (tile of kTileTokens tokens, plane) items, each copying the tile's rows of one
//   plane in token order, so consecutive slots are read as one sequential stream per plane
//   (what the hardware prefetcher follows) instead of num_planes interleaved streams.
//   Measured here on restore batches, 1 thread: 0.71x -> 0.85x of memcpy; scatter was better
//   token-major.
// Rows of at least kStreamMinBytes are copied with non-temporal (streaming) stores: small
// copies otherwise pay a read-for-ownership of every destination line, which halves the
// bandwidth (PERF_NOTES.md). A scatter always streams (it restores KV the engine reads later;
// a 32 MiB decode batch scattered at 10.5-11.1 GB/s streaming against 5.9-6.2 with plain
// stores, 1 thread). A gather streams batches larger than a quarter of the last-level cache;
// a smaller one is copied with plain stores, so its records stay there for the checksum and
// send that follow. Gather then checksum of 128 KiB decode records, 32 MiB cache: 8 MiB
// batches 9.5-9.7 GB/s plain against 9.1-9.3 streaming (1 thread); 16 MiB 8.4-9.0 against
// 8.8-9.0, 32 MiB 6.9-8.2 against 8.7-9.2 (1 and 2 threads). The SIMD routine is picked at
// run time from the CPU's features.
// Pieces of at most kSmallPieceBytes (one element each) are copied element by element inline,
// not through the copy routine, and not prefetched one by one. Where consecutive slots of a
// block are consecutive elements (a transposed plane: vLLM's CPU cache stores K per block and
// head as [head_dim, block_size], so a token's K row is head_dim elements block_size apart),
// both ops move each run of consecutive slots of one block as a matrix, with the blocked
// transposes of transpose.h, by (tile, plane) items in a scatter too. Restore batches of whole
// blocks (vLLM CPU, 8 layers x 8 KV heads x 128, bf16, 1 thread, timed 512 tokens at a time):
// element by element, K alone gathered at 1.3-1.9 GB/s and scattered at 0.7, whole records
// at 0.13-0.25x and 0.05-0.07x of memcpy; transposed, K at 11-13 and 8.5-10.4 GB/s, records
// at 0.61-0.75x and 0.54-0.63x (bench/RESULTS.md).
#include "lumen/gather.h"

#include <immintrin.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "lumen/thread_pool.h"
#include "lumen/transpose.h"

namespace lumen {
namespace {

constexpr size_t kStreamMinBytes = 256;
// Rows ahead that a gather prefetches: scattered slots miss the hardware prefetcher; 6-12 rows
// (12-24 KiB of 2 KiB rows in flight) measured best for decode batches here.
constexpr int64_t kPrefetchUnits = 8;
constexpr int64_t kTileTokens = 64;
// Tokens ahead whose destination rows a scatter primes (1, 2 and 4 measured alike).
constexpr int64_t kScatterPrimeTokens = 2;
// Bytes ahead of its loads that a streaming copy prefetches, within the piece (the row
// prefetches above start a row; these keep its lines coming). A restore batch at 1 thread:
// gather 18.5-19.6 -> 22.5-23.3 GB/s, scatter 18.1-18.9 -> 21.7-22.6 (interleaved runs); in a
// bare copy loop 512 and 768 bytes did no better than 256.
constexpr size_t kCopyReadAhead = 256;

constexpr int64_t kSmallPieceBytes = 8;

using CopyFn = void (*)(uint8_t* dst, const uint8_t* src, size_t num_bytes);

inline bool has_small_pieces(const PlaneDesc& plane) {
  return plane.num_pieces > 1 && plane.piece_bytes <= kSmallPieceBytes;
}

// A plane whose pieces are single elements with consecutive slots in consecutive elements
// (vLLM CPU's K): a run of slots of one block is an element matrix, moved by transposing it.
inline bool is_transposed(const PlaneDesc& plane) {
  return has_small_pieces(plane) && plane.token_stride == plane.piece_bytes;
}

// num_pieces elements of T from src (src_stride apart) to dst (dst_stride apart).
template <typename T>
inline void copy_elements(uint8_t* dst, int64_t dst_stride, const uint8_t* src, int64_t src_stride,
                          int64_t num_pieces) {
  for (int64_t i = 0; i < num_pieces; ++i) {
    T value;
    std::memcpy(&value, src + i * src_stride, sizeof(T));
    std::memcpy(dst + i * dst_stride, &value, sizeof(T));
  }
}

// The pieces of a small-piece plane's row: gathered (row -> record) or scattered back.
inline void copy_small_pieces(uint8_t* dst, int64_t dst_stride, const uint8_t* src,
                              int64_t src_stride, const PlaneDesc& plane) {
  switch (plane.piece_bytes) {
    case 2:
      copy_elements<uint16_t>(dst, dst_stride, src, src_stride, plane.num_pieces);
      return;
    case 4:
      copy_elements<uint32_t>(dst, dst_stride, src, src_stride, plane.num_pieces);
      return;
    case 8:
      copy_elements<uint64_t>(dst, dst_stride, src, src_stride, plane.num_pieces);
      return;
    default:
      for (int64_t i = 0; i < plane.num_pieces; ++i) {
        std::memcpy(dst + i * dst_stride, src + i * src_stride,
                    static_cast<size_t>(plane.piece_bytes));
      }
  }
}

void copy_plain(uint8_t* dst, const uint8_t* src, size_t num_bytes) {
  std::memcpy(dst, src, num_bytes);
}

__attribute__((target("avx2"))) inline void copy_128_avx2(uint8_t* dst, const uint8_t* src) {
  __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
  __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64));
  __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 96));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 64), c);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 96), d);
}

__attribute__((target("avx2"))) void copy_stream_avx2(uint8_t* dst, const uint8_t* src,
                                                      size_t num_bytes) {
  if (num_bytes < kStreamMinBytes) {
    std::memcpy(dst, src, num_bytes);
    return;
  }
  size_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  num_bytes -= head;
  for (; num_bytes >= 128 + kCopyReadAhead; num_bytes -= 128, dst += 128, src += 128) {
    for (size_t line = 0; line < 128; line += 64) {
      __builtin_prefetch(src + kCopyReadAhead + line, 0, 0);
    }
    copy_128_avx2(dst, src);
  }
  for (; num_bytes >= 128; num_bytes -= 128, dst += 128, src += 128) copy_128_avx2(dst, src);
  for (; num_bytes >= 32; num_bytes -= 32, dst += 32, src += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  }
  std::memcpy(dst, src, num_bytes);
}

__attribute__((target("avx512f"))) inline void copy_256_avx512(uint8_t* dst, const uint8_t* src) {
  __m512i a = _mm512_loadu_si512(src);
  __m512i b = _mm512_loadu_si512(src + 64);
  __m512i c = _mm512_loadu_si512(src + 128);
  __m512i d = _mm512_loadu_si512(src + 192);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), a);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 64), b);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 128), c);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 192), d);
}

__attribute__((target("avx512f"))) void copy_stream_avx512(uint8_t* dst, const uint8_t* src,
                                                           size_t num_bytes) {
  if (num_bytes < kStreamMinBytes) {
    std::memcpy(dst, src, num_bytes);
    return;
  }
  size_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  num_bytes -= head;
  for (; num_bytes >= 256 + kCopyReadAhead; num_bytes -= 256, dst += 256, src += 256) {
    for (size_t line = 0; line < 256; line += 64) {
      __builtin_prefetch(src + kCopyReadAhead + line, 0, 0);
    }
    copy_256_avx512(dst, src);
  }
  for (; num_bytes >= 256; num_bytes -= 256, dst += 256, src += 256) copy_256_avx512(dst, src);
  for (; num_bytes >= 64; num_bytes -= 64, dst += 64, src += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_loadu_si512(src));
  }
  std::memcpy(dst, src, num_bytes);
}

struct CopyRoutine {
  CopyFn fn;
  const char* kind;
};

// The best routine this CPU runs, or the one LUMEN_CPU_COPY names (avx512, avx2, memcpy):
// for comparing them on one machine, and for testing the ones its own CPU would not pick.
CopyRoutine pick_copy() {
  __builtin_cpu_init();
  const CopyRoutine supported[] = {
      {__builtin_cpu_supports("avx512f") ? copy_stream_avx512 : nullptr, "avx512"},
      {__builtin_cpu_supports("avx2") ? copy_stream_avx2 : nullptr, "avx2"},
      {copy_plain, "memcpy"},
  };
  const char* wanted = std::getenv("LUMEN_CPU_COPY");
  for (const CopyRoutine& routine : supported) {
    if (routine.fn == nullptr) continue;
    const bool any = wanted == nullptr || *wanted == '\0';
    if (any || std::strcmp(wanted, routine.kind) == 0) return routine;
  }
  throw std::invalid_argument(
      std::string("LUMEN_CPU_COPY must be avx512, avx2 or memcpy, one this CPU supports; got ") +
      wanted);
}

const CopyRoutine& copy_routine() {
  static const CopyRoutine routine = pick_copy();
  return routine;
}

// The transposes follow the copy routine, so LUMEN_CPU_COPY=avx2 or memcpy also selects (and
// lets tests reach) the portable transpose on an AVX-512 CPU.
TransposeIsa transpose_isa() {
  static const TransposeIsa isa =
      std::strcmp(copy_routine().kind, "avx512") == 0 && __builtin_cpu_supports("avx512bw")
          ? TransposeIsa::kAvx512
          : TransposeIsa::kPortable;
  return isa;
}

// Size of the largest cache that the first CPU has, as sysfs gives it ("32768K"), or 0. This,
// not sysconf, is the cache a core shares: glibc's _SC_LEVEL3_CACHE_SIZE can count the L3 of
// every core complex of the package (384 MiB on this EPYC VM, whose core sees 32 MiB).
int64_t sysfs_cache_bytes() {
  int best_level = 0;
  int64_t best_bytes = 0;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream level_file(dir + "/level"), size_file(dir + "/size");
    int level = 0;
    int64_t size = 0;
    std::string unit;
    if (!(level_file >> level) || !(size_file >> size)) continue;
    size_file >> unit;  // "K" or "M" follows the number, when any
    const int64_t bytes = size << (unit == "M" ? 20 : unit == "K" ? 10 : 0);
    if (level > best_level || (level == best_level && bytes > best_bytes)) {
      best_level = level;
      best_bytes = bytes;
    }
  }
  return best_bytes;
}

// The last-level cache size: sysfs, else sysconf (L3, else L2), else 32 MiB.
int64_t cache_bytes() {
  static const int64_t bytes = [] {
    if (const int64_t size = sysfs_cache_bytes(); size > 0) return size;
    for (int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
      const long size = sysconf(name);
      if (size > 0) return static_cast<int64_t>(size);
    }
    return int64_t{32} << 20;
  }();
  return bytes;
}

CopyFn gather_copy_for(int64_t payload_bytes) {
  return payload_bytes > cache_bytes() / 4 ? copy_routine().fn : copy_plain;
}

// Orders this thread's streaming stores before the pool reports the job done.
inline void store_fence() { _mm_sfence(); }

inline void prefetch_row(const PlaneDesc& plane, int64_t slot) {
  if (has_small_pieces(plane)) return;
  const char* row =
      reinterpret_cast<const char*>(plane.base_address) + slot_row_offset(plane, slot);
  for (int64_t piece = 0; piece < plane.num_pieces; ++piece) {
    const char* start = row + piece * plane.piece_stride;
    for (int64_t b = 0; b < plane.piece_bytes; b += 64) __builtin_prefetch(start + b, 0, 0);
  }
}

// Starts the page walk of every piece of a row by prefetching its first line (kLocality as
// in __builtin_prefetch: 3 keeps it in every cache level, 0 marks it non-temporal).
template <int kLocality>
inline void prime_row(const PlaneDesc& plane, int64_t slot) {
  if (has_small_pieces(plane)) return;
  const char* row =
      reinterpret_cast<const char*>(plane.base_address) + slot_row_offset(plane, slot);
  for (int64_t piece = 0; piece < plane.num_pieces; ++piece) {
    __builtin_prefetch(row + piece * plane.piece_stride, 0, kLocality);
  }
}

int workers_for(int64_t num_bytes, int64_t num_units, int num_threads) {
  // Below ~256 KiB per thread waking the pool costs more than it gains.
  int64_t useful = std::max<int64_t>(1, num_bytes / (256 << 10));
  return static_cast<int>(std::min<int64_t>({std::max(1, num_threads), num_units, useful}));
}

void check_arguments(const uint8_t* records, const PlaneDesc* planes, int num_planes,
                     int64_t record_bytes, const int64_t* slot_ids, int64_t num_tokens) {
  if (num_tokens < 0) throw std::invalid_argument("num_tokens must be >= 0");
  if (num_tokens == 0) return;
  if (records == nullptr || slot_ids == nullptr) throw std::invalid_argument("null pointer");
  validate_planes(planes, num_planes, record_bytes);
  validate_slots(planes, num_planes, slot_ids, num_tokens);
}

inline uint8_t* row_of(const PlaneDesc& plane, int64_t slot) {
  return reinterpret_cast<uint8_t*>(plane.base_address) + slot_row_offset(plane, slot);
}

// Number of tokens from `first` (< last) whose slots follow slot_ids[first] one by one inside
// its block.
inline int64_t block_run_length(const PlaneDesc& plane, const int64_t* slot_ids, int64_t first,
                                int64_t last) {
  const int64_t slot = slot_ids[first];
  const int64_t limit = std::min(last - first, plane.block_size - slot % plane.block_size);
  int64_t length = 1;
  while (length < limit && slot_ids[first + length] == slot + length) ++length;
  return length;
}

// Tokens [first, last) of a transposed plane, one block run at a time: the run's
// [num_pieces, run] elements in the cache <-> its records' [run, num_pieces] rows.
void gather_transposed(uint8_t* records, const PlaneDesc& plane, int64_t record_bytes,
                       const int64_t* slot_ids, int64_t first, int64_t last, bool stream) {
  for (int64_t token = first; token < last;) {
    const int64_t run = block_run_length(plane, slot_ids, token, last);
    transpose_elements(records + token * record_bytes + plane.record_offset, record_bytes,
                       row_of(plane, slot_ids[token]), plane.piece_stride, plane.num_pieces, run,
                       plane.piece_bytes, transpose_isa(), stream);
    token += run;
  }
}

void scatter_transposed(const uint8_t* records, const PlaneDesc& plane, int64_t record_bytes,
                        const int64_t* slot_ids, int64_t first, int64_t last) {
  for (int64_t token = first; token < last;) {
    const int64_t run = block_run_length(plane, slot_ids, token, last);
    transpose_elements(row_of(plane, slot_ids[token]), plane.piece_stride,
                       records + token * record_bytes + plane.record_offset, record_bytes, run,
                       plane.num_pieces, plane.piece_bytes, transpose_isa(), /*stream=*/true);
    token += run;
  }
}

}  // namespace

void gather_tokens_cpu(uint8_t* records, const PlaneDesc* planes, int num_planes,
                       int64_t record_bytes, const int64_t* slot_ids, int64_t num_tokens,
                       int num_threads) {
  check_arguments(records, planes, num_planes, record_bytes, slot_ids, num_tokens);
  if (num_tokens == 0) return;
  CopyFn copy = gather_copy_for(num_tokens * record_bytes);
  int64_t num_tiles = (num_tokens + kTileTokens - 1) / kTileTokens;
  int64_t num_items = num_tiles * num_planes;
  int workers = workers_for(num_tokens * record_bytes, num_items, num_threads);
  ThreadPool::instance().run(workers, [&](int worker, int count) {
    int64_t begin, end;
    split_range(num_items, worker, count, &begin, &end);
    for (int64_t item = begin; item < end; ++item) {
      int64_t tile = item / num_planes;
      int64_t plane_index = item - tile * num_planes;
      const PlaneDesc& plane = planes[plane_index];
      int64_t first = tile * kTileTokens;
      int64_t last = std::min(num_tokens, first + kTileTokens);
      if (is_transposed(plane)) {
        gather_transposed(records, plane, record_bytes, slot_ids, first, last, copy != copy_plain);
        continue;
      }
      if (slot_ids[last - 1] - slot_ids[first] != last - 1 - first) {
        // Scattered rows each miss the TLB; one after another their page walks set the pace
        // (a decode batch at 1 thread: 7.0-8.2 GB/s). Started together for the whole tile
        // first, they overlap: 9.4-11.3 GB/s. A run of consecutive slots needs none of it.
        for (int64_t token = first; token < last; ++token) prime_row<3>(plane, slot_ids[token]);
      }
      for (int64_t token = first; token < last; ++token) {
        int64_t ahead = token + kPrefetchUnits;
        if (ahead < last) {
          prefetch_row(plane, slot_ids[ahead]);
        } else if (plane_index + 1 < num_planes) {  // the next plane's rows of this tile
          prefetch_row(planes[plane_index + 1], slot_ids[std::min(first + ahead - last, last - 1)]);
        }
        uint8_t* row = row_of(plane, slot_ids[token]);
        uint8_t* record = records + token * record_bytes + plane.record_offset;
        if (has_small_pieces(plane)) {
          copy_small_pieces(record, plane.piece_bytes, row, plane.piece_stride, plane);
          continue;
        }
        for (int64_t piece = 0; piece < plane.num_pieces; ++piece) {
          copy(record + piece * plane.piece_bytes, row + piece * plane.piece_stride,
               static_cast<size_t>(plane.piece_bytes));
        }
      }
    }
    store_fence();
  });
}

void scatter_tokens_cpu(const uint8_t* records, const PlaneDesc* planes, int num_planes,
                        int64_t record_bytes, const int64_t* slot_ids, int64_t num_tokens,
                        int num_threads) {
  check_arguments(records, planes, num_planes, record_bytes, slot_ids, num_tokens);
  if (num_tokens == 0) return;
  CopyFn copy = copy_routine().fn;
  std::vector<int> transposed_planes;
  for (int p = 0; p < num_planes; ++p) {
    if (is_transposed(planes[p])) transposed_planes.push_back(p);
  }
  const int64_t num_transposed = static_cast<int64_t>(transposed_planes.size());
  const int64_t num_units = num_tokens * num_planes;
  const int64_t num_items = (num_tokens + kTileTokens - 1) / kTileTokens * num_transposed;
  int workers = workers_for(num_tokens * record_bytes, num_units, num_threads);
  ThreadPool::instance().run(workers, [&](int worker, int count) {
    int64_t begin, end;
    // Transposed planes first, by (tile, plane) items as in a gather: a run of slots is
    // transposed at once, which a token-by-token walk cannot do.
    split_range(num_items, worker, count, &begin, &end);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / num_transposed;
      const PlaneDesc& plane = planes[transposed_planes[item - tile * num_transposed]];
      const int64_t first = tile * kTileTokens;
      scatter_transposed(records, plane, record_bytes, slot_ids, first,
                         std::min(num_tokens, first + kTileTokens));
    }
    // The other planes token by token (their units of transposed planes are skipped).
    split_range(num_units, worker, count, &begin, &end);
    for (int64_t unit = begin; unit < end; ++unit) {
      int64_t token = unit / num_planes;
      int64_t plane_index = unit - token * num_planes;
      if (plane_index == 0 && token + kScatterPrimeTokens < num_tokens) {
        // Every row of a token lies in another page (one plane per layer tensor), and a
        // streaming store that misses the TLB stalls on the walk: started two tokens ahead,
        // the walks overlap the copies (a decode batch at 1 thread: 0.37-0.55x -> 0.8-0.97x
        // of memcpy). The line is fetched non-temporal: the store replaces it anyway.
        for (int p = 0; p < num_planes; ++p) {
          prime_row<0>(planes[p], slot_ids[token + kScatterPrimeTokens]);
        }
      }
      const PlaneDesc& plane = planes[plane_index];
      if (is_transposed(plane)) continue;
      uint8_t* row = row_of(plane, slot_ids[token]);
      const uint8_t* record = records + token * record_bytes + plane.record_offset;
      if (has_small_pieces(plane)) {
        copy_small_pieces(row, plane.piece_stride, record, plane.piece_bytes, plane);
        continue;
      }
      for (int64_t piece = 0; piece < plane.num_pieces; ++piece) {
        copy(row + piece * plane.piece_stride, record + piece * plane.piece_bytes,
             static_cast<size_t>(plane.piece_bytes));
      }
    }
    store_fence();
  });
}

void copy_bytes_cpu(uint8_t* dst, const uint8_t* src, int64_t num_bytes, int num_threads,
                    bool streaming) {
  if (num_bytes < 0) throw std::invalid_argument("num_bytes must be >= 0");
  if (num_bytes == 0) return;
  if (dst == nullptr || src == nullptr) throw std::invalid_argument("null pointer");
  CopyFn copy = streaming ? copy_routine().fn : copy_plain;
  int workers = workers_for(num_bytes, num_bytes, num_threads);
  ThreadPool::instance().run(workers, [&](int worker, int count) {
    int64_t begin, end;
    split_range(num_bytes, worker, count, &begin, &end);
    copy(dst + begin, src + begin, static_cast<size_t>(end - begin));
    if (streaming) store_fence();
  });
}

const char* cpu_copy_kind() { return copy_routine().kind; }

}  // namespace lumen
