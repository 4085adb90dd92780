// The CPU StepGather (lumen/holder/step_gather.h).
#include "lumen/holder/step_gather.h"

#include <utility>

#include "lumen/gather.h"

namespace lumen::holder {
namespace {

class CpuStepGather final : public StepGather {
 public:
  CpuStepGather(std::vector<PlaneDesc> planes, int64_t record_bytes, int num_threads)
      : planes_(std::move(planes)), record_bytes_(record_bytes), num_threads_(num_threads) {}

  uint64_t mark(uintptr_t /*engine_stream*/) override { return 0; }

  void gather(uint8_t* records, const int64_t* slot_ids, int64_t num_tokens,
              uint64_t /*mark*/) override {
    gather_tokens_cpu(records, planes_.data(), static_cast<int>(planes_.size()), record_bytes_,
                      slot_ids, num_tokens, num_threads_);
  }

 private:
  std::vector<PlaneDesc> planes_;
  int64_t record_bytes_;
  int num_threads_;
};

}  // namespace

std::unique_ptr<StepGather> make_cpu_step_gather(std::vector<PlaneDesc> planes,
                                                 int64_t record_bytes, int num_threads) {
  return std::make_unique<CpuStepGather>(std::move(planes), record_bytes, num_threads);
}

}  // namespace lumen::holder
