// The local restore's pipeline: every record is checked against its crc before it is
// written, and the check of the next batch runs on a second thread while this batch is
// written (checking, then writing, one after the other ran at 0.36-0.39x memcpy).
#pragma once
#include <cstdint>
#include <functional>

namespace lumen::holder {

// Record `index`, read in place, or copied into scratch (record_bytes) when it is not
// contiguous where it is kept. Must be safe to call from two threads at once.
using RecordReader = std::function<const uint8_t*(uint64_t index, uint8_t* scratch)>;
// Writes `count` (1..3) records, verified, to the slots of positions first .. first + count.
using RecordWriter = std::function<void(const uint8_t* const* records, uint64_t first, int count)>;

struct VerifiedWrite {
  uint64_t written = 0;       // records [0, written) were verified and written
  bool crc_mismatch = false;  // record `written` failed its crc (nothing past it is written)
};

// Checks records [0, num_records) against crcs[i] in order and writes them in groups of three,
// none before its own check passed; stops at the first mismatch. A restore of at least
// kPipelineBytes checks on a helper thread, at most a few MiB ahead of the writes (what it read
// is still in the shared cache when it is written); a smaller one checks, then writes, batch
// by batch on the calling thread.
VerifiedWrite write_verified(uint64_t num_records, uint64_t record_bytes, const uint32_t* crcs,
                             const RecordReader& read, const RecordWriter& write);

constexpr uint64_t kPipelineBytes = 8ull << 20;

}  // namespace lumen::holder
