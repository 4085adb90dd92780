// Slot -> address arithmetic of a KV plane, shared by the CPU gather (gather.cpp), its tests
// (through the binding) and the CUDA kernels (gather.cu), so the index math the GPU runs is
// the one tested on the CPU.
//
// A plane holds one row per slot. slot = block_id * block_size + offset; the row of a slot
// starts at base + block_id * block_stride + offset * token_stride and is num_pieces pieces
// of piece_bytes, piece p at + p * piece_stride (HND rows are H strided pieces; contiguous
// rows are one piece). In a token record the row sits at record_offset.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define LUMEN_HOST_DEVICE __host__ __device__
#else
#define LUMEN_HOST_DEVICE
#endif

namespace lumen {

// Nine int64 fields, no padding: Python packs a layout as an int64 tensor [num_planes, 9].
struct PlaneDesc {
  int64_t base_address;  // address of the row of slot 0
  int64_t num_slots;     // num_blocks * block_size
  int64_t block_size;
  int64_t block_stride;  // bytes between blocks
  int64_t token_stride;  // bytes between the slots of one block
  int64_t piece_stride;  // bytes between the pieces of one row
  int64_t num_pieces;
  int64_t piece_bytes;
  int64_t record_offset;  // where the row starts inside a token record
};
static_assert(sizeof(PlaneDesc) == 9 * sizeof(int64_t), "PlaneDesc must be 9 packed int64");
constexpr int kPlaneDescFields = 9;

// Byte offset of the row of `slot` from the plane's base address.
LUMEN_HOST_DEVICE inline int64_t slot_row_offset(const PlaneDesc& plane, int64_t slot) {
  int64_t block_id = slot / plane.block_size;
  int64_t offset = slot - block_id * plane.block_size;
  return block_id * plane.block_stride + offset * plane.token_stride;
}

// Byte offset of piece `piece` of the row of `slot` from the plane's base address.
LUMEN_HOST_DEVICE inline int64_t slot_piece_offset(const PlaneDesc& plane, int64_t slot,
                                                   int64_t piece) {
  return slot_row_offset(plane, slot) + piece * plane.piece_stride;
}

LUMEN_HOST_DEVICE inline int64_t plane_row_bytes(const PlaneDesc& plane) {
  return plane.num_pieces * plane.piece_bytes;
}

LUMEN_HOST_DEVICE inline bool slot_in_range(const PlaneDesc& plane, int64_t slot) {
  return slot >= 0 && slot < plane.num_slots;
}

}  // namespace lumen
