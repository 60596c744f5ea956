// A chunk as a record names it: its content id and its decoded length.
#pragma once

#include <cstdint>

#include "core/chunk_id.h"

namespace ckptfs {

struct ChunkRef {
  ChunkId id;
  uint32_t raw_len = 0;
  bool operator==(const ChunkRef&) const = default;
};

}  // namespace ckptfs
