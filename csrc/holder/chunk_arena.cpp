// ChunkArena (lumen/holder/chunk_arena.h).
#include "lumen/holder/chunk_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <new>
#include <stdexcept>
#include <string>

#include "lumen/holder/host_pin.h"

namespace lumen::holder {

ChunkArena::ChunkArena(uint64_t chunk_bytes, uint64_t slab_bytes, uint64_t retain_bytes,
                       bool pinned, uint64_t reserve_bytes)
    : chunk_bytes_(chunk_bytes),
      slab_bytes_(slab_bytes),
      retain_bytes_(retain_bytes),
      pinned_(pinned) {
  const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (chunk_bytes == 0 || chunk_bytes % page != 0) {
    throw std::invalid_argument("chunk_bytes must be a positive multiple of " +
                                std::to_string(page) + ", got " + std::to_string(chunk_bytes));
  }
  if (slab_bytes == 0 || slab_bytes % chunk_bytes != 0) {
    throw std::invalid_argument("slab_bytes must be a positive multiple of chunk_bytes (" +
                                std::to_string(chunk_bytes) + "), got " +
                                std::to_string(slab_bytes));
  }
  while (mapped_bytes_ < reserve_bytes) map_slab();
  retain_bytes_ = std::max(retain_bytes_, mapped_bytes_);  // the reserve is never unmapped
}

ChunkArena::~ChunkArena() {
  while (!slabs_.empty()) unmap_slab(slabs_.begin());
}

void ChunkArena::map_slab() {
  // Populated at once: one bulk fault instead of one per page under a running receive.
  void* base = mmap(nullptr, slab_bytes_, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (base == MAP_FAILED) throw std::bad_alloc();
  if (pinned_) {
    try {
      pin_host_memory(base, slab_bytes_);
    } catch (...) {
      munmap(base, slab_bytes_);
      throw;
    }
  }
  auto* bytes = static_cast<uint8_t*>(base);
  slabs_.emplace(bytes, Slab{slab_bytes_, 0});
  mapped_bytes_ += slab_bytes_;
  // Pushed last-to-first so the slab is handed out in address order.
  for (uint64_t offset = slab_bytes_; offset > 0; offset -= chunk_bytes_) {
    free_.push_back(bytes + offset - chunk_bytes_);
  }
}

void ChunkArena::unmap_slab(std::map<uint8_t*, Slab>::iterator it) {
  uint8_t* base = it->first;
  const uint64_t bytes = it->second.bytes;
  free_.erase(std::remove_if(free_.begin(), free_.end(),
                             [&](uint8_t* c) { return c >= base && c < base + bytes; }),
              free_.end());
  if (pinned_) unpin_host_memory(base);
  munmap(base, bytes);
  mapped_bytes_ -= bytes;
  slabs_.erase(it);
}

std::map<uint8_t*, ChunkArena::Slab>::iterator ChunkArena::slab_of(uint8_t* chunk) {
  auto it = slabs_.upper_bound(chunk);
  if (it == slabs_.begin()) throw std::logic_error("ChunkArena: not a chunk of this arena");
  --it;
  if (chunk >= it->first + it->second.bytes) {
    throw std::logic_error("ChunkArena: not a chunk of this arena");
  }
  return it;
}

uint8_t* ChunkArena::take() {
  if (free_.empty()) map_slab();
  uint8_t* chunk = free_.back();
  free_.pop_back();
  slab_of(chunk)->second.in_use++;
  return chunk;
}

void ChunkArena::give(uint8_t* chunk) {
  auto it = slab_of(chunk);
  free_.push_back(chunk);
  if (--it->second.in_use == 0 && free_bytes() > retain_bytes_ + it->second.bytes) {
    unmap_slab(it);
  }
}

}  // namespace lumen::holder
