// Page-locking host memory for a holder, so restores into GPU memory run at DMA speed
// (docs/streaming.md: pinned where a GPU is present). Built on the CUDA runtime when the
// package is built with CUDA (LUMEN_HOLDER_CUDA); without it there is nothing to pin for.
#pragma once
#include <cstddef>

namespace lumen::holder {

// True when this build can pin and a CUDA device is present.
bool can_pin_host_memory();
// Page-locks [data, data + bytes) for every device (portable); std::runtime_error on failure.
void pin_host_memory(void* data, size_t bytes);
// Undoes pin_host_memory; errors are ignored (the memory is being unmapped anyway).
void unpin_host_memory(void* data);

}  // namespace lumen::holder
