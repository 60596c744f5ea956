// Statistics of a checkpoint's tensors, in one streaming pass each.
#include <cmath>
#include <limits>

#include "ckpt/repository.h"
#include "core/float_convert.h"

namespace ckptfs {

Result<std::vector<TensorStats>> Repository::Stats(const std::string& name, const std::vector<std::string>& tensors,
                                                   const ProgressFn& progress) {
  CKPT_ASSIGN_OR_RETURN(auto reader, OpenCheckpoint(name));
  std::vector<const TensorRecord*> chosen;
  if (tensors.empty()) {
    for (const auto& t : reader->tensors()) chosen.push_back(&t);
  } else {
    for (const auto& n : tensors) {
      CKPT_ASSIGN_OR_RETURN(const TensorRecord* t, reader->GetTensor(n));
      chosen.push_back(t);
    }
  }
  uint64_t total = 0, done = 0;
  for (const auto* t : chosen) total += t->ByteSize();
  constexpr uint64_t kPiece = 4 << 20;  // bytes read at a time: memory stays flat
  std::vector<std::byte> buf;
  std::vector<TensorStats> out;
  for (const TensorRecord* t : chosen) {
    TensorStats s;
    s.name = t->name;
    s.dtype = t->dtype;
    s.elements = NumElements(t->shape);
    const uint64_t w = DTypeSize(t->dtype), size = t->ByteSize();
    // Welford's running mean and sum of squared deviations over the finite
    // elements: stable where sums of squares would cancel.
    double mean = 0, m2 = 0, sum_sq = 0;
    uint64_t finite = 0;
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (uint64_t off = 0; off < size; off += kPiece) {
      const uint64_t n = std::min(kPiece, size - off);
      buf.resize(n);
      CKPT_RETURN_IF_ERROR(reader->ReadBytes(*t, off, buf));
      for (uint64_t i = 0; i < n / w; ++i) {
        const double v = ElementAsDouble(t->dtype, buf.data(), i);
        if (std::isnan(v)) {
          ++s.nan_count;
          continue;
        }
        if (std::isinf(v)) {
          ++s.inf_count;
          continue;
        }
        if (v == 0) ++s.zero_count;
        ++finite;
        lo = std::min(lo, v);
        hi = std::max(hi, v);
        const double delta = v - mean;
        mean += delta / static_cast<double>(finite);
        m2 += delta * (v - mean);
        sum_sq += v * v;
      }
      done += n;
      if (progress) progress(done, total);
    }
    if (finite > 0) {
      s.min = lo;
      s.max = hi;
      s.mean = mean;
      s.std = std::sqrt(m2 / static_cast<double>(finite));
    }
    s.l2_norm = std::sqrt(sum_sq);
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace ckptfs
