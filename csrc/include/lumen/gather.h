// Token-record gather/scatter between a paged KV cache (planes, see slot_index.h) and
// contiguous records [num_tokens, record_bytes]. CPU (gather.cpp) and CUDA (gather.cu)
// variants take the same arguments; the CUDA ones add where the records live and a stream.
#pragma once
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "lumen/slot_index.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace lumen {

// Cheap re-checks of what Python validated. Inline so the CPU and the CUDA module share them.
// std::invalid_argument: a malformed descriptor (non-positive sizes, a row of 2 GiB or more, a
// row outside the record).
inline void validate_planes(const PlaneDesc* planes, int num_planes, int64_t record_bytes) {
  if (num_planes < 1 || planes == nullptr || record_bytes < 1) {
    throw std::invalid_argument("planes: need at least one plane and record_bytes >= 1");
  }
  for (int i = 0; i < num_planes; ++i) {
    const PlaneDesc& p = planes[i];
    if (p.base_address == 0 || p.num_slots < 0 || p.block_size < 1 || p.num_pieces < 1 ||
        p.piece_bytes < 1 || p.record_offset < 0 || plane_row_bytes(p) >= (int64_t{1} << 31) ||
        p.record_offset + plane_row_bytes(p) > record_bytes) {
      throw std::invalid_argument("planes: malformed descriptor of plane " + std::to_string(i));
    }
  }
}

// std::out_of_range: a slot outside some plane.
inline void validate_slots(const PlaneDesc* planes, int num_planes, const int64_t* slot_ids,
                           int64_t num_tokens) {
  int64_t num_slots = planes[0].num_slots;
  for (int i = 1; i < num_planes; ++i) num_slots = std::min(num_slots, planes[i].num_slots);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot_ids[t] < 0 || slot_ids[t] >= num_slots) {
      throw std::out_of_range("slot_ids: slot " + std::to_string(slot_ids[t]) + " outside [0, " +
                              std::to_string(num_slots) + ")");
    }
  }
}

// records[t, plane.record_offset : + row_bytes] = row of slot_ids[t] in plane, for all t and
// planes. num_threads <= 1 runs on the calling thread.
void gather_tokens_cpu(uint8_t* records, const PlaneDesc* planes, int num_planes,
                       int64_t record_bytes, const int64_t* slot_ids, int64_t num_tokens,
                       int num_threads);

// The inverse: writes the rows of slot_ids only. slot_ids must not repeat.
void scatter_tokens_cpu(const uint8_t* records, const PlaneDesc* planes, int num_planes,
                        int64_t record_bytes, const int64_t* slot_ids, int64_t num_tokens,
                        int num_threads);

// dst[0:num_bytes] = src[0:num_bytes] split over num_threads threads, with memcpy (the
// ceiling the benchmarks compare against) or with the kernels' streaming copy routine.
void copy_bytes_cpu(uint8_t* dst, const uint8_t* src, int64_t num_bytes, int num_threads,
                    bool streaming = false);

// Name of the streaming copy routine the CPU kernels use for every scatter and for gathers
// larger than a quarter of the last-level cache ("avx512", "avx2" or "memcpy"); smaller
// gathers use plain memcpy.
const char* cpu_copy_kind();

enum class MoveDirection { kGather, kScatter };

// Where the records of a CUDA gather/scatter live.
enum class RecordPlacement {
  kDevice,      // device memory
  kMappedHost,  // pinned, mapped host memory read/written by the kernel itself
  kStagedHost,  // pinned host memory, via a device staging buffer + cudaMemcpyAsync
};

// CUDA variants: planes_host (for validation) and planes_device describe the same planes;
// slot_ids_device is device memory, already bounds-checked by the caller (the kernel skips
// out-of-range slots rather than fault). staging_device is used for kStagedHost only and
// holds num_tokens * record_bytes. Asynchronous on `stream`; launch errors throw
// std::runtime_error.
void gather_tokens_cuda(uint8_t* records, const PlaneDesc* planes_host,
                        const PlaneDesc* planes_device, int num_planes, int64_t record_bytes,
                        const int64_t* slot_ids_device, int64_t num_tokens,
                        RecordPlacement placement, uint8_t* staging_device, CUstream_st* stream);
void scatter_tokens_cuda(const uint8_t* records, const PlaneDesc* planes_host,
                         const PlaneDesc* planes_device, int num_planes, int64_t record_bytes,
                         const int64_t* slot_ids_device, int64_t num_tokens,
                         RecordPlacement placement, uint8_t* staging_device, CUstream_st* stream);

// Runs the CUDA kernel's per-lane code on the CPU over host memory, lane by lane, for a grid
// of num_blocks blocks (<= 0: the grid the launcher would use). Lets the kernel's index and
// access-width logic be tested on machines without a GPU; not a fast path.
void emulate_move_tokens_on_host(uint8_t* records, const PlaneDesc* planes, int num_planes,
                                 int64_t record_bytes, const int64_t* slot_ids, int64_t num_tokens,
                                 MoveDirection direction, int64_t num_blocks);

}  // namespace lumen
