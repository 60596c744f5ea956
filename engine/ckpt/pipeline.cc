// The save pipeline (pipeline.h).
#include "ckpt/pipeline.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <span>

#include "core/content_cuts.h"

namespace ckptfs {
namespace {
// While the disk waits for the codec, only chunks estimated to save at least
// this fraction are compressed.
constexpr double kAdaptiveMinSaving = 0.25;

thread_local std::unique_ptr<ChunkEncoder> tls_encoder;
thread_local CodecOptions tls_encoder_options;

ChunkEncoder& EncoderFor(const CodecOptions& options) {
  if (!tls_encoder || tls_encoder_options.compression != options.compression ||
      tls_encoder_options.level != options.level || tls_encoder_options.min_saving != options.min_saving) {
    tls_encoder = std::make_unique<ChunkEncoder>(options);
    tls_encoder_options = options;
  }
  return *tls_encoder;
}
}  // namespace

SavePipeline::SavePipeline(PipelineSettings settings)
    : settings_(std::move(settings)),
      queued_(settings_.queued_chunks ? *settings_.queued_chunks : own_queued_),
      packs_(settings_.store, settings_.pack_size),
      max_inflight_(2 * settings_.pool->size() + 2),
      queue_limit_(2 * settings_.pool->size() + 1) {}

SavePipeline::~SavePipeline() { Shutdown(); }

Status SavePipeline::error() {
  std::lock_guard lock(mu_);
  return error_;
}

void SavePipeline::Fail(const Status& st) {
  std::lock_guard lock(mu_);
  if (error_.ok()) error_ = st;
}

PipelineStats SavePipeline::stats() {
  std::lock_guard lock(mu_);
  return stats_;
}

std::vector<uint64_t> SavePipeline::ChunkBounds(uint64_t global_start, uint64_t size) const {
  const uint64_t c = settings_.chunk_size;
  std::vector<uint64_t> bounds = {0};
  uint64_t pos = 0;
  while (pos < size) {
    uint64_t next_global = (global_start + pos) / c * c + c;
    pos = std::min(size, next_global - global_start);
    bounds.push_back(pos);
  }
  return bounds;
}

std::vector<uint64_t> SavePipeline::ContentBounds(std::span<const std::byte> data) const {
  std::vector<uint64_t> ends;
  ContentCuts(data, settings_.chunk_size / kBlobChunkFraction, ends);
  ends.insert(ends.begin(), 0);
  return ends;
}

void SavePipeline::Submit(Job job) {
  // Resident bytes (a copy staged for this save) are in memory already:
  // queueing all of them costs nothing, and lets PutShard return at once.
  const bool bounded = !job.resident;
  if (bounded) {
    std::unique_lock lock(mu_);
    inflight_cv_.wait(lock, [&] { return inflight_ < max_inflight_; });
    ++inflight_;
  }
  inflight_wg_.Add();
  if (job.shard_wg) job.shard_wg->Add();
  // Shared: the pool's tasks must be copyable, and a job owns a lease.
  settings_.pool->Submit([this, bounded, shared = std::make_shared<Job>(std::move(job))] {
    Job& job = *shared;
    Process(job);
    job.keep.reset();  // lent bytes go back to their source now, not when the task is freed
    job.owned.Reset();
    if (job.shard_wg) job.shard_wg->Done();
    if (bounded) {
      {
        std::lock_guard lock(mu_);
        --inflight_;
      }
      inflight_cv_.notify_one();
    }
    inflight_wg_.Done();
  });
}

namespace {
// Copies `from` into `to` (the same size) and returns the id of what was
// copied: each block is hashed from the copy while it is still in the cache,
// so the source is read once.
ChunkId CopyAndHash(std::span<const std::byte> from, std::span<std::byte> to) {
  constexpr size_t kBlock = 256 << 10;
  ChunkHasher hasher;
  for (size_t pos = 0; pos < from.size(); pos += kBlock) {
    const size_t n = std::min(kBlock, from.size() - pos);
    std::memcpy(to.data() + pos, from.data() + pos, n);
    hasher.Update(to.subspan(pos, n));
  }
  return hasher.Finish();
}
}  // namespace

Result<bool> SavePipeline::Known(const ChunkId& id) {
  {
    std::lock_guard lock(mu_);
    if (seen_.count(id)) {
      ++stats_.chunks_deduplicated;
      return true;
    }
  }
  auto known = settings_.lookup(id);
  if (known.ok()) {
    std::lock_guard lock(mu_);
    seen_.insert(id);
    ++stats_.chunks_deduplicated;
    return true;
  }
  if (!known.status().IsNotFound()) return known.status();
  return false;
}

void SavePipeline::Process(Job& job) {
  if (!error().ok()) return;
  const size_t size = job.data.size();
  job.slot->raw_len = static_cast<uint32_t>(size);
  const CodecOptions& codec = settings_.codec;
  // Adaptive: unless encoded chunks are queueing for the disk, the disk is
  // waiting for the codec; store this chunk raw rather than make it wait.
  // The disk keeps up when encoded chunks do not pile up in front of it.
  const bool disk_starving = settings_.adaptive && queued_.load() < static_cast<int64_t>(settings_.pool->size());
  // Even then, chunks that compress well (bf16 weights: about a third) are
  // worth the CPU; only the low-yield ones (fp32 moments) are passed raw.
  auto stored_raw = [&] {
    return codec.compression == Compression::kNone ||
           (disk_starving && EstimateSaving(job.data, job.dtype, codec.min_saving) < kAdaptiveMinSaving);
  };
  // A new chunk is stored under the id of exactly the bytes stored. Bytes
  // the source may still change (the caller's memory, a mapped file that
  // is rewritten) are copied, and the copy is hashed and encoded: a source
  // changed meanwhile gives a chunk of its new bytes under their own id,
  // never bytes that fail their id. Private bytes (read into a buffer of
  // the pipeline's, or lent as stable) are used in place.
  //
  // Where chunks have mostly been new lately, the copy comes first (the
  // source read once, each block hashed from the copy while in cache);
  // where they have mostly been stored already (a save after a save), the
  // source is hashed in place first and only a new chunk is copied, so
  // that deduplicated chunks cost a hash and no copy.
  ChunkId id;
  bool raw = false;
  Encoded enc;
  BufferPool::Lease copy;
  std::span<const std::byte> bytes = job.data;
  auto copy_out = [&] {
    raw = stored_raw();
    enc = Encoded{id, Codec::kRaw, static_cast<uint32_t>(size), settings_.buffers->Acquire(size)};
    std::span<std::byte> to = raw ? enc.buffer.first(size) : (copy = settings_.buffers->Acquire(size)).first(size);
    const ChunkId copied = CopyAndHash(job.data, to);
    bytes = to;
    job.keep.reset();  // lent source bytes go back now
    return copied;
  };
  const bool copy_first = !job.stable && recent_new_.load(std::memory_order_relaxed) >= kRecentNewHalf;
  if (copy_first) {
    id = copy_out();
  } else {
    // A chunk already stored (or claimed by another job of this pipeline)
    // is only referenced: its stored bytes were checked against its id by
    // whoever stored them, and this reference names what the source held
    // when it was hashed.
    id = ChunkId::Of(job.data);
  }
  auto known = Known(id);
  if (!known.ok()) return Fail(known.status());
  if (!*known && !job.stable && !copy_first) {
    const ChunkId hashed = id;
    id = copy_out();
    if (id != hashed) known = Known(id);  // the source changed since it was hashed
    if (!known.ok()) return Fail(known.status());
  }
  NoteNew(!*known);
  if (*known) {
    job.slot->id = id;
    return;
  }
  if (job.stable) {
    raw = stored_raw();
    enc = Encoded{id, Codec::kRaw, static_cast<uint32_t>(size), settings_.buffers->Acquire(size)};
  }
  enc.id = id;
  job.slot->id = id;
  {
    // Only ids of the bytes this job stores are claimed: another job that
    // finds the claim references a chunk that will be stored as it hashed.
    std::lock_guard lock(mu_);
    if (!seen_.insert(id).second) {
      ++stats_.chunks_deduplicated;
      return;
    }
  }
  if (raw) {
    if (job.stable) std::memcpy(enc.buffer.data(), bytes.data(), size);
    enc.size = size;
  } else {
    auto encoded = EncoderFor(codec).EncodeInto(bytes, job.dtype, enc.buffer.first(size));
    if (!encoded.ok()) return Fail(encoded.status());
    enc.codec = encoded->codec;
    enc.size = encoded->size;
  }
  // The encoded bytes are a copy: lent source bytes go back now, not after
  // a wait for the disk.
  job.keep.reset();
  copy.Reset();
  if (enc.size <= kBatchBytes) return AddSmall(std::move(enc));
  Enqueue(std::move(enc));
}

void SavePipeline::AddSmall(Encoded enc) {
  std::unique_lock lock(small_mu_);
  if (small_.buffer.capacity() - small_.size < enc.size && !small_.batch.empty()) {
    Encoded full = std::move(small_);
    small_ = Encoded{};
    lock.unlock();
    Enqueue(std::move(full));
    lock.lock();
  }
  if (small_.buffer.capacity() == 0) small_.buffer = settings_.buffers->Acquire(settings_.buffers->buffer_size());
  if (small_.buffer.capacity() - small_.size < enc.size) {  // only a chunk larger than a pooled buffer
    lock.unlock();
    return Enqueue(std::move(enc));
  }
  std::memcpy(small_.buffer.data() + small_.size, enc.buffer.data(), enc.size);
  small_.batch.push_back(Small{enc.id, enc.codec, enc.raw_len, small_.size, enc.size});
  small_.size += enc.size;
}

void SavePipeline::FlushSmall() {
  Encoded batch;
  {
    std::lock_guard lock(small_mu_);
    if (small_.batch.empty()) return;
    batch = std::move(small_);
    small_ = Encoded{};
  }
  Enqueue(std::move(batch));
}

void SavePipeline::NoteNew(bool is_new) {
  // A score of the last chunks: up for a new one, down for a stored one.
  int score = recent_new_.load(std::memory_order_relaxed);
  const int next = is_new ? std::min(score + 1, 2 * kRecentNewHalf) : std::max(score - 1, 0);
  recent_new_.compare_exchange_weak(score, next, std::memory_order_relaxed);
}

void SavePipeline::Enqueue(Encoded enc) {
  {
    std::unique_lock lock(queue_mu_);
    queue_cv_.wait(lock, [&] { return queue_.size() < queue_limit_ || stop_writer_; });
    queue_.push_back(std::move(enc));
    queued_.fetch_add(1);
  }
  queue_cv_.notify_all();
}

void SavePipeline::Start() {
  if (!writer_thread_.joinable()) writer_thread_ = std::thread([this] { WriterLoop(); });
}

void SavePipeline::StoreEncoded(const ChunkId& id, Codec codec, uint32_t raw_len, BufferPool::Lease bytes,
                                size_t size) {
  if (!error().ok()) return;
  Encoded enc{id, codec, raw_len, std::move(bytes)};
  enc.size = size;
  Enqueue(std::move(enc));
}

void SavePipeline::WriterLoop() {
  while (true) {
    Encoded enc;
    {
      std::unique_lock lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return !queue_.empty() || stop_writer_; });
      if (queue_.empty()) return;
      enc = std::move(queue_.front());
      queue_.pop_front();
      queued_.fetch_sub(1);
    }
    queue_cv_.notify_all();
    if (enc.batch.empty()) {
      Store(enc.id, enc.codec, enc.raw_len, enc.buffer.first(enc.size));
    } else {
      for (const Small& s : enc.batch) Store(s.id, s.codec, s.raw_len, enc.buffer.first(enc.size).subspan(s.offset, s.size));
    }
    enc.buffer.Reset();  // back to the pool for the next chunk
  }
}

