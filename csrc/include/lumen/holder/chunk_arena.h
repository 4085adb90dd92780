// Host memory of a holder in fixed-size chunks. Chunks are carved from large anonymous
// mappings (slabs) that are populated once and, when pinning, page-locked once: page faults
// and cudaHostRegister are paid per slab, not per checkpoint. Freed chunks are reused warm
// (most recently freed first); a slab is unmapped when it is wholly free and more than
// `retain_bytes` would stay free without it. `reserve_bytes` are mapped (and populated) at
// construction and never unmapped, so a holder that reserves what it will hold pays no page
// fault while it receives. Not thread-safe: the owner serialises calls.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

namespace lumen::holder {

class ChunkArena {
 public:
  // chunk_bytes: a multiple of the page size; slab_bytes: a multiple of chunk_bytes.
  // std::invalid_argument otherwise. reserve_bytes: mapped now, whole slabs (std::bad_alloc
  // when they cannot be), and kept mapped.
  ChunkArena(uint64_t chunk_bytes, uint64_t slab_bytes, uint64_t retain_bytes, bool pinned,
             uint64_t reserve_bytes = 0);
  ~ChunkArena();
  ChunkArena(const ChunkArena&) = delete;
  ChunkArena& operator=(const ChunkArena&) = delete;

  // A chunk of chunk_bytes; std::bad_alloc when no slab can be mapped, std::runtime_error
  // when it cannot be pinned.
  uint8_t* take();
  void give(uint8_t* chunk);

  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint64_t mapped_bytes() const { return mapped_bytes_; }
  uint64_t free_bytes() const { return free_.size() * chunk_bytes_; }
  bool pinned() const { return pinned_; }

 private:
  struct Slab {
    uint64_t bytes = 0;
    uint64_t in_use = 0;  // chunks handed out
  };
  std::map<uint8_t*, Slab>::iterator slab_of(uint8_t* chunk);
  void map_slab();
  void unmap_slab(std::map<uint8_t*, Slab>::iterator it);

  uint64_t chunk_bytes_;
  uint64_t slab_bytes_;
  uint64_t retain_bytes_;
  bool pinned_;
  uint64_t mapped_bytes_ = 0;
  std::map<uint8_t*, Slab> slabs_;  // by base address
  std::vector<uint8_t*> free_;      // a stack: warm chunks first
};

}  // namespace lumen::holder
