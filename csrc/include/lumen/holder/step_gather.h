// How the streamer reads a step's token records out of the engine's KV cache (docs/streaming.md).
// On the CPU, a multithreaded gather on the streamer thread. On a CUDA device, the gather
// kernel on the streamer's own stream: save_step records an event on the engine's stream
// (the step's KV was written by work queued there), the streamer's stream waits for it, the
// kernel writes into device staging and one cudaMemcpyAsync moves the records into the pinned
// staging buffer; the call returns when they are there. The engine's stream never waits.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "lumen/slot_index.h"

namespace lumen::holder {

class StepGather {
 public:
  virtual ~StepGather() = default;
  // Engine thread (save_step): where the engine's work stands on `engine_stream` (a CUDA
  // stream handle, 0 for the default stream; ignored on the CPU). Returns a mark that exactly
  // one later gather() consumes.
  virtual uint64_t mark(uintptr_t engine_stream) = 0;
  // Streamer thread: records[t, :] = the rows of slot_ids[t] (already in range), read after
  // the engine's work up to `mark`; returns when the records are in host memory. num_tokens
  // may be 0 (the mark is consumed). std::runtime_error on a CUDA failure.
  virtual void gather(uint8_t* records, const int64_t* slot_ids, int64_t num_tokens,
                      uint64_t mark) = 0;
};

// Gathers from a CPU cache with num_threads threads.
std::unique_ptr<StepGather> make_cpu_step_gather(std::vector<PlaneDesc> planes,
                                                 int64_t record_bytes, int num_threads);

// Gathers from a cache on CUDA device `device` into records inside [staging, staging +
// staging_bytes) (pinned here; at most max_tokens per call). std::runtime_error when this
// build has no CUDA or the device cannot be used.
std::unique_ptr<StepGather> make_cuda_step_gather(std::vector<PlaneDesc> planes,
                                                  int64_t record_bytes, int device,
                                                  uint8_t* staging, int64_t staging_bytes,
                                                  int64_t max_tokens);

// True when this build can gather from a CUDA cache (make_cuda_step_gather may succeed).
bool cuda_step_gather_built();

}  // namespace lumen::holder
