// One checkpoint's token records, logically one array of record_bytes-sized records, stored
// in ChunkArena chunks: record i is bytes [i * record_bytes, (i + 1) * record_bytes) of the
// concatenated chunks and may straddle two of them. Chunks never move once taken, so a
// network receive can land in place while later appends grow the array.
#pragma once
#include <cstdint>
#include <vector>

#include "lumen/holder/chunk_arena.h"
#include "lumen/transport/sink.h"

namespace lumen::holder {

class RecordChunks {
 public:
  RecordChunks() = default;
  explicit RecordChunks(uint32_t record_bytes) : record_bytes_(record_bytes) {}

  uint32_t record_bytes() const { return record_bytes_; }
  // Records that fit in the chunks taken so far.
  uint64_t capacity_tokens(const ChunkArena& arena) const;
  // Takes chunks until `tokens` records fit.
  void reserve(ChunkArena* arena, uint64_t tokens);
  // The memory of records [first, first + n) as pieces in record order (all reserved).
  void pieces(const ChunkArena& arena, uint64_t first, uint64_t n,
              std::vector<transport::MemoryPiece>* out) const;
  void copy_in(const ChunkArena& arena, uint64_t first, uint64_t n, const uint8_t* records);
  // Records [first, first + n) into `records`, split over num_threads threads.
  void copy_out(const ChunkArena& arena, uint64_t first, uint64_t n, uint8_t* records,
                int num_threads = 1) const;
  // Record i in one piece of memory: in place, or copied into scratch (record_bytes) when it
  // straddles two chunks.
  const uint8_t* record(const ChunkArena& arena, uint64_t i, uint8_t* scratch) const;
  // Gives back the chunks that hold nothing below `tokens` records into *detached, so writes
  // still in flight there cannot touch what is kept; a chunk shared with the kept prefix is
  // replaced by a copy of that prefix first.
  void detach_from(ChunkArena* arena, uint64_t tokens, std::vector<uint8_t*>* detached);
  void release(ChunkArena* arena);

 private:
  uint32_t record_bytes_ = 0;
  std::vector<uint8_t*> chunks_;
};

}  // namespace lumen::holder
