// The CUDA restore pipeline (lumen/holder/cuda_restore.h), or its absence in a build without
// CUDA.
#include "lumen/holder/cuda_restore.h"

#include <stdexcept>

#ifdef LUMEN_HOLDER_CUDA
#include <algorithm>
#include <atomic>
#include <vector>

#include "lumen/checksum.h"
#include "lumen/cuda_check.h"
#include "lumen/gather.h"
#include "lumen/thread_pool.h"
#include "lumen/transport/sink.h"
#endif

namespace lumen::holder {

#ifdef LUMEN_HOLDER_CUDA

namespace {

using transport::MemoryPiece;

// How many of records [first, first + n) pass their crcs (crcs indexed from record 0) before
// the first that does not, checked by num_threads threads. Host memory only.
uint64_t verified_prefix(const RecordChunks& records, const ChunkArena& arena, const uint32_t* crcs,
                         uint64_t first, uint64_t n, int num_threads) {
  const uint64_t record_bytes = records.record_bytes();
  std::atomic<uint64_t> first_bad{n};
  const int workers = static_cast<int>(std::clamp<uint64_t>(n, 1, std::max(num_threads, 1)));
  ThreadPool::instance().run(workers, [&](int worker, int num_workers) {
    // Contiguous ranges per worker; a worker stops at its first bad record, or once an
    // earlier one is known to be bad.
    const uint64_t begin = n * worker / num_workers;
    const uint64_t end = n * (worker + 1) / num_workers;
    std::vector<uint8_t> scratch(record_bytes);  // a record straddling two chunks
    for (uint64_t i = begin; i < end && i < first_bad.load(std::memory_order_relaxed); ++i) {
      const uint8_t* record = records.record(arena, first + i, scratch.data());
      if (crc32c(record, record_bytes) != crcs[first + i]) {
        uint64_t seen = first_bad.load();
        while (i < seen && !first_bad.compare_exchange_weak(seen, i)) {
        }
        return;
      }
    }
  });
  return first_bad.load();
}

// Device (or pinned host) memory of `T`, grown to a capacity and kept.
template <typename T, bool kPinnedHost>
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { free(); }
  T* get() const { return data_; }
  void free() {
    if (data_ == nullptr) return;
    if (kPinnedHost) {
      cudaFreeHost(data_);
    } else {
      cudaFree(data_);
    }
    data_ = nullptr;
    capacity_ = 0;
  }
  void reserve(uint64_t count, const char* what) {
    if (count <= capacity_) return;
    free();
    void* data = nullptr;
    if (kPinnedHost) {
      cuda_check(cudaHostAlloc(&data, count * sizeof(T), cudaHostAllocPortable), what);
    } else {
      cuda_check(cudaMalloc(&data, count * sizeof(T)), what);
    }
    data_ = static_cast<T*>(data);
    capacity_ = count;
  }

 private:
  T* data_ = nullptr;
  uint64_t capacity_ = 0;
};

class CudaRestorerImpl final : public CudaRestorer {
 public:
  explicit CudaRestorerImpl(int device) : device_(device) {
    DeviceScope scope(device_);
    try {
      cuda_check(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking),
                 "cudaStreamCreate (restore copies)");
      for (cudaEvent_t* event :
           {&copied_[0], &copied_[1], &scattered_[0], &scattered_[1], &done_}) {
        cuda_check(cudaEventCreateWithFlags(event, cudaEventDisableTiming), "cudaEventCreate");
      }
    } catch (...) {
      release();
      throw;
    }
  }

  ~CudaRestorerImpl() override {
    int previous = device_;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    release();
    cudaSetDevice(previous);
  }

  int device() const override { return device_; }

