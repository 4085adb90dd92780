// StagingPool: one populated anonymous mapping split into page-aligned buffers.
#include "lumen/staging.h"

#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace lumen {

StagingPool::StagingPool(int64_t num_buffers, int64_t buffer_bytes)
    : num_buffers_(num_buffers), buffer_bytes_(buffer_bytes) {
  if (num_buffers < 1 || buffer_bytes < 1) {
    throw std::invalid_argument("StagingPool: num_buffers and buffer_bytes must be >= 1");
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  int64_t total_bytes = 0;
  if (buffer_bytes > INT64_MAX - page ||
      __builtin_mul_overflow(num_buffers, (buffer_bytes + page - 1) / page * page, &total_bytes)) {
    throw std::invalid_argument(
        "StagingPool: num_buffers x buffer_bytes (in whole pages) must fit in int64, got " +
        std::to_string(num_buffers) + " x " + std::to_string(buffer_bytes));
  }
  stride_bytes_ = (buffer_bytes + page - 1) / page * page;
  // Populated up front so the first copy into a buffer does not pay page faults.
  void* arena = mmap(nullptr, static_cast<size_t>(arena_bytes()), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (arena == MAP_FAILED) {
    throw std::runtime_error("StagingPool: mmap of " + std::to_string(arena_bytes()) +
                             " bytes failed: " + std::strerror(errno));
  }
  arena_ = static_cast<uint8_t*>(arena);
  held_.assign(static_cast<size_t>(num_buffers), false);
  for (int64_t i = num_buffers - 1; i >= 0; --i) free_.push_back(i);
}

StagingPool::~StagingPool() { munmap(arena_, static_cast<size_t>(arena_bytes())); }

int64_t StagingPool::acquire(double timeout_s) {
  if (std::isnan(timeout_s)) throw std::invalid_argument("StagingPool: timeout_s must not be nan");
  std::unique_lock<std::mutex> lock(mutex_);
  auto available = [this] { return !free_.empty(); };
  // Waits beyond kForeverS (inf included) are waits without end: converted to the clock's
  // ticks they would overflow and return at once.
  if (timeout_s < 0 || timeout_s >= kForeverS) {
    freed_.wait(lock, available);
  } else if (!freed_.wait_for(lock, std::chrono::duration<double>(timeout_s), available)) {
    return -1;
  }
  int64_t index = free_.back();
  free_.pop_back();
  held_[static_cast<size_t>(index)] = true;
  return index;
}

void StagingPool::release(int64_t index) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (index < 0 || index >= num_buffers_ || !held_[static_cast<size_t>(index)]) {
      throw std::invalid_argument("StagingPool: buffer " + std::to_string(index) + " is not held");
    }
    held_[static_cast<size_t>(index)] = false;
    free_.push_back(index);
  }
  freed_.notify_one();
}

int64_t StagingPool::num_free() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(free_.size());
}

}  // namespace lumen
