// Verified restore of a checkpoint's records into a KV cache on a CUDA device, as one native
// pipeline (docs/streaming.md, "Restore"). The records go in groups of about kGroupBytes: the
// host checks a group's crcs (num_threads threads) while the device still copies and scatters
// the group before it, each group is copied host-to-device on the restorer's own stream
// (straight out of the store's chunks when they are pinned, else through two pinned bounce
// buffers) into one of two device staging buffers, and scattered into the cache by the gather
// kernels on the caller's stream, ordered by events. No record past the first bad crc is
// copied or written. The host waits once, at the end, for the last scatter: the store's lock
// is held until then, so no append, release or eviction touches the chunks being read.
#pragma once
#include <cstdint>
#include <memory>

#include "lumen/holder/chunk_arena.h"
#include "lumen/holder/record_chunks.h"
#include "lumen/slot_index.h"

namespace lumen::holder {

class CudaRestorer {
 public:
  static constexpr uint64_t kGroupBytes = 32ull << 20;

  virtual ~CudaRestorer() = default;
  virtual int device() const = 0;
  // Writes records [0, n) of `records` into slot_ids[0, n) of the cache `planes` (on this
  // restorer's device), stopping before the first record whose crc is not crcs[i]; returns how
  // many were written. `stream`: the caller's CUDA stream (0: the default stream); the scatters
  // are queued on it, and the call returns once they have run. slot_ids: host memory, in range
  // of every plane (checked by the caller). std::runtime_error on a CUDA failure (nothing is
  // left in flight then).
  virtual uint64_t restore(const RecordChunks& records, const ChunkArena& arena,
                           const uint32_t* crcs, uint64_t n, const PlaneDesc* planes,
                           int num_planes, const int64_t* slot_ids, uintptr_t stream,
                           int num_threads) = 0;
};

// A restorer for CUDA device `device`, its buffers grown on first use and kept. Throws
// std::runtime_error when this build has no CUDA or the device cannot be used.
std::unique_ptr<CudaRestorer> make_cuda_restorer(int device);

}  // namespace lumen::holder
