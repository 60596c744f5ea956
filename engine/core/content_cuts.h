// Content-defined chunk boundaries: where a chunk ends depends on the bytes
// around the cut, not on its offset, so bytes that did not change keep
// their chunks (and their ids) when bytes before them are inserted or
// removed. A gear rolling hash (one table lookup, a shift and an add per
// byte; each cut depends on the 64 bytes before it) cuts where its top
// log2(target) bits are zero, with no chunk under target/8 or over
// 2 x target bytes but the last (the scheme of FastCDC and Hugging Face's
// Xet store).
//
// Blobs are chunked this way (docs/FORMAT.md, "Chunks"); tensors are not,
// since their chunks follow the tensor's own elements.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace ckptfs {

// Appends the end offset of each chunk of `data` to `ends` (cleared
// first): increasing, the last one data.size(); nothing for empty data.
// target is rounded down to a power of two and must be at least 64.
void ContentCuts(std::span<const std::byte> data, size_t target, std::vector<uint64_t>& ends);

// The most bytes of one chunk for a target (2 x the target's power of two).
size_t ContentCutsMaxChunk(size_t target);

}  // namespace ckptfs
