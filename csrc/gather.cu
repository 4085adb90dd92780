// CUDA token-record gather/scatter: one launch for all tokens and planes.
//
// Thread mapping: a warp owns one (token, plane) unit at a time, units in token-major order,
// grid-stride over the units with a capped grid. The 32 lanes copy the unit's row in the
// widest accesses its addresses, piece stride and size allow (16 bytes for KV rows), lane l
// taking vectors l, l + 32, ...; a row of num_pieces pieces is addressed through the shared
// slot_index.h arithmetic. Out-of-range slots (refused by the caller unless it opted out of
// checking ids on the device, check_slots=False) never reach the cache: a gather zeroes their
// records, a scatter writes nothing.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>

#include "lumen/cuda_check.h"
#include "lumen/gather.h"

namespace lumen {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreadsPerBlock = 256;
constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarpSize;
constexpr int64_t kMaxBlocks = 4096;

template <int kVecBytes>
struct Vec;
template <>
struct Vec<16> {
  using Type = uint4;
};
template <>
struct Vec<8> {
  using Type = uint2;
};
template <>
struct Vec<4> {
  using Type = uint32_t;
};
template <>
struct Vec<1> {
  using Type = uint8_t;
};

// The lanes of one warp copy one row in kVecBytes accesses. Counts are 32-bit (rows are below
// 2 GiB, checked by validate_planes) to keep the index arithmetic cheap.
template <int kVecBytes, bool kGather>
__host__ __device__ __forceinline__ void move_row(uint8_t* row, uint8_t* record,
                                                  const PlaneDesc& plane, int lane) {
  using V = typename Vec<kVecBytes>::Type;
  const int vecs_per_piece = static_cast<int>(plane.piece_bytes / kVecBytes);
  if (plane.num_pieces == 1) {  // NHD rows, MLA rows, scale rows: one contiguous run
    V* cache_vecs = reinterpret_cast<V*>(row);
    V* record_vecs = reinterpret_cast<V*>(record);
    for (int v = lane; v < vecs_per_piece; v += kWarpSize) {
      if (kGather) {
        record_vecs[v] = cache_vecs[v];
      } else {
        cache_vecs[v] = record_vecs[v];
      }
    }
    return;
  }
  const int num_vecs = vecs_per_piece * static_cast<int>(plane.num_pieces);
  for (int v = lane; v < num_vecs; v += kWarpSize) {
    const int piece = v / vecs_per_piece;
    const int within = (v - piece * vecs_per_piece) * kVecBytes;
    V* cache_vec = reinterpret_cast<V*>(row + piece * plane.piece_stride + within);
    V* record_vec = reinterpret_cast<V*>(record + piece * plane.piece_bytes + within);
    if (kGather) {
      *record_vec = *cache_vec;
    } else {
      *cache_vec = *record_vec;
    }
  }
}

// What one lane of one warp does; the kernel runs it for every lane of its warps, and
// emulate_move_tokens_on_host for every lane of a grid on the CPU (the lanes write disjoint
// bytes, so running them one after another copies exactly what the GPU copies).
template <bool kGather>
__host__ __device__ __forceinline__ void move_tokens_lane(int64_t first_unit, int64_t num_warps,
                                                          int lane, uint8_t* __restrict__ records,
                                                          const PlaneDesc* __restrict__ planes,
                                                          int num_planes, int64_t record_bytes,
                                                          const int64_t* __restrict__ slot_ids,
                                                          int64_t num_tokens) {
  const int64_t num_units = num_tokens * num_planes;
  for (int64_t unit = first_unit; unit < num_units; unit += num_warps) {
    const int64_t token = unit / num_planes;
    const PlaneDesc plane = planes[unit - token * num_planes];
    const int64_t slot = slot_ids[token];
    uint8_t* record = records + token * record_bytes + plane.record_offset;
    if (!slot_in_range(plane, slot)) {
      // Never through the cache; a gather's record reads as zeros, whatever the placement
      // (staged records would otherwise carry stale staging bytes). Rare: bytewise is fine.
      if (kGather) {
        const int64_t bytes = plane.piece_bytes * plane.num_pieces;
        for (int64_t b = lane; b < bytes; b += kWarpSize) record[b] = 0;
      }
      continue;
    }
    uint8_t* row = reinterpret_cast<uint8_t*>(plane.base_address) + slot_row_offset(plane, slot);
    // The widest access this row allows (warp-uniform, so no divergence): fp8 scale rows or
    // odd record sizes fall back to narrower copies without slowing the other planes.
    const uint64_t bits = reinterpret_cast<uintptr_t>(row) | reinterpret_cast<uintptr_t>(record) |
                          static_cast<uint64_t>(plane.piece_stride) |
                          static_cast<uint64_t>(plane.piece_bytes);
    if ((bits & 15) == 0) {
      move_row<16, kGather>(row, record, plane, lane);
    } else if ((bits & 7) == 0) {
      move_row<8, kGather>(row, record, plane, lane);
    } else if ((bits & 3) == 0) {
      move_row<4, kGather>(row, record, plane, lane);
    } else {
      move_row<1, kGather>(row, record, plane, lane);
    }
  }
}

template <bool kGather>
__global__ void move_tokens_kernel(uint8_t* __restrict__ records,
                                   const PlaneDesc* __restrict__ planes, int num_planes,
                                   int64_t record_bytes, const int64_t* __restrict__ slot_ids,
                                   int64_t num_tokens) {
  move_tokens_lane<kGather>(
      static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize,
      static_cast<int64_t>(gridDim.x) * kWarpsPerBlock, threadIdx.x % kWarpSize, records, planes,
      num_planes, record_bytes, slot_ids, num_tokens);
}

int64_t grid_blocks(int64_t num_tokens, int num_planes) {
  int64_t num_units = num_tokens * num_planes;
  return std::min(kMaxBlocks, (num_units + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

template <bool kGather>
void launch(uint8_t* records, const PlaneDesc* planes_device, int num_planes, int64_t record_bytes,
            const int64_t* slot_ids, int64_t num_tokens, cudaStream_t stream) {
  int64_t blocks = grid_blocks(num_tokens, num_planes);
  move_tokens_kernel<kGather><<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(
      records, planes_device, num_planes, record_bytes, slot_ids, num_tokens);
  cuda_check_launch(kGather ? "gather_tokens_kernel" : "scatter_tokens_kernel");
}

void check_arguments(const void* records, const PlaneDesc* planes_host,
                     const PlaneDesc* planes_device, int num_planes, int64_t record_bytes,
                     const int64_t* slot_ids, int64_t num_tokens, RecordPlacement placement,
                     const uint8_t* staging) {
  if (num_tokens < 0) throw std::invalid_argument("num_tokens must be >= 0");
  validate_planes(planes_host, num_planes, record_bytes);
  if (records == nullptr || planes_device == nullptr || slot_ids == nullptr) {
    throw std::invalid_argument("null records, planes or slot_ids pointer");
  }
  if (placement == RecordPlacement::kStagedHost && staging == nullptr) {
    throw std::invalid_argument("staged placement needs a device staging buffer");
  }
}

// The device address under which the kernel reaches `records`.
uint8_t* device_view(const uint8_t* records, RecordPlacement placement, uint8_t* staging) {
  switch (placement) {
    case RecordPlacement::kDevice:
      return const_cast<uint8_t*>(records);
    case RecordPlacement::kMappedHost: {
      void* mapped = nullptr;
      cuda_check(cudaHostGetDevicePointer(&mapped, const_cast<uint8_t*>(records), 0),
                 "cudaHostGetDevicePointer (records must be pinned, mapped host memory)");
      return static_cast<uint8_t*>(mapped);
    }
    case RecordPlacement::kStagedHost:
      return staging;
  }
  throw std::invalid_argument("unknown record placement");
}

}  // namespace

void gather_tokens_cuda(uint8_t* records, const PlaneDesc* planes_host,
                        const PlaneDesc* planes_device, int num_planes, int64_t record_bytes,
                        const int64_t* slot_ids_device, int64_t num_tokens,
                        RecordPlacement placement, uint8_t* staging_device, CUstream_st* stream) {
  check_arguments(records, planes_host, planes_device, num_planes, record_bytes, slot_ids_device,
                  num_tokens, placement, staging_device);
  if (num_tokens == 0) return;
  uint8_t* target = device_view(records, placement, staging_device);
  launch<true>(target, planes_device, num_planes, record_bytes, slot_ids_device, num_tokens,
               stream);
  if (placement == RecordPlacement::kStagedHost) {
    cuda_check(cudaMemcpyAsync(records, staging_device, num_tokens * record_bytes,
                               cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync (device staging -> host records)");
  }
}

void scatter_tokens_cuda(const uint8_t* records, const PlaneDesc* planes_host,
                         const PlaneDesc* planes_device, int num_planes, int64_t record_bytes,
                         const int64_t* slot_ids_device, int64_t num_tokens,
                         RecordPlacement placement, uint8_t* staging_device, CUstream_st* stream) {
  check_arguments(records, planes_host, planes_device, num_planes, record_bytes, slot_ids_device,
                  num_tokens, placement, staging_device);
  if (num_tokens == 0) return;
  if (placement == RecordPlacement::kStagedHost) {
    cuda_check(cudaMemcpyAsync(staging_device, records, num_tokens * record_bytes,
                               cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync (host records -> device staging)");
  }
  uint8_t* source = device_view(records, placement, staging_device);
  launch<false>(source, planes_device, num_planes, record_bytes, slot_ids_device, num_tokens,
                stream);
}

void emulate_move_tokens_on_host(uint8_t* records, const PlaneDesc* planes, int num_planes,
                                 int64_t record_bytes, const int64_t* slot_ids, int64_t num_tokens,
                                 MoveDirection direction, int64_t num_blocks) {
  validate_planes(planes, num_planes, record_bytes);
  if (num_tokens <= 0) return;
  int64_t blocks = num_blocks > 0 ? num_blocks : grid_blocks(num_tokens, num_planes);
  int64_t num_warps = blocks * kWarpsPerBlock;
  for (int64_t warp = 0; warp < num_warps; ++warp) {
    for (int lane = 0; lane < kWarpSize; ++lane) {
      if (direction == MoveDirection::kGather) {
        move_tokens_lane<true>(warp, num_warps, lane, records, planes, num_planes, record_bytes,
                               slot_ids, num_tokens);
      } else {
        move_tokens_lane<false>(warp, num_warps, lane, records, planes, num_planes, record_bytes,
                                slot_ids, num_tokens);
      }
    }
  }
}

}  // namespace lumen
