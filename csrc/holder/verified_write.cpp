// write_verified (lumen/holder/verified_write.h): a checker thread publishes how far the crcs
// have passed; the calling thread writes up to there and tells the checker how far it wrote,
// so the checker stays at most kLeadBatches ahead.
#include "lumen/holder/verified_write.h"

#include <algorithm>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "lumen/checksum.h"

namespace lumen::holder {
namespace {

constexpr uint64_t kBatchBytes = 1ull << 20;  // the checker publishes its progress per batch
constexpr uint64_t kLeadBatches = 4;          // and runs at most this many batches ahead

struct Progress {
  std::mutex mutex;
  std::condition_variable changed;
  uint64_t verified = 0;  // records [0, verified) passed their crcs
  uint64_t written = 0;   // records [0, written) are written
  bool done = false;      // the checker ended: all checked, or `verified` failed
  bool mismatch = false;
  bool stop = false;  // the writer failed: the checker ends at its next batch
};

// Checks records in batches of `batch`, waiting whenever it is more than `lead` ahead of the
// writes.
void check(uint64_t num_records, uint64_t record_bytes, const uint32_t* crcs,
           const RecordReader& read, uint64_t batch, uint64_t lead, uint8_t* scratch, Progress* p) {
  uint64_t i = 0;
  bool mismatch = false;
  while (i < num_records && !mismatch) {
    const uint64_t end = std::min(num_records, i + batch);
    for (; i < end; ++i) {
      if (crc32c(read(i, scratch), record_bytes) != crcs[i]) {
        mismatch = true;
        break;
      }
    }
    std::unique_lock<std::mutex> lock(p->mutex);
    p->verified = i;
    p->changed.notify_all();
    p->changed.wait(lock, [&] { return p->stop || mismatch || i - p->written <= lead; });
    if (p->stop) return;
  }
  std::lock_guard<std::mutex> lock(p->mutex);
  p->done = true;
  p->mismatch = mismatch;
  p->changed.notify_all();
}

}  // namespace

VerifiedWrite write_verified(uint64_t num_records, uint64_t record_bytes, const uint32_t* crcs,
                             const RecordReader& read, const RecordWriter& write) {
  VerifiedWrite out;
  if (num_records == 0) return out;
  // Whole groups of three per batch: a group of one or two is written by the slower loop.
  const uint64_t batch = 3 * std::max<uint64_t>(1, kBatchBytes / record_bytes / 3);
  std::vector<uint8_t> scratch(4 * record_bytes);  // three for the writer, one for the checker
  uint8_t* checker_scratch = scratch.data() + 3 * record_bytes;
  auto write_range = [&](uint64_t from, uint64_t to) {
    const uint8_t* group[3] = {};
    for (uint64_t i = from; i < to;) {
      const int count = static_cast<int>(std::min<uint64_t>(3, to - i));
      for (int t = 0; t < count; ++t) group[t] = read(i + t, scratch.data() + t * record_bytes);
      write(group, i, count);
      i += count;
    }
  };
  Progress p;
  std::thread checker;
  if (num_records * record_bytes >= kPipelineBytes) {
    try {
      checker = std::thread(check, num_records, record_bytes, crcs, std::cref(read), batch,
                            kLeadBatches * batch, checker_scratch, &p);
    } catch (const std::system_error&) {  // no thread to be had: checked here, then written
    }
  }
  if (!checker.joinable()) {
    check(num_records, record_bytes, crcs, read, batch, std::numeric_limits<uint64_t>::max(),
          checker_scratch, &p);
    write_range(0, p.verified);
    return {p.verified, p.mismatch};
  }
  uint64_t done = 0;
  try {
    while (true) {
      uint64_t upto = 0;
      bool finished = false;
      {
        std::unique_lock<std::mutex> lock(p.mutex);
        p.changed.wait(lock, [&] { return p.verified > done || p.done; });
        upto = p.verified;
        finished = p.done;
      }
      if (upto == done && finished) break;
      write_range(done, upto);
      done = upto;
      std::lock_guard<std::mutex> lock(p.mutex);
      p.written = done;
      p.changed.notify_all();
    }
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(p.mutex);
      p.stop = true;
      p.changed.notify_all();
    }
    checker.join();
    throw;
  }
  checker.join();
  out.written = done;
  out.crc_mismatch = p.mismatch;
  return out;
}

}  // namespace lumen::holder
