// A bounded pool of reusable, page-aligned host buffers with explicit acquire/release.
// One anonymous mapping holds all buffers (so a caller can pin it with one registration);
// each buffer starts on a page boundary. Thread-safe.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

namespace lumen {

class StagingPool {
 public:
  // Throws std::invalid_argument for non-positive sizes or a pool whose bytes overflow int64,
  // std::runtime_error when the memory cannot be mapped.
  StagingPool(int64_t num_buffers, int64_t buffer_bytes);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // Waits of at least this long (about 31 years) never end.
  static constexpr double kForeverS = 1e9;

  // Index of a free buffer; waits up to timeout_s (< 0 or >= kForeverS: forever) and returns
  // -1 if none freed; std::invalid_argument for a nan timeout_s.
  int64_t acquire(double timeout_s);
  // Returns buffer `index` to the pool; std::invalid_argument if it is not held.
  void release(int64_t index);

  uint8_t* buffer(int64_t index) const { return arena_ + index * stride_bytes_; }
  uint8_t* arena() const { return arena_; }
  int64_t arena_bytes() const { return num_buffers_ * stride_bytes_; }
  int64_t num_buffers() const { return num_buffers_; }
  int64_t buffer_bytes() const { return buffer_bytes_; }
  int64_t stride_bytes() const { return stride_bytes_; }  // buffer_bytes rounded up to pages
  int64_t num_free() const;

 private:
  int64_t num_buffers_;
  int64_t buffer_bytes_;
  int64_t stride_bytes_;
  uint8_t* arena_;
  mutable std::mutex mutex_;
  std::condition_variable freed_;
  std::vector<int64_t> free_;  // indices of free buffers (LIFO: reuse warm buffers)
  std::vector<bool> held_;
};

}  // namespace lumen
