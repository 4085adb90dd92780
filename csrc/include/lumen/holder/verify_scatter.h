// The restore's inner loop: write token records into their slots while computing each
// record's crc32c, so the data is read once (a crc pass and then a scatter pass read it twice
// and run at half the speed). Three records are copied side by side: their crcs are three
// independent chains, which keeps the crc32 unit busy.
#pragma once
#include <cstdint>
#include <vector>

#include "lumen/slot_index.h"

namespace lumen::holder {

// The planes in record order when they tile [0, record_bytes) without gaps (so a record's
// crc can be chained row by row); empty when they do not, or the CPU has no crc32 instruction.
std::vector<int> fused_plane_order(const PlaneDesc* planes, int num_planes, int64_t record_bytes);

// For t < count (1..3): copies records[t] into slot slot_ids[t] of every plane (order from
// fused_plane_order) and sets crcs[t] to the record's crc32c. Ends with a store fence.
void scatter_with_crc(const uint8_t* const* records, const int64_t* slot_ids, int count,
                      const PlaneDesc* planes, const std::vector<int>& order, uint32_t* crcs);

}  // namespace lumen::holder
