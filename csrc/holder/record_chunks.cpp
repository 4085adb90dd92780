// RecordChunks (lumen/holder/record_chunks.h).
#include "lumen/holder/record_chunks.h"

#include <algorithm>
#include <cstring>

#include "lumen/gather.h"

namespace lumen::holder {

using transport::MemoryPiece;

uint64_t RecordChunks::capacity_tokens(const ChunkArena& arena) const {
  return chunks_.size() * arena.chunk_bytes() / record_bytes_;
}

void RecordChunks::reserve(ChunkArena* arena, uint64_t tokens) {
  const uint64_t need = (tokens * record_bytes_ + arena->chunk_bytes() - 1) / arena->chunk_bytes();
  while (chunks_.size() < need) chunks_.push_back(arena->take());
}

void RecordChunks::pieces(const ChunkArena& arena, uint64_t first, uint64_t n,
                          std::vector<MemoryPiece>* out) const {
  const uint64_t chunk = arena.chunk_bytes();
  uint64_t begin = first * record_bytes_;
  const uint64_t end = (first + n) * record_bytes_;
  while (begin < end) {
    const uint64_t offset = begin % chunk;
    const uint64_t bytes = std::min(chunk - offset, end - begin);
    out->push_back({chunks_[begin / chunk] + offset, bytes});
    begin += bytes;
  }
}

void RecordChunks::copy_in(const ChunkArena& arena, uint64_t first, uint64_t n,
                           const uint8_t* records) {
  std::vector<MemoryPiece> parts;
  pieces(arena, first, n, &parts);
  for (const MemoryPiece& part : parts) {
    std::memcpy(part.data, records, part.bytes);
    records += part.bytes;
  }
}

void RecordChunks::copy_out(const ChunkArena& arena, uint64_t first, uint64_t n, uint8_t* records,
                            int num_threads) const {
  std::vector<MemoryPiece> parts;
  pieces(arena, first, n, &parts);
  for (const MemoryPiece& part : parts) {
    copy_bytes_cpu(records, part.data, static_cast<int64_t>(part.bytes), num_threads);
    records += part.bytes;
  }
}

const uint8_t* RecordChunks::record(const ChunkArena& arena, uint64_t i, uint8_t* scratch) const {
  const uint64_t chunk = arena.chunk_bytes();
  const uint64_t begin = i * record_bytes_;
  if (begin % chunk + record_bytes_ <= chunk) return chunks_[begin / chunk] + begin % chunk;
  copy_out(arena, i, 1, scratch);
  return scratch;
}

void RecordChunks::detach_from(ChunkArena* arena, uint64_t tokens,
                               std::vector<uint8_t*>* detached) {
  const uint64_t chunk = arena->chunk_bytes();
  const uint64_t kept_bytes = tokens * record_bytes_;
  size_t keep = (kept_bytes + chunk - 1) / chunk;
  if (keep > chunks_.size()) return;
  if (kept_bytes % chunk != 0) {
    uint8_t* copy = arena->take();
    std::memcpy(copy, chunks_[keep - 1], kept_bytes % chunk);
    detached->push_back(chunks_[keep - 1]);
    chunks_[keep - 1] = copy;
  }
  detached->insert(detached->end(), chunks_.begin() + static_cast<std::ptrdiff_t>(keep),
                   chunks_.end());
  chunks_.resize(keep);
}

void RecordChunks::release(ChunkArena* arena) {
  for (uint8_t* c : chunks_) arena->give(c);
  chunks_.clear();
}

}  // namespace lumen::holder
