// A small persistent thread pool shared by the CPU kernels (gather, scatter, checksum).
// Header-only so that every module linking a kernel source gets it without extra sources.
// One job runs at a time (callers are serialised); the caller's thread is worker 0.
// Fork-safe: a forked child starts with an empty pool (its parent's workers do not exist there).
#pragma once
#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace lumen {

class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool pool;
    return pool;
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  // Runs fn(worker_index, num_workers) on num_workers threads and returns when all are done.
  // fn must not throw and must not call run() itself.
  void run(int num_workers, const std::function<void(int, int)>& fn) {
    if (num_workers <= 1) {
      fn(0, 1);
      return;
    }
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(workers_.size()) < num_workers - 1) {
        int index = static_cast<int>(workers_.size()) + 1;
        workers_.emplace_back([this, index] { worker_loop(index); });
      }
      job_ = &fn;
      job_workers_ = num_workers;
      pending_ = num_workers - 1;
      ++generation_;
    }
    wake_.notify_all();
    fn(0, num_workers);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  ThreadPool() {
    pthread_atfork(nullptr, nullptr, [] { instance().reset_in_child(); });
  }

  // In a child after fork(): only the forking thread exists, and any lock may have been held by
  // a thread that is gone. Start over with fresh primitives and no workers; the old thread
  // handles are leaked on purpose (destroying a joinable std::thread would terminate).
  void reset_in_child() {
    new (&job_mutex_) std::mutex;
    new (&mutex_) std::mutex;
    new (&wake_) std::condition_variable;
    new (&done_) std::condition_variable;
    new std::vector<std::thread>(std::move(workers_));
    workers_.clear();
    job_ = nullptr;
    job_workers_ = 0;
    pending_ = 0;
    stopping_ = false;
  }

  void worker_loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int, int)>* job = nullptr;
      int num_workers = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
        if (index >= job_workers_) continue;
        job = job_;
        num_workers = job_workers_;
      }
      (*job)(index, num_workers);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --pending_;
      }
      done_.notify_one();
    }
  }

  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* job_ = nullptr;
  int job_workers_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

// Number of hardware threads (at least 1): the default thread count of the CPU kernels.
inline int hardware_threads() {
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// Splits [0, num_items) into num_workers contiguous ranges; returns worker_index's range.
inline void split_range(int64_t num_items, int worker_index, int num_workers, int64_t* begin,
                        int64_t* end) {
  int64_t base = num_items / num_workers;
  int64_t extra = num_items % num_workers;
  *begin = worker_index * base + std::min<int64_t>(worker_index, extra);
  *end = *begin + base + (worker_index < extra ? 1 : 0);
}

}  // namespace lumen
