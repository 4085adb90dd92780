// CRC-32C (Castagnoli) of token records.
#pragma once
#include <cstddef>
#include <cstdint>

namespace lumen {

// Standard CRC-32C (reflected polynomial 0x82F63B78, initial and final xor 0xFFFFFFFF):
// crc32c("123456789", 9) == 0xE3069283. Chainable: crc32c(b, nb, crc32c(a, na)) is the CRC of
// a followed by b. Uses the SSE4.2 crc32 instruction over three interleaved streams when the
// CPU has it (chosen at run time), a slicing-by-8 table otherwise.
uint32_t crc32c(const void* data, size_t num_bytes, uint32_t crc = 0);

// The table implementation, whatever the CPU supports (for tests and as the fallback).
uint32_t crc32c_portable(const void* data, size_t num_bytes, uint32_t crc = 0);

// True when crc32c() runs on the crc32 instruction.
bool crc32c_uses_hardware();

// out[i] = crc32c of records[i * record_bytes, (i + 1) * record_bytes) for i < num_records,
// split over num_threads threads (<= 1: the calling thread only).
void checksum_records(uint32_t* out, const uint8_t* records, int64_t num_records,
                      int64_t record_bytes, int num_threads);

}  // namespace lumen