void SavePipeline::Store(const ChunkId& id, Codec codec, uint32_t raw_len, std::span<const std::byte> bytes) {
  if (!error().ok()) return;  // drain without writing after an error
  auto loc = packs_.Add(id, codec, raw_len, bytes);
  if (!loc.ok()) return Fail(loc.status());
  std::lock_guard lock(mu_);
  stored_[id] = *loc;
  ++stats_.chunks_written;
  stats_.stored_bytes += bytes.size();
}

void SavePipeline::Shutdown() {
  inflight_wg_.Wait();
  FlushSmall();
  {
    std::lock_guard lock(queue_mu_);
    stop_writer_ = true;
  }
  queue_cv_.notify_all();
  if (writer_thread_.joinable()) writer_thread_.join();
}

Status SavePipeline::Stream(const std::vector<uint64_t>& bounds, DType dtype, ShardSource& source,
                            std::vector<ChunkRef>& chunks) {
  Start();
  chunks.resize(bounds.size() - 1);
  const std::byte* host = source.HostData();
  if (!host) source.PlanChunks(bounds);
  // A shard of one chunk in host memory is processed on the caller's
  // thread, which would only wait for a worker to do it: the hand-off there
  // and back (two wake-ups) costs more than hashing a small chunk, and a
  // state of many tiny tensors would pay it for every tensor.
  if (host && bounds.size() == 2) {
    Job job;
    job.dtype = dtype;
    job.slot = &chunks[0];
    job.data = {host, bounds[1]};
    Process(job);
    return error();
  }
  WaitGroup shard_wg;
  Status st;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    Job job;
    job.dtype = dtype;
    job.slot = &chunks[i];
    const uint64_t len = bounds[i + 1] - bounds[i];
    if (host) {
      job.data = {host + bounds[i], len};
      job.shard_wg = &shard_wg;
    } else {
      auto lent = source.Borrow(bounds[i], len);
      if (!lent.ok()) {
        st = lent.status();
        break;
      }
      if (lent->keep) {
        if (lent->bytes.size() != len) {
          st = Status::Internal("a shard source lent the wrong number of bytes");
          break;
        }
        job.data = lent->bytes;
        job.keep = std::move(lent->keep);
        job.stable = lent->stable;
        job.resident = lent->resident;
      } else {
        job.owned = settings_.buffers->Acquire(len);
        st = source.Read(bounds[i], job.owned.first(len));
        if (!st.ok()) break;
        job.data = job.owned.first(len);
        job.stable = true;
      }
      job.shard_wg = nullptr;
    }
    Submit(std::move(job));
  }
  // Zero-copy jobs read the caller's memory: wait until they are done with it.
  shard_wg.Wait();
  if (st.ok()) st = error();
  if (!st.ok()) {
    // Jobs already submitted still write into `chunks`, which the caller
    // drops on an error: let them finish first.
    inflight_wg_.Wait();
  }
  return st;
}

}  // namespace ckptfs