  uint64_t restore(const RecordChunks& records, const ChunkArena& arena, const uint32_t* crcs,
                   uint64_t n, const PlaneDesc* planes, int num_planes, const int64_t* slot_ids,
                   uintptr_t stream_handle, int num_threads) override {
    if (n == 0) return 0;
    DeviceScope scope(device_);
    const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
    const uint64_t record_bytes = records.record_bytes();
    const uint64_t group = std::max<uint64_t>(1, kGroupBytes / record_bytes);
    const bool pinned = arena.pinned();
    slots_host_.reserve(n, "cudaHostAlloc (restore slot ids)");
    slots_device_.reserve(n, "cudaMalloc (restore slot ids)");
    planes_host_.reserve(num_planes, "cudaHostAlloc (plane descriptors)");
    planes_device_.reserve(num_planes, "cudaMalloc (plane descriptors)");
    for (auto& staging : staging_) staging.reserve(group * record_bytes, "cudaMalloc (staging)");
    if (!pinned) {
      for (auto& bounce : bounce_) bounce.reserve(group * record_bytes, "cudaHostAlloc (bounce)");
    }
    // On a failure below, nothing queued may still read the chunks, the bounce buffers or the
    // staging a later restore refills once this returns.
    struct Drain {
      cudaStream_t copies, scatters;
      bool done = false;
      ~Drain() {
        if (done) return;
        cudaStreamSynchronize(copies);
        cudaStreamSynchronize(scatters);
      }
    };
    std::copy(slot_ids, slot_ids + n, slots_host_.get());
    std::copy(planes, planes + num_planes, planes_host_.get());
    uint64_t written = 0;
    {
      Drain drain{copy_stream_, stream};
      // The last restore's scatters ran before it returned; the copy stream is idle.
      cuda_check(cudaMemcpyAsync(slots_device_.get(), slots_host_.get(), n * sizeof(int64_t),
                                 cudaMemcpyHostToDevice, copy_stream_),
                 "cudaMemcpyAsync (slot ids)");
      cuda_check(
          cudaMemcpyAsync(planes_device_.get(), planes_host_.get(), num_planes * sizeof(PlaneDesc),
                          cudaMemcpyHostToDevice, copy_stream_),
          "cudaMemcpyAsync (plane descriptors)");
      std::vector<MemoryPiece> pieces;
      for (uint64_t g = 0; written < n; ++g) {
        const int b = static_cast<int>(g % 2);
        const uint64_t count = std::min(group, n - written);
        // On the host while the device still works on group g - 1.
        const uint64_t good = verified_prefix(records, arena, crcs, written, count, num_threads);
        if (good == 0) break;
        if (g >= 2) {  // staging[b] is free once group g - 2's scatter has read it
          cuda_check(cudaStreamWaitEvent(copy_stream_, scattered_[b], 0), "cudaStreamWaitEvent");
        }
        if (pinned) {  // DMA straight from the store's page-locked chunks
          pieces.clear();
          records.pieces(arena, written, good, &pieces);
          uint8_t* to = staging_[b].get();
          for (const MemoryPiece& piece : pieces) {
            cuda_check(
                cudaMemcpyAsync(to, piece.data, piece.bytes, cudaMemcpyHostToDevice, copy_stream_),
                "cudaMemcpyAsync (records)");
            to += piece.bytes;
          }
        } else {  // bounce[b] is free once group g - 2's copy has read it
          if (g >= 2) cuda_check(cudaEventSynchronize(copied_[b]), "cudaEventSynchronize");
          records.copy_out(arena, written, good, bounce_[b].get(), num_threads);
          cuda_check(cudaMemcpyAsync(staging_[b].get(), bounce_[b].get(), good * record_bytes,
                                     cudaMemcpyHostToDevice, copy_stream_),
                     "cudaMemcpyAsync (records)");
        }
        cuda_check(cudaEventRecord(copied_[b], copy_stream_), "cudaEventRecord");
        cuda_check(cudaStreamWaitEvent(stream, copied_[b], 0), "cudaStreamWaitEvent");
        scatter_tokens_cuda(staging_[b].get(), planes, planes_device_.get(), num_planes,
                            static_cast<int64_t>(record_bytes), slots_device_.get() + written,
                            static_cast<int64_t>(good), RecordPlacement::kDevice, nullptr, stream);
        cuda_check(cudaEventRecord(scattered_[b], stream), "cudaEventRecord");
        written += good;
        if (good < count) break;
      }
      // Only what this restore queued, not the rest of the caller's stream, is waited for (the
      // copy stream's too: a restore that stopped at its first record still uploaded slots).
      cuda_check(cudaEventRecord(done_, stream), "cudaEventRecord");
      cuda_check(cudaEventSynchronize(done_), "restore into the CUDA cache");
      cuda_check(cudaStreamSynchronize(copy_stream_), "restore copies");
      drain.done = true;
    }
    return written;
  }

 private:
  void release() {
    for (cudaEvent_t event : {copied_[0], copied_[1], scattered_[0], scattered_[1], done_}) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
    copy_stream_ = nullptr;
    for (int b = 0; b < 2; ++b) {
      staging_[b].free();
      bounce_[b].free();
    }
    slots_host_.free();
    slots_device_.free();
    planes_host_.free();
    planes_device_.free();
  }

  int device_;
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t copied_[2] = {nullptr, nullptr};     // group's records are in staging
  cudaEvent_t scattered_[2] = {nullptr, nullptr};  // group's records are in the cache
  cudaEvent_t done_ = nullptr;
  Buffer<uint8_t, false> staging_[2];
  Buffer<uint8_t, true> bounce_[2];
  Buffer<int64_t, true> slots_host_;
  Buffer<int64_t, false> slots_device_;
  Buffer<PlaneDesc, true> planes_host_;
  Buffer<PlaneDesc, false> planes_device_;
};

}  // namespace

std::unique_ptr<CudaRestorer> make_cuda_restorer(int device) {
  return std::make_unique<CudaRestorerImpl>(device);
}

#else

std::unique_ptr<CudaRestorer> make_cuda_restorer(int /*device*/) {
  throw std::runtime_error(
      "this build of lumen_core has no CUDA: a checkpoint cannot be restored into a CUDA cache");
}

#endif

}  // namespace lumen::holder
