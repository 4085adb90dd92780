// The CUDA StepGather (lumen/holder/step_gather.h), or its absence in a build without CUDA.
#include <stdexcept>
#include <string>

#include "lumen/holder/step_gather.h"

#ifdef LUMEN_HOLDER_CUDA
#include <algorithm>
#include <mutex>
#include <utility>

#include "lumen/cuda_check.h"
#include "lumen/gather.h"
#endif

namespace lumen::holder {

#ifdef LUMEN_HOLDER_CUDA

namespace {

class CudaStepGather final : public StepGather {
 public:
  CudaStepGather(std::vector<PlaneDesc> planes, int64_t record_bytes, int device, uint8_t* staging,
                 int64_t staging_bytes, int64_t max_tokens)
      : planes_(std::move(planes)),
        record_bytes_(record_bytes),
        device_(device),
        staging_(staging),
        max_tokens_(max_tokens) {
    validate_planes(planes_.data(), static_cast<int>(planes_.size()), record_bytes_);
    if (max_tokens < 1) throw std::invalid_argument("max_tokens must be >= 1");
    DeviceScope scope(device_);
    try {
      cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
      const size_t plane_bytes = planes_.size() * sizeof(PlaneDesc);
      cuda_check(cudaMalloc(reinterpret_cast<void**>(&planes_device_), plane_bytes),
                 "cudaMalloc (plane descriptors)");
      cuda_check(cudaMemcpy(planes_device_, planes_.data(), plane_bytes, cudaMemcpyHostToDevice),
                 "cudaMemcpy (plane descriptors)");
      const size_t slot_bytes = static_cast<size_t>(max_tokens) * sizeof(int64_t);
      cuda_check(
          cudaHostAlloc(reinterpret_cast<void**>(&slots_host_), slot_bytes, cudaHostAllocPortable),
          "cudaHostAlloc (slot ids)");
      cuda_check(cudaMalloc(reinterpret_cast<void**>(&slots_device_), slot_bytes),
                 "cudaMalloc (slot ids)");
      cuda_check(cudaMalloc(reinterpret_cast<void**>(&staging_device_),
                            static_cast<size_t>(max_tokens) * record_bytes_),
                 "cudaMalloc (device staging)");
      // Page-locked so the copy out of device staging is one DMA at full speed.
      cuda_check(
          cudaHostRegister(staging_, static_cast<size_t>(staging_bytes), cudaHostRegisterPortable),
          "cudaHostRegister (staging buffers)");
      staging_registered_ = true;
    } catch (...) {
      release_all();
      throw;
    }
  }

  ~CudaStepGather() override {
    int previous = device_;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    release_all();
    cudaSetDevice(previous);
  }

  uint64_t mark(uintptr_t engine_stream) override {
    DeviceScope scope(device_);
    cudaEvent_t event = take_event();
    const cudaError_t status =
        cudaEventRecord(event, reinterpret_cast<cudaStream_t>(engine_stream));
    if (status != cudaSuccess) {
      give_event(event);
      cuda_check(status, "cudaEventRecord (on the engine's stream)");
    }
    return reinterpret_cast<uint64_t>(event);
  }

  void gather(uint8_t* records, const int64_t* slot_ids, int64_t num_tokens,
              uint64_t mark) override {
    cudaEvent_t event = reinterpret_cast<cudaEvent_t>(mark);
    struct GiveBack {  // the mark is consumed whatever happens
      CudaStepGather* self;
      cudaEvent_t event;
      ~GiveBack() {
        if (event != nullptr) self->give_event(event);
      }
    } give_back{this, event};
    if (num_tokens == 0) return;
    if (num_tokens > max_tokens_) {
      throw std::invalid_argument("num_tokens " + std::to_string(num_tokens) +
                                  " exceeds the staging capacity of " +
                                  std::to_string(max_tokens_) + " records");
    }
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    std::copy(slot_ids, slot_ids + num_tokens, slots_host_);
    cuda_check(cudaMemcpyAsync(slots_device_, slots_host_,
                               static_cast<size_t>(num_tokens) * sizeof(int64_t),
                               cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync (slot ids)");
    if (event != nullptr) {
      cuda_check(cudaStreamWaitEvent(stream_, event, 0), "cudaStreamWaitEvent (engine's step)");
    }
    gather_tokens_cuda(records, planes_.data(), planes_device_, static_cast<int>(planes_.size()),
                       record_bytes_, slots_device_, num_tokens, RecordPlacement::kStagedHost,
                       staging_device_, stream_);
    cuda_check(cudaStreamSynchronize(stream_), "gather of a step on the streamer's stream");
  }

 private:
  cudaEvent_t take_event() {
    {
      std::lock_guard<std::mutex> lock(events_mutex_);
      if (!free_events_.empty()) {
        cudaEvent_t event = free_events_.back();
        free_events_.pop_back();
        return event;
      }
    }
    cudaEvent_t event = nullptr;
    cuda_check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    std::lock_guard<std::mutex> lock(events_mutex_);
    all_events_.push_back(event);
    return event;
  }

  void give_event(cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(events_mutex_);
    free_events_.push_back(event);
  }

  void release_all() {
    for (cudaEvent_t event : all_events_) cudaEventDestroy(event);
    all_events_.clear();
    free_events_.clear();
    if (staging_registered_) cudaHostUnregister(staging_);
    staging_registered_ = false;
    cudaFree(staging_device_);
    cudaFree(slots_device_);
    cudaFreeHost(slots_host_);
    cudaFree(planes_device_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    staging_device_ = nullptr;
    slots_device_ = nullptr;
    slots_host_ = nullptr;
    planes_device_ = nullptr;
    stream_ = nullptr;
  }

  std::vector<PlaneDesc> planes_;
  int64_t record_bytes_;
  int device_;
  uint8_t* staging_;
  int64_t max_tokens_;
  bool staging_registered_ = false;
  cudaStream_t stream_ = nullptr;
  PlaneDesc* planes_device_ = nullptr;
  int64_t* slots_host_ = nullptr;
  int64_t* slots_device_ = nullptr;
  uint8_t* staging_device_ = nullptr;
  std::mutex events_mutex_;
  std::vector<cudaEvent_t> all_events_;   // every event made, destroyed with the gather
  std::vector<cudaEvent_t> free_events_;  // recorded events already waited for
};

}  // namespace

std::unique_ptr<StepGather> make_cuda_step_gather(std::vector<PlaneDesc> planes,
                                                  int64_t record_bytes, int device,
                                                  uint8_t* staging, int64_t staging_bytes,
                                                  int64_t max_tokens) {
  return std::make_unique<CudaStepGather>(std::move(planes), record_bytes, device, staging,
                                          staging_bytes, max_tokens);
}

bool cuda_step_gather_built() { return true; }

#else

std::unique_ptr<StepGather> make_cuda_step_gather(std::vector<PlaneDesc> /*planes*/,
                                                  int64_t /*record_bytes*/, int /*device*/,
                                                  uint8_t* /*staging*/, int64_t /*staging_bytes*/,
                                                  int64_t /*max_tokens*/) {
  throw std::runtime_error(
      "this build of lumen_core has no CUDA: the streamer cannot read a CUDA KV cache");
}

bool cuda_step_gather_built() { return false; }

#endif

}  // namespace lumen::holder
