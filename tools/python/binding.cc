// ckptfs._core: the C++ side of the Python package. It knows raw memory
// (address, byte count, device) and the engine's types; the Python side
// (ckptfs/__init__.py) turns torch tensors and NumPy arrays into those.
//
// Every call that does I/O or waits releases the GIL. Engine errors become
// exceptions whose text is the CLI's one-line message; the class follows the
// status code (ckptfs.NotFoundError is also a LookupError, InvalidArgument a
// ValueError, I/O errors an OSError).
#include <fcntl.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/collective.h"
#include "ckpt/collective_plan.h"
#include "ckpt/describe.h"
#include "ckpt/import.h"
#include "ckpt/repository.h"
#include "ckpt/tiers.h"
#include "core/fork.h"
#include "core/version.h"
#include "core/chunk_id.h"
#include "core/dtype.h"
#include "core/region.h"
#include "io/mapped_file.h"
#include "staging.h"

namespace py = pybind11;

namespace ckptfs::python {
namespace {

// ---- errors --------------------------------------------------------------------

struct StatusError {
  Status status;
};

PyObject* g_error = nullptr;
PyObject* g_not_found = nullptr;
PyObject* g_invalid = nullptr;
PyObject* g_exists = nullptr;
PyObject* g_corruption = nullptr;
PyObject* g_io = nullptr;
PyObject* g_unsupported = nullptr;
PyObject* g_collective = nullptr;

PyObject* ErrorClassFor(StatusCode code) {
  switch (code) {
    case StatusCode::kNotFound: return g_not_found;
    case StatusCode::kInvalidArgument: return g_invalid;
    case StatusCode::kAlreadyExists: return g_exists;
    case StatusCode::kCorruption: return g_corruption;
    case StatusCode::kIOError:
    case StatusCode::kResourceExhausted: return g_io;
    case StatusCode::kUnsupported: return g_unsupported;
    default: return g_error;
  }
}

PyObject* NewErrorClass(py::module_& m, const char* name, PyObject* base, PyObject* builtin, const char* doc) {
  // Two statements, not ?: — pybind11 3 gives make_tuple a type per arity.
  py::tuple bases = py::make_tuple(py::handle(base));
  if (builtin) bases = py::make_tuple(py::handle(base), py::handle(builtin));
  std::string qualified = std::string("ckptfs.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (!cls) throw py::error_already_set();
  m.add_object(name, py::handle(cls));
  return cls;
}

void Check(const Status& st) {
  if (!st.ok()) throw StatusError{st};
}

template <typename T>
T Value(Result<T> r) {
  if (!r.ok()) throw StatusError{r.status()};
  return std::move(*r);
}

// ---- conversions -----------------------------------------------------------------

DType ParseDTypeOrThrow(const std::string& name) {
  auto d = ParseDType(name);
  if (!d) throw StatusError{Status::InvalidArgument("unknown dtype '" + name + "'")};
  return *d;
}

// A region as the Python side describes it: "whole", "box" (offsets; the
// lengths are the local shape) or "flat" (start; the length is the local
// element count).
Region MakeRegion(const Shape& global, const std::string& kind, const std::vector<uint64_t>& local_shape,
                  const std::vector<uint64_t>& offsets, uint64_t start) {
  if (kind == "whole") return Region::OfBox(FullBox(global));
  if (kind == "box") return Region::OfBox(Box{offsets, local_shape});
  if (kind == "flat") {
    const uint64_t n = Value(CheckedNumElements(local_shape));
    return Region::OfFlat(start, start + n);
  }
  throw StatusError{Status::InvalidArgument("unknown region kind '" + kind + "'")};
}

py::object JsonToPython(const Json& j) {
  // Imported per call (a dictionary lookup once loaded): a static py::object
  // would be released after the interpreter is gone.
  return py::module_::import("json").attr("loads")(j.Dump());
}

std::span<std::byte> HostSpan(uintptr_t address, uint64_t bytes) {
  if (bytes == 0) return {};
  if (address == 0) throw StatusError{Status::InvalidArgument("null data pointer for a non-empty tensor")};
  return {reinterpret_cast<std::byte*>(address), static_cast<size_t>(bytes)};
}

// Device memory is only an address to the engine: the binding, which knows
// the tensor's size, checks that it is exactly the region's bytes (host
// memory is checked by the engine's own size checks).
void CheckDeviceMemory(const std::string& name, const Shape& shape, const Region& region, DType dtype,
                       uint64_t bytes) {
  Check(ValidateRegion(shape, region).WithContext("tensor '" + name + "'"));
  const uint64_t need = region.NumElements() * DTypeSize(dtype);
  if (bytes != need) {
    throw StatusError{Status::InvalidArgument("tensor '" + name + "': the device memory holds " +
                                              std::to_string(bytes) + " bytes, region " + region.ToString() +
                                              " needs " + std::to_string(need))};
  }
}

// ---- host staging: private copies for asynchronous saves ----

// Memory for staged copies, kept from one asynchronous save for the next.
// A first touch of fresh memory is what a copy costs most on a virtual
// machine (two to four times the copy itself, even in huge pages), and a
// training job saves the same tensors every few steps: the buffers its
// last save freed serve the next one. The cache keeps at most the most
// bytes one save staged (NoteSave, raised as a save stages), so it holds
// one save's worth at most; Release() frees them all.
class StagingCache {
 public:
  static StagingCache& Get() {
    static StagingCache* cache = new StagingCache;  // never destroyed: leases may outlive exit
    return *cache;
  }
  // A buffer of at least `size` bytes: a kept one of at most twice the
  // size when there is one, else a new one (a mapping advised as huge pages
  // from 2 MiB on).
  BufferPool::Lease Take(size_t size) {
    {
      std::lock_guard lock(mu_);
      auto it = kept_.lower_bound(size);
      if (it != kept_.end() && it->first <= 2 * size) {
        BufferPool::Lease lease = std::move(it->second);
        kept_bytes_ -= it->first;
        kept_.erase(it);
        return lease;
      }
    }
    return pool_.Acquire(size);
  }
  // Keeps a buffer a staged copy used, while the kept bytes stay within
  // what one save staged; frees it otherwise.
  void Give(BufferPool::Lease lease) {
    BufferPool::Lease dropped;  // freed outside the lock
    std::lock_guard lock(mu_);
    if (kept_bytes_ + lease.capacity() > limit_bytes_) {
      dropped = std::move(lease);
      return;
    }
    kept_bytes_ += lease.capacity();
    const size_t capacity = lease.capacity();
    kept_.emplace(capacity, std::move(lease));
  }
  // A save has staged `bytes` so far: the cache may keep that much for the
  // next one (the largest save's, when they differ).
  void NoteSave(uint64_t bytes) {
    std::lock_guard lock(mu_);
    limit_bytes_ = std::max(limit_bytes_, bytes);
  }
  // Frees every kept buffer, and keeps none until the next save; returns
  // the bytes freed.
  uint64_t Release() {
    std::multimap<size_t, BufferPool::Lease> dropped;
    std::lock_guard lock(mu_);
    dropped.swap(kept_);
    const uint64_t bytes = kept_bytes_;
    kept_bytes_ = 0;
    limit_bytes_ = 0;
    return bytes;
  }

 private:
  BufferPool pool_{4096, 0};  // every request is larger: a buffer of its own each
  std::mutex mu_;
  std::multimap<size_t, BufferPool::Lease> kept_;  // by capacity
  uint64_t kept_bytes_ = 0;
  uint64_t limit_bytes_ = 0;  // the most bytes one save staged (NoteSave)
};

// A private copy of bytes being saved. While one is alive it is known by its
// address, so that a put of bytes inside it (a tensor of a state dict that
// StorageWriter.stage copied) lends them to the writer as stable, and the
// writer does not copy each chunk again. Its memory goes back to the
// StagingCache when the last chunk using it is encoded.
class StagedCopy {
 public:
  // Shares of 256 KiB and more are staged; smaller ones are hashed and
  // encoded at once, on the caller's thread, which costs less than a hand-off.
  static constexpr uint64_t kMinBytes = 256 << 10;

  // Memory for `size` bytes (StagingCache), registered; content unspecified.
  static std::shared_ptr<StagedCopy> Make(size_t size) {
    auto copy = std::shared_ptr<StagedCopy>(new StagedCopy(StagingCache::Get().Take(size), size));
    std::lock_guard lock(mu_);
    live_[reinterpret_cast<uintptr_t>(copy->data())] = copy;
    return copy;
  }
  ~StagedCopy() {
    {
      std::lock_guard lock(mu_);
      live_.erase(reinterpret_cast<uintptr_t>(data()));
    }
    StagingCache::Get().Give(std::move(lease_));
  }
  StagedCopy(const StagedCopy&) = delete;
  StagedCopy& operator=(const StagedCopy&) = delete;

  // The live copy that holds all of [address, address + bytes), if any.
  static std::shared_ptr<StagedCopy> Holding(uintptr_t address, uint64_t bytes) {
    std::lock_guard lock(mu_);
    auto it = live_.upper_bound(address);
    if (it == live_.begin()) return nullptr;
    --it;
    std::shared_ptr<StagedCopy> copy = it->second.lock();
    if (!copy || address - it->first > copy->size_ || bytes > copy->size_ - (address - it->first)) return nullptr;
    return copy;
  }

  std::byte* data() const { return lease_.data(); }
  size_t size() const { return size_; }

 private:
  StagedCopy(BufferPool::Lease lease, size_t size) : lease_(std::move(lease)), size_(size) {}
  BufferPool::Lease lease_;
  size_t size_;
  static inline std::mutex mu_;
  static inline std::map<uintptr_t, std::weak_ptr<StagedCopy>> live_;
};

// ---- GPU staging: one copy engine, pinned pool and snapshot buffer per device ----

struct DeviceStaging {
  std::unique_ptr<gpu::CopyEngine> engine;
  std::unique_ptr<gpu::PinnedPool> pool;
  std::unique_ptr<gpu::SnapshotBuffer> snapshot;
};

// Streaming buffers: four of these keep the copy engine and the writer busy.
constexpr size_t kPinnedBuffers = 4;
constexpr size_t kPinnedBufferBytes = 32u << 20;

class GpuRegistry {
 public:
  static GpuRegistry& Get() {
    static GpuRegistry* r = new GpuRegistry;  // never destroyed: CUDA may be torn down first at exit
    return *r;
  }
  DeviceStaging& For(int device) {
    std::lock_guard lock(mu_);
    auto& s = devices_[device];
    if (!s.engine) {
      s.engine = Value(gpu::NewCudaCopyEngine(device));
      s.pool = Value(gpu::PinnedPool::Create(*s.engine, kPinnedBuffers, kPinnedBufferBytes));
      s.snapshot = std::make_unique<gpu::SnapshotBuffer>(*s.engine);
    }
    return s;
  }

 private:
  std::mutex mu_;
  std::map<int, DeviceStaging> devices_;
};

// ---- save ------------------------------------------------------------------------

// What a commit did, as save(), commit handles and import_safetensors
// return it.
py::dict CommitResultDict(const CommitResult& r) { return JsonToPython(DescribeCommitResult(r)).cast<py::dict>(); }

// Runs `fn` on a thread of its own. Unlike std::async's, the future does not
// block when dropped, so a caller may let go of a save's handle; the Python
// side waits for saves still in flight when the interpreter exits.
std::shared_future<Result<CommitResult>> InBackground(std::function<Result<CommitResult>()> fn) {
  auto promise = std::make_shared<std::promise<Result<CommitResult>>>();
  auto future = promise->get_future().share();
  std::thread([promise, fn = std::move(fn)] { promise->set_value(fn()); }).detach();
  return future;
}

// The outcome of a save, waited for off the GIL.
class SaveHandle {
 public:
  SaveHandle(std::shared_future<Result<CommitResult>> f, double blocking_seconds)
      : future_(std::move(f)), blocking_seconds_(blocking_seconds) {}
  bool done() const {
    CheckProcess();
    return future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  // Waits up to `timeout` seconds (forever when None); false on timeout.
  bool wait(std::optional<double> timeout) const {
    CheckProcess();
    py::gil_scoped_release nogil;
    if (!timeout) {
      future_.wait();
      return true;
    }
    return future_.wait_for(std::chrono::duration<double>(*timeout)) == std::future_status::ready;
  }
  py::dict result() const {
    CheckProcess();
    Result<CommitResult> r = future_.get();  // ready: callers wait first
    if (!r.ok()) throw StatusError{r.status()};
    return CommitResultDict(*r);
  }
  double blocking_seconds() const { return blocking_seconds_; }

 private:
  // The thread that finishes the save is the parent's: a forked child would
  // wait for it forever.
  void CheckProcess() const {
    if (ForkGeneration() != fork_generation_) {
      throw StatusError{Status::FailedPrecondition(
          "this save was started before the process was forked; only the parent process can wait for it")};
    }
  }
  std::shared_future<Result<CommitResult>> future_;
  double blocking_seconds_;
  uint64_t fork_generation_ = ForkGeneration();
};

// A StagedCopy for Python (StorageWriter.stage): writable bytes that torch
// tensors are made over; a save that puts them lends them to its writer.
class StagingBuffer {
 public:
  explicit StagingBuffer(uint64_t nbytes) : copy_(StagedCopy::Make(std::max<uint64_t>(nbytes, 1))), size_(nbytes) {}
  // Copies `nbytes` of host memory at `address` to the start of the buffer.
  void copy_from(uintptr_t address, uint64_t nbytes) {
    if (nbytes > size_) {
      throw StatusError{Status::InvalidArgument("copy of " + std::to_string(nbytes) + " bytes into a staging buffer of " +
                                                std::to_string(size_))};
    }
    std::span<std::byte> from = HostSpan(address, nbytes);
    py::gil_scoped_release nogil;
    if (nbytes) std::memcpy(copy_->data(), from.data(), nbytes);
  }
  std::byte* data() const { return copy_->data(); }
  uint64_t size() const { return size_; }

 private:
  std::shared_ptr<StagedCopy> copy_;
  uint64_t size_;
};

// One rank's part of a checkpoint. Host tensors and blobs are consumed (hashed
// and encoded, or copied when staged) when put, so the caller may change them
// afterwards; device tensors are put when committed: streamed through pinned
// buffers by a blocking commit, or copied out at once by an asynchronous one.
class Writer {
 public:
  Writer(std::shared_ptr<Repository> repo, std::unique_ptr<CheckpointWriter> w)
      : repo_(std::move(repo)), writer_(std::move(w)) {}

  // With `stage` (an asynchronous save), host bytes of StagedCopy::kMinBytes
  // and more are copied into a StagedCopy and put from there: this returns
  // once they are copied, and the engine's threads hash and encode them in
  // the background. Bytes inside a live StagedCopy are put from it as they
  // are, staged or not.
  void put(const std::string& name, const std::string& dtype, const Shape& shape, const std::string& kind,
           const std::vector<uint64_t>& local_shape, const std::vector<uint64_t>& offsets, uint64_t start,
           uintptr_t address, uint64_t bytes, int device, bool stage) {
    TensorInfo info{name, ParseDTypeOrThrow(dtype), shape};
    Region region = MakeRegion(shape, kind, local_shape, offsets, start);
    if (device >= 0) {
      CheckDeviceMemory(name, shape, region, info.dtype, bytes);
      device_shards_.push_back(
          {device, gpu::DeviceShard{std::move(info), std::move(region), reinterpret_cast<const std::byte*>(address)}});
      return;
    }
    std::span<std::byte> data = HostSpan(address, bytes);
    py::gil_scoped_release nogil;
    if (std::shared_ptr<StagedCopy> held = bytes ? StagedCopy::Holding(address, bytes) : nullptr) {
      StableSource source(held, data);
      Check(Live().PutShard(info, region, source));
      return;
    }
    if (stage && bytes >= StagedCopy::kMinBytes) {
      std::shared_ptr<StagedCopy> copy = StagedCopy::Make(bytes);
      std::memcpy(copy->data(), data.data(), bytes);
      staged_bytes_ += bytes;
      StagingCache::Get().NoteSave(staged_bytes_);
      StableSource source(copy, {copy->data(), bytes});
      Check(Live().PutShard(info, region, source));
      return;
    }
    HostSource source(data);
    Check(Live().PutShard(info, region, source));
  }

  // A shard whose bytes lie in a file, at [file_offset, file_offset +
  // bytes): put from a read-only mapping that the engine's threads keep
  // while they hash and encode it, so this returns without waiting for
  // them and the next put keeps them busy. Each file is mapped once per
  // writer.
  void put_file(const std::string& name, const std::string& dtype, const Shape& shape, const std::string& kind,
                const std::vector<uint64_t>& local_shape, const std::vector<uint64_t>& offsets, uint64_t start,
                const std::string& path, uint64_t file_offset, uint64_t bytes) {
    TensorInfo info{name, ParseDTypeOrThrow(dtype), shape};
    Region region = MakeRegion(shape, kind, local_shape, offsets, start);
    std::shared_ptr<const MappedFile>& file = mapped_[path];  // under the GIL
    if (!file) file = Value(MappedFile::Open(path));
    MappedSource source = Value(MappedSource::Make(file, file_offset, bytes));
    py::gil_scoped_release nogil;
    Check(Live().PutShard(info, region, source));
  }

  void put_blob(const std::string& name, py::buffer data) {
    py::buffer_info b = data.request();
    // Any stride, including a 1-D or negative one, is refused: the bytes are
    // read as one run from `ptr` (the package passes strided views as bytes).
    if (!PyBuffer_IsContiguous(b.view(), 'C')) {
      throw StatusError{Status::InvalidArgument("blob '" + name + "' is not contiguous memory")};
    }
    std::span<const std::byte> bytes(static_cast<const std::byte*>(b.ptr), static_cast<size_t>(b.size * b.itemsize));
    py::gil_scoped_release nogil;
    Check(Live().PutBlob(name, bytes));
  }

  // A blob written in pieces (CheckpointWriter::BeginBlob): each piece is
  // copied into the engine's pooled buffers before append_blob returns.
  // `unit`: the piece is one unit (BlobPiece::kUnit), a tensor's bytes of
  // elements `dtype`.
  void begin_blob(const std::string& name) { Check(Live().BeginBlob(name)); }
  void append_blob(py::buffer data, bool unit, const std::string& dtype) {
    const DType elements = ParseDTypeOrThrow(dtype);
    py::buffer_info b = data.request();
    if (!PyBuffer_IsContiguous(b.view(), 'C')) {
      throw StatusError{Status::InvalidArgument("a piece of a blob is not contiguous memory")};
    }
    std::span<const std::byte> bytes(static_cast<const std::byte*>(b.ptr), static_cast<size_t>(b.size * b.itemsize));
    py::gil_scoped_release nogil;
    Check(Live().AppendBlob(bytes, unit ? BlobPiece::kUnit : BlobPiece::kContent, elements));
  }
  void end_blob() {
    py::gil_scoped_release nogil;
    Check(Live().EndBlob());
  }

  // Commits; with `snapshot`, device shards are copied to pinned host memory
  // before this returns and persisted in the background.
  SaveHandle commit(bool snapshot) {
    py::gil_scoped_release nogil;
    const auto start = std::chrono::steady_clock::now();
    if (!writer_) throw StatusError{Status::FailedPrecondition("this save was already committed or aborted")};
    std::unique_ptr<CheckpointWriter> w = std::move(writer_);
    mapped_.clear();  // jobs still reading a file keep its mapping
    auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
    // The background work keeps the repository open until it is done.
    std::shared_ptr<Repository> repo = repo_;
    if (device_shards_.empty()) {
      CommitHandle h = w->Commit();
      return SaveHandle(InBackground([h, repo]() mutable { return h.Wait(); }), seconds());
    }
    const int device = device_shards_.front().first;
    std::vector<gpu::DeviceShard> shards;
    for (auto& [d, s] : device_shards_) {
      if (d != device) {
        throw StatusError{Status::InvalidArgument("tensors of one save must be on one GPU (found cuda:" +
                                                  std::to_string(device) + " and cuda:" + std::to_string(d) + ")")};
      }
      shards.push_back(std::move(s));
    }
    device_shards_.clear();
    DeviceStaging& staging = GpuRegistry::Get().For(device);
    if (snapshot) {
      gpu::SnapshotHandle h =
          Value(gpu::SnapshotAndCommit(std::move(w), shards, *staging.engine, *staging.snapshot, start));
      return SaveHandle(InBackground([h, repo]() mutable { return h.Wait(); }), seconds());
    }
    for (const auto& s : shards) Check(gpu::PutShardFromDevice(*w, s, *staging.engine, *staging.pool));
    CommitHandle h = w->Commit();
    return SaveHandle(InBackground([h, repo]() mutable { return h.Wait(); }), seconds());
  }

  void abort() {
    if (writer_) writer_->Abort();
    writer_.reset();
    device_shards_.clear();
    mapped_.clear();
  }

 private:
  CheckpointWriter& Live() {
    if (!writer_) throw StatusError{Status::FailedPrecondition("this save was already committed or aborted")};
    return *writer_;
  }
  std::shared_ptr<Repository> repo_;
  std::unique_ptr<CheckpointWriter> writer_;
  uint64_t staged_bytes_ = 0;  // copied into staged copies by put
  std::vector<std::pair<int, gpu::DeviceShard>> device_shards_;
  std::map<std::string, std::shared_ptr<const MappedFile>> mapped_;
};

// ---- load ------------------------------------------------------------------------

class Reader {
 public:
  Reader(std::shared_ptr<Repository> repo, std::unique_ptr<CheckpointReader> r)
      : repo_(std::move(repo)), reader_(std::move(r)) {}

  // [(name, dtype, shape)] in name order.
  std::vector<std::tuple<std::string, std::string, Shape>> tensors() const {
    std::vector<std::tuple<std::string, std::string, Shape>> out;
    for (const auto& t : reader_->tensors()) out.emplace_back(t.name, std::string(DTypeName(t.dtype)), t.shape);
    return out;
  }
  std::vector<std::pair<std::string, uint64_t>> blobs() const {
    std::vector<std::pair<std::string, uint64_t>> out;
    for (const auto& b : reader_->blobs()) out.emplace_back(b.name, b.size);
    return out;
  }
  // What tells this checkpoint from another of the same name (CheckpointIdentity).
  std::string identity() const { return CheckpointIdentity(reader_->info()); }
  std::tuple<std::string, Shape> tensor_info(const std::string& name) const {
    const TensorRecord* t = Value(reader_->GetTensor(name));
    return {std::string(DTypeName(t->dtype)), t->shape};
  }

  void read(const std::string& name, const std::string& dtype, const Shape& shape, const std::string& kind,
            const std::vector<uint64_t>& local_shape, const std::vector<uint64_t>& offsets, uint64_t start,
            uintptr_t address, uint64_t bytes, int device) const {
    const DType d = ParseDTypeOrThrow(dtype);
    const TensorRecord* t = Value(reader_->FindTarget(name, d, shape));
    Region region = MakeRegion(shape, kind, local_shape, offsets, start);
    if (device >= 0) {
      CheckDeviceMemory(name, shape, region, d, bytes);
      DeviceStaging& staging = GpuRegistry::Get().For(device);
      py::gil_scoped_release nogil;
      Check(gpu::LoadToDevice(*reader_, *t, region, reinterpret_cast<std::byte*>(address), *staging.engine,
                              *staging.pool));
      return;
    }
    std::span<std::byte> dst = HostSpan(address, bytes);
    py::gil_scoped_release nogil;
    Check(reader_->ReadRegion(*t, region, dst));
  }

  py::bytes blob(const std::string& name) const {
    const BlobRecord* b = Value(reader_->GetBlob(name));
    std::string out(b->size, '\0');
    {
      py::gil_scoped_release nogil;
      Check(reader_->ReadBlob(*b, 0, std::as_writable_bytes(std::span<char>(out.data(), out.size()))));
    }
    return py::bytes(out);
  }

  // Bytes [offset, offset + len(out)) of blob `name` into the writable,
  // contiguous buffer `out`: a large blob read in pieces.
  void read_blob(const std::string& name, uint64_t offset, py::buffer out) const {
    py::buffer_info b = out.request(/*writable=*/true);
    if (!PyBuffer_IsContiguous(b.view(), 'C')) {
      throw StatusError{Status::InvalidArgument("read_blob: the buffer is not contiguous memory")};
    }
    const BlobRecord* rec = Value(reader_->GetBlob(name));
    std::span<std::byte> dst(static_cast<std::byte*>(b.ptr), static_cast<size_t>(b.size * b.itemsize));
    py::gil_scoped_release nogil;
    Check(reader_->ReadBlob(*rec, offset, dst));
  }

  // Bytes [offset, offset + size) of blob `name` as a bytes object, read
  // into it in place (no copy on the way out).
  py::bytes read_blob_bytes(const std::string& name, uint64_t offset, uint64_t size) const {
    const BlobRecord* rec = Value(reader_->GetBlob(name));
    if (size > static_cast<uint64_t>(PY_SSIZE_T_MAX)) throw StatusError{Status::InvalidArgument("read too large")};
    PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(size));
    if (raw == nullptr) throw py::error_already_set();
    py::bytes out = py::reinterpret_steal<py::bytes>(raw);
    std::span<std::byte> dst(reinterpret_cast<std::byte*>(PyBytes_AS_STRING(raw)), static_cast<size_t>(size));
    {
      py::gil_scoped_release nogil;
      Check(reader_->ReadBlob(*rec, offset, dst));
    }
    return out;
  }

  py::object show() const {
    Json j = Value(DescribeCheckpoint(*reader_));
    return JsonToPython(j);
  }


 private:
  std::shared_ptr<Repository> repo_;  // outlives the reader
  std::unique_ptr<CheckpointReader> reader_;
};

// ---- collectives over torch.distributed --------------------------------------------

// A Python exception as one line: its type and the first line of its text.
std::string FirstLine(const py::error_already_set& e) {
  std::string what = e.what();
  const size_t end = what.find('\n');
  return end == std::string::npos ? what : what.substr(0, end);
}

// Calls `fn` with the GIL (the engine's calls come on the caller's thread,
// which released it); a Python exception becomes an IOError saying it.
template <typename F>
Status WithGil(F&& fn) {
  py::gil_scoped_acquire gil;
  try {
    fn();
    return Status::OK();
  } catch (py::error_already_set& e) {
    return Status::IOError(FirstLine(e));
  } catch (const py::cast_error& e) {
    return Status::Internal(std::string("a collective call returned a value of the wrong type: ") + e.what());
  }
}

py::memoryview HostView(std::span<const std::byte> data) {
  return py::memoryview::from_memory(const_cast<std::byte*>(data.data()), static_cast<py::ssize_t>(data.size()));
}

// The engine's Communicator over torch.distributed: each call goes to the
// package's group object (ckptfs.collective.Group), which makes it on
// ckptfs's own gloo group. Made and destroyed with the GIL held; used by
// the engine on the same thread with the GIL released.
class TorchCommunicator final : public Communicator {
 public:
  explicit TorchCommunicator(py::object group)
      : group_(std::move(group)), rank_(group_.attr("rank").cast<int>()), size_(group_.attr("size").cast<int>()) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string Describe() const override {
    return "torch.distributed rank " + std::to_string(rank_) + " of " + std::to_string(size_);
  }
  Status Broadcast(std::byte* data, size_t bytes, int root) override {
    if (bytes == 0) return Status::OK();
    return WithGil([&] { group_.attr("broadcast")(HostView({data, bytes}), root); });
  }
  Status AllReduceMin(std::span<uint64_t> values) override {
    if (values.size() > kMaxReduceValues) return Status::InvalidArgument("too many values to reduce");
    return WithGil([&] {
      auto out = group_.attr("all_reduce_min")(std::vector<uint64_t>(values.begin(), values.end()))
                     .cast<std::vector<uint64_t>>();
      if (out.size() != values.size()) throw py::cast_error("all_reduce_min returned another count");
      std::copy(out.begin(), out.end(), values.begin());
    });
  }
  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    std::vector<std::string> out;
    CKPT_RETURN_IF_ERROR(WithGil([&] {
      out = group_.attr("all_gather")(py::bytes(mine.data(), mine.size())).cast<std::vector<std::string>>();
    }));
    return out;
  }
  Result<std::vector<std::string>> Gather(std::string_view mine, int root) override {
    std::vector<std::string> out;
    CKPT_RETURN_IF_ERROR(WithGil([&] {
      out = group_.attr("gather")(py::bytes(mine.data(), mine.size()), root).cast<std::vector<std::string>>();
    }));
    return out;
  }
  Result<std::string> Scatter(const std::vector<std::string>& parts, int root) override {
    std::string out;
    CKPT_RETURN_IF_ERROR(WithGil([&] {
      py::object given = py::none();
      if (rank_ == root) {
        py::list l;
        for (const std::string& p : parts) l.append(py::bytes(p));
        given = l;
      }
      out = group_.attr("scatter")(given, root).cast<std::string>();
    }));
    return out;
  }
  Result<std::string> BroadcastMessage(std::string mine, int root) override {
    std::string out;
    CKPT_RETURN_IF_ERROR(WithGil([&] {
      out = group_.attr("broadcast_message")(py::bytes(mine), root).cast<std::string>();
    }));
    return out;
  }
  Status Send(std::span<const std::byte> data, int peer) override {
    if (data.empty()) return Status::OK();
    return WithGil([&] { group_.attr("send")(HostView(data), peer); });
  }
  Status Recv(std::span<std::byte> data, int peer) override {
    if (data.empty()) return Status::OK();
    return WithGil([&] { group_.attr("recv")(HostView(data), peer); });
  }
  // One batch_isend_irecv (a ring of sends and receives would wait on
  // itself made in order). A load's regions go through
  // TorchLoadMemory::Deliver instead.
  Status Exchange(std::span<const Transfer> transfers) override {
    if (transfers.empty()) return Status::OK();
    return WithGil([&] {
      py::list l;
      for (const Transfer& t : transfers) {
        l.append(py::make_tuple(t.send, t.peer, HostView(t.data), t.tag));
      }
      group_.attr("exchange")(l);
    });
  }

 private:
  py::object group_;
  const int rank_;
  const int size_;
};

// A collective load's targets as the package gives them: host or device
// memory (each target's device by its address), read here, delivered and
// copied by the group object (torch moves device memory), which also hears
// the load's progress.
class TorchLoadMemory final : public CollectiveMemory {
 public:
  TorchLoadMemory(py::object group, Status ready, std::string device_token, std::map<const std::byte*, int> devices,
                  bool progress)
      : group_(std::move(group)),
        ready_(std::move(ready)),
        token_(std::move(device_token)),
        devices_(std::move(devices)),
        progress_(progress) {}

  // A load puts nothing: Source and Digest are host memory's.
  std::unique_ptr<ShardSource> Source(std::span<const std::byte> data) override {
    return HostCollectiveMemory().Source(data);
  }
  Result<ChunkId> Digest(std::span<const std::byte> data) override { return HostCollectiveMemory().Digest(data); }
  Status Read(const CheckpointReader& reader, const TensorRecord& tensor, const Region& region,
              std::span<std::byte> target) override {
    const int device = DeviceOf(target.data());
    if (device < 0) {
      CKPT_RETURN_IF_ERROR(reader.ReadRegion(tensor, region, target));
    } else {
      DeviceStaging* staging = nullptr;
      try {
        staging = &GpuRegistry::Get().For(device);
      } catch (const StatusError& e) {
        return e.status;
      }
      CKPT_RETURN_IF_ERROR(gpu::LoadToDevice(reader, tensor, region, target.data(), *staging->engine, *staging->pool));
    }
    if (!progress_) return Status::OK();
    return WithGil([&] { group_.attr("progress")(target.size()); });
  }
  Status Copy(std::span<std::byte> dst, std::span<const std::byte> src) override {
    if (src.empty() || dst.data() == src.data()) return Status::OK();
    if (DeviceOf(dst.data()) < 0 && DeviceOf(src.data()) < 0) {
      std::memcpy(dst.data(), src.data(), src.size());
      return Status::OK();
    }
    return WithGil([&] {
      group_.attr("copy")(reinterpret_cast<uintptr_t>(dst.data()), reinterpret_cast<uintptr_t>(src.data()));
    });
  }
  Status Ready() const override { return ready_; }
  std::string DeliveryDevice() const override { return token_; }
  Status Deliver(Communicator& comm, std::span<const Communicator::Transfer> transfers, bool on_device) override {
    (void)comm;
    return WithGil([&] {
      py::list l;
      for (const Communicator::Transfer& t : transfers) {
        if (!t.data.empty()) {
          l.append(py::make_tuple(t.send, t.peer, reinterpret_cast<uintptr_t>(t.data.data()), t.data.size(), t.tag));
        }
      }
      group_.attr("deliver")(l, on_device);
    });
  }

 private:
  int DeviceOf(const std::byte* address) const {
    auto it = devices_.find(address);
    return it == devices_.end() ? -1 : it->second;
  }
  py::object group_;
  const Status ready_;
  const std::string token_;
  const std::map<const std::byte*, int> devices_;
  const bool progress_;
};

// A failed collective step as the package raises it: ckptfs.CollectiveError
// (StatusDetail::kCollective) prefixed with what the caller was doing, or
// rank 0's own error, as its own class.
void CheckCollective(const Status& st, const std::string& what) {
  if (st.ok()) return;
  if (st.detail() != StatusDetail::kCollective) throw StatusError{st};
  throw StatusError{Status(st.code(), what + ": " + st.message()).WithDetail(StatusDetail::kCollective)};
}

// A state-dict value or load target as the package describes it: (name,
// global shape, kind, local shape, offsets, start, bytes), kind "whole",
// "box", "flat" or "blob"; a tensor's name is "name NUL dtype".
using PlanTuple = std::tuple<std::string, Shape, std::string, std::vector<uint64_t>, std::vector<uint64_t>, uint64_t,
                             uint64_t>;

PlanEntry ToPlanEntry(const PlanTuple& tuple) {
  const auto& [name, shape, kind, local, offsets, start, bytes] = tuple;
  PlanEntry e{name, {}, Region::OfFlat(0, 0), bytes};
  if (kind != "blob") {
    e.shape = shape;
    e.region = MakeRegion(shape, kind, local, offsets, start);
  }
  return e;
}

// ---- the repository ----------------------------------------------------------------

// A Python callable `fn` as a callback the engine calls on the calling
// thread while the GIL is released: the GIL is taken for each call, and the
// first exception is kept in `failed` (later calls are skipped) for the
// caller to raise once the engine returns. Empty when fn is None.
template <typename... Args>
std::function<void(Args...)> FromEngineThread(const py::object& fn, std::optional<py::error_already_set>& failed) {
  if (fn.is_none()) return {};
  return [fn, &failed](Args... args) {
    py::gil_scoped_acquire gil;
    if (failed) return;
    try {
      fn(args...);
    } catch (py::error_already_set& e) {
      failed.emplace(std::move(e));
    }
  };
}

WriterOptions WriterOptionsOf(uint32_t rank, uint32_t world_size, std::optional<int64_t> step,
                              const std::vector<std::pair<std::string, std::string>>& tags) {
  WriterOptions o;
  o.rank = rank;
  o.world_size = world_size;
  o.step = step;
  o.tags = tags;
  return o;
}

std::chrono::milliseconds AwaitRanks(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) throw StatusError{Status::InvalidArgument("await_ranks must be 0 to 1e7 seconds")};
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

class PyRepository {
 public:
  explicit PyRepository(std::shared_ptr<Repository> repo) : repo_(std::move(repo)) {}

  static void Init(const std::string& path, uint64_t chunk_size, uint64_t pack_size, const std::string& compression,
                   int level, bool adaptive, const std::string& cache_dir) {
    RepositoryConfig c;
    c.chunk_size = chunk_size;
    c.pack_size = pack_size;
    if (compression == "zstd") c.codec.compression = Compression::kZstd;
    else if (compression == "none") c.codec.compression = Compression::kNone;
    else throw StatusError{Status::InvalidArgument("compression must be 'zstd' or 'none', not '" + compression + "'")};
    c.codec.level = level;
    c.adaptive = adaptive;
    OpenOptions o = Value(OptionsFromEnvironment(cache_dir));
    py::gil_scoped_release nogil;
    Check(Repository::Init(path, c, o));
  }

  static PyRepository Open(const std::string& path, size_t threads, uint64_t cache_bytes, const std::string& cache_dir,
                           size_t io_threads, bool opening_sync) {
    OpenOptions o = Value(OptionsFromEnvironment(cache_dir));
    o.threads = threads;
    o.io_threads = io_threads;
    o.cache_bytes = cache_bytes;
    o.opening_sync = opening_sync;
    py::gil_scoped_release nogil;
    // Every Python object opened on one repository shares one engine
    // Repository (LMDB allows one catalog environment per file per process).
    return PyRepository(Value(Repository::OpenShared(path, o)));
  }

  // The one place where the package reads the engine's settings from the
  // process's environment (CKPT_CACHE_DIR, HOME, XDG_CACHE_HOME,
  // CKPT_LOCK_STALE_SECONDS, AWS_*: docs/PYTHON.md); a cache directory
  // given to open() or init() wins over CKPT_CACHE_DIR.
  static Result<OpenOptions> OptionsFromEnvironment(const std::string& cache_dir) {
    CKPT_ASSIGN_OR_RETURN(OpenOptions o, OpenOptionsFromEnvironment(std::getenv));
    if (!cache_dir.empty()) o.cache_dir = cache_dir;
    return o;
  }

  std::string path() const { return repo_->path(); }
  py::dict config() const {
    const RepositoryConfig& c = repo_->config();
    py::dict d;
    d["chunk_size"] = c.chunk_size;
    d["pack_size"] = c.pack_size;
    d["compression"] = c.codec.compression == Compression::kZstd ? "zstd" : "none";
    d["level"] = c.codec.level;
    d["adaptive"] = c.adaptive;
    return d;
  }

  // `compress_every_chunk`, `attempt`, `overwrite`: WriterOptions's.
  Writer begin(const std::string& name, uint32_t rank, uint32_t world_size, std::optional<int64_t> step,
               const std::vector<std::pair<std::string, std::string>>& tags, bool compress_every_chunk,
               const std::string& attempt, bool overwrite) {
    WriterOptions o = WriterOptionsOf(rank, world_size, step, tags);
    o.attempt = attempt;
    o.overwrite = overwrite;
    o.compress_every_chunk = compress_every_chunk;
    py::gil_scoped_release nogil;
    return Writer(repo_, Value(repo_->BeginCheckpoint(name, o)));
  }

  // This rank's writer of a collective save (BeginCollectiveSave), and
  // its own failure to begin (None when it began), which the puts'
  // agreement hears; rank 0's failure raises on every rank. Rank 0's
  // commit waits `await_ranks` seconds for the other ranks' parts.
  py::tuple begin_collective(py::object group, const std::string& name, std::optional<int64_t> step,
                             const std::vector<std::pair<std::string, std::string>>& tags, double await_ranks,
                             const std::string& attempt, bool overwrite, const std::string& what) {
    TorchCommunicator comm(std::move(group));
    WriterOptions o = WriterOptionsOf(0, 1, step, tags);
    o.attempt = attempt;
    o.overwrite = overwrite;
    o.await_ranks = AwaitRanks(await_ranks);
    Status own;
    Result<std::unique_ptr<CheckpointWriter>> writer = Status::Internal("not begun");
    {
      py::gil_scoped_release nogil;
      writer = BeginCollectiveSave(*repo_, name, comm, std::move(o), &own);
    }
    CheckCollective(writer.status(), what);
    if (!own.ok()) return py::make_tuple(py::none(), own.message());
    return py::make_tuple(Writer(repo_, std::move(writer).value()), py::none());
  }

  // An import of `paths` and `blob_files`; what a directory leaves out is
  // appended to `left_out`.
  static ImportInputs ImportInputsOf(const std::vector<std::string>& paths,
                                     const std::vector<std::pair<std::string, std::string>>& blob_files,
                                     std::vector<std::string>* left_out, bool follow_symlinks) {
    ImportInputs in;
    in.follow_symlinks = follow_symlinks;
    in.paths = paths;
    in.blob_files = blob_files;
    in.left_out = [left_out](const std::string& what) { left_out->push_back(what); };
    return in;
  }

  // Repository::ComposeCheckpoint: checkpoint `name` made of blobs of other
  // checkpoints, given as (checkpoint, blob, name in the new one), and of
  // tensor shards in them (TensorFrom), given as (tensor name, dtype, shape,
  // box offsets, box lengths, checkpoint, blob, byte offset in the blob).
  using TensorFromTuple = std::tuple<std::string, std::string, Shape, std::vector<uint64_t>, std::vector<uint64_t>,
                                     std::string, std::string, uint64_t>;
  py::dict compose(const std::string& name, const std::vector<std::tuple<std::string, std::string, std::string>>& blobs,
                   std::optional<int64_t> step, const std::vector<std::pair<std::string, std::string>>& tags,
                   bool overwrite, const std::vector<TensorFromTuple>& tensors) {
    std::vector<BlobFrom> from;
    from.reserve(blobs.size());
    for (const auto& [checkpoint, blob, as] : blobs) from.push_back(BlobFrom{checkpoint, blob, as});
    std::vector<TensorFrom> shards;
    shards.reserve(tensors.size());
    for (const auto& [tensor, dtype, shape, offsets, lengths, checkpoint, blob, offset] : tensors) {
      shards.push_back(TensorFrom{TensorInfo{tensor, ParseDTypeOrThrow(dtype), shape},
                                  Region::OfBox(Box{offsets, lengths}), checkpoint, blob, offset});
    }
    WriterOptions o = WriterOptionsOf(0, 1, step, tags);
    o.overwrite = overwrite;
    o.attempt = NewSaveAttempt();
    Result<CommitResult> r = [&] {
      py::gil_scoped_release nogil;
      return repo_->ComposeCheckpoint(name, from, o, shards);
    }();
    if (!r.ok()) throw StatusError{r.status()};
    return CommitResultDict(*r);
  }

  // What `ckpt import` does (ckpt/import.h): every input checked first, then
  // written and committed as one rank's part.
  py::dict import_safetensors(const std::string& name, const std::vector<std::string>& paths,
                              const std::vector<std::pair<std::string, std::string>>& blob_files, uint32_t rank,
                              uint32_t world_size, std::optional<int64_t> step,
                              const std::vector<std::pair<std::string, std::string>>& tags, bool follow_symlinks,
                              bool overwrite) {
    std::vector<std::string> left_out;
    Result<CommitResult> r = [&]() -> Result<CommitResult> {
      py::gil_scoped_release nogil;
      ImportInputs in = ImportInputsOf(paths, blob_files, &left_out, follow_symlinks);
      in.partial = world_size > 1;
      CKPT_ASSIGN_OR_RETURN(PreparedImport prepared, PreparedImport::Prepare(in));
      WriterOptions o;
      o.rank = rank;
      o.world_size = world_size;
      o.step = step;
      o.tags = tags;
      o.overwrite = overwrite;
      CKPT_ASSIGN_OR_RETURN(auto writer, repo_->BeginCheckpoint(name, o));
      if (Status st = prepared.PutInto(*writer); !st.ok()) {
        writer->Abort();
        return st;
      }
      return writer->Commit().Wait();
    }();
    if (!r.ok()) throw StatusError{r.status()};
    py::dict d = CommitResultDict(*r);
    d["left_out"] = left_out;
    return d;
  }

  // What import_safetensors would put (`ckpt import --dry-run`): every
  // input read and checked, nothing written.
  py::object describe_import(const std::vector<std::string>& paths,
                             const std::vector<std::pair<std::string, std::string>>& blob_files,
                             bool follow_symlinks) {
    std::vector<std::string> left_out;
    Result<Json> r = [&]() -> Result<Json> {
      py::gil_scoped_release nogil;
      CKPT_ASSIGN_OR_RETURN(PreparedImport prepared, PreparedImport::Prepare(ImportInputsOf(paths, blob_files,
                                                                                            &left_out, follow_symlinks)));
      return prepared.Describe();
    }();
    if (!r.ok()) throw StatusError{r.status()};
    py::dict d = JsonToPython(*r).cast<py::dict>();
    d["left_out"] = left_out;
    return d;
  }

  // This rank's part of a collective load (LoadCollective): `targets`
  // (name, dtype, global shape, kind, local shape, offsets, start,
  // address, bytes, device), filled through `group` (a
  // ckptfs.collective.Group: its deliver, copy and progress); `error`,
  // this rank's failure to describe its targets, fails every rank;
  // `device_token` is CollectiveMemory::DeliveryDevice's. Returns the
  // engine's figures.
  using TargetTuple = std::tuple<std::string, std::string, Shape, std::string, std::vector<uint64_t>,
                                 std::vector<uint64_t>, uint64_t, uintptr_t, uint64_t, int>;
  py::dict load_collective(py::object group, const std::string& name, const std::vector<TargetTuple>& targets,
                           const std::optional<std::string>& error, const std::string& device_token, bool progress,
                           const std::string& what, const std::vector<PyRepository*>& nearer) {
    const std::vector<Repository*> tiers = Repositories(nearer);
    Status ready = error ? Status::InvalidArgument(*error) : Status::OK();
    std::vector<CollectiveTarget> wanted;
    std::map<const std::byte*, int> devices;
    for (size_t i = 0; ready.ok() && i < targets.size(); ++i) {
      const auto& [key, dtype, shape, kind, local, offsets, start, address, bytes, device] = targets[i];
      try {
        const DType d = ParseDTypeOrThrow(dtype);
        Region region = MakeRegion(shape, kind, local, offsets, start);
        std::span<std::byte> data;
        if (device >= 0) {
          if (address == 0 && bytes > 0) throw StatusError{Status::InvalidArgument("null device pointer")};
          data = {reinterpret_cast<std::byte*>(address), static_cast<size_t>(bytes)};
          devices[data.data()] = device;
        } else {
          data = HostSpan(address, bytes);
        }
        wanted.push_back({TensorInfo{key, d, shape}, std::move(region), data});
      } catch (const StatusError& e) {
        ready = e.status.WithContext("target '" + key + "'");
      }
    }
    if (!ready.ok()) wanted.clear();
    TorchCommunicator comm(group);
    TorchLoadMemory memory(group, ready, device_token, std::move(devices), progress);
    Result<CollectiveLoadResult> r = Status::Internal("not run");
    {
      py::gil_scoped_release nogil;
      r = LoadCollective(*repo_, name, wanted, comm, memory, tiers);
    }
    CheckCollective(r.status(), what);
    py::dict d;
    d["fetched_bytes"] = r->fetched_bytes;
    d["received_bytes"] = r->received_bytes;
    d["sent_bytes"] = r->sent_bytes;
    d["unique_bytes"] = r->unique_bytes;
    d["handoff_sent_bytes"] = r->handoff_sent_bytes;
    d["handoff_received_bytes"] = r->handoff_received_bytes;
    d["plan_bytes_received"] = r->plan_bytes_received;
    d["plan_seconds"] = r->plan_seconds;
    d["plan_make_seconds"] = r->plan_make_seconds;
    return d;
  }

  Reader open_checkpoint(const std::string& name, bool lease, const std::vector<PyRepository*>& nearer) {
    ReadOptions options;
    options.lease = lease;
    const std::vector<Repository*> tiers = Repositories(nearer);
    options.nearer.assign(tiers.begin(), tiers.end());
    py::gil_scoped_release nogil;
    return Reader(repo_, Value(repo_->OpenCheckpoint(name, options)));
  }

  // Two tiers (ckpt/tiers.h), this repository the fast tier.
  py::object tier_status(PyRepository& shared) { return JsonToPython(TierStatusJson(shared, nullptr, 0)); }

  // tier_status and, from the same sync of the shared tier, what the fast
  // tier's trim to `keep_last` drops: {"entries": [...], "trim": [names]}.
  py::object tier_status_and_trim(PyRepository& shared, uint64_t keep_last) {
    std::vector<std::string> trim;
    Json out = Json::MakeObject();
    out.Set("entries", TierStatusJson(shared, &trim, keep_last));
    Json names = Json::MakeArray();
    for (const std::string& n : trim) names.Push(n);
    out.Set("trim", std::move(names));
    return JsonToPython(out);
  }

  Json TierStatusJson(PyRepository& shared, std::vector<std::string>* trim, uint64_t keep_last) {
    std::vector<TierEntry> entries;
    {
      py::gil_scoped_release nogil;
      entries = Value(TierStatus(*repo_, *shared.repo_));
      if (trim) *trim = PlanFastTierTrim(entries, keep_last);
    }
    Json j = Json::MakeArray();
    for (const TierEntry& e : entries) j.Push(DescribeTierEntry(e));
    return j;
  }

  py::object drain(PyRepository& shared, const std::vector<std::string>& names, py::object on_phase) {
    DrainOptions o;
    o.names = names;
    std::optional<py::error_already_set> failed;
    o.on_phase = FromEngineThread<const std::string&>(on_phase, failed);
    DrainReport r;
    {
      py::gil_scoped_release nogil;
      r = Value(Drain(*repo_, *shared.repo_, o));
    }
    if (failed) throw std::move(*failed);
    return JsonToPython(DescribeDrainReport(r));
  }

  std::vector<std::string> plan_fast_trim(PyRepository& shared, uint64_t keep_last, bool short_of_space) {
    py::gil_scoped_release nogil;
    return Value(PlanFastTierTrim(*repo_, *shared.repo_, keep_last, short_of_space));
  }

  // ReplicateRankParts, or with `back` RestoreRankParts.
  py::dict replicate(py::object group, const std::string& name, uint32_t replicas, uint32_t jump,
                     const std::string& what, bool back, const std::string& strategy) {
    TorchCommunicator comm(group);
    ReplicaOptions o;
    o.replicas = replicas;
    o.jump = jump;
    o.strategy = Value(ParseReplicaStrategy(strategy));
    Result<ReplicaReport> r = Status::Internal("not run");
    {
      py::gil_scoped_release nogil;
      r = back ? RestoreRankParts(*repo_, name, comm, o) : ReplicateRankParts(*repo_, name, comm, o);
    }
    CheckCollective(r.status(), what);
    py::dict d;
    d["parts_sent"] = r->parts_sent;
    d["parts_received"] = r->parts_received;
    d["chunks_sent"] = r->chunks_sent;
    d["stored_bytes_sent"] = r->stored_bytes_sent;
    d["stored_bytes_received"] = r->stored_bytes_received;
    return d;
  }

  std::vector<std::pair<std::string, std::string>> undrained(PyRepository& shared) {
    RetentionPolicy held;
    py::gil_scoped_release nogil;
    Check(HoldNotDurable(*repo_, *shared.repo_, &held));
    return held.held;
  }

  static std::vector<Repository*> Repositories(const std::vector<PyRepository*>& list) {
    std::vector<Repository*> out;
    for (const PyRepository* r : list) {
      if (r == nullptr) throw StatusError{Status::InvalidArgument("a nearer tier must be a repository")};
      out.push_back(r->repo_.get());
    }
    return out;
  }

  // Ranks of a pending checkpoint that began their save: the fields of
  // `ckpt show NAME --json`'s ranks_started.
  py::object pending_ranks(const std::string& name) {
    std::vector<RankProgress> ranks;
    {
      py::gil_scoped_release nogil;
      ranks = Value(repo_->PendingRanks(name));
    }
    return JsonToPython(DescribePendingRanks(ranks));
  }

  void refresh() {
    py::gil_scoped_release nogil;
    Check(repo_->Refresh());
  }

  py::object checkpoints(bool include_pending) {
    std::vector<CheckpointRecord> list;
    {
      py::gil_scoped_release nogil;
      list = Value(repo_->ListCheckpoints(include_pending));
    }
    Json j = Json::MakeArray();
    for (const auto& c : list) j.Push(DescribeRecord(c));
    return JsonToPython(j);
  }

  void rm(const std::vector<std::string>& names) {
    py::gil_scoped_release nogil;
    Check(repo_->RemoveCheckpoints(names));
  }

  py::object gc(std::optional<uint64_t> keep_last, std::optional<uint64_t> keep_every,
                std::optional<std::string> keep_within, const std::vector<std::string>& keep,
                bool allow_removing_newest, bool dry_run, double rewrite_below, py::object on_phase,
                py::object progress, const std::string& group, std::optional<uint64_t> thin_older_than,
                const std::vector<std::string>& thin_keep,
                const std::vector<std::pair<std::string, std::string>>& held) {
    if (keep_every && *keep_every == 0) throw StatusError{Status::InvalidArgument("keep_every must be at least 1")};
    if (!thin_keep.empty() && !thin_older_than) {
      throw StatusError{Status::InvalidArgument("thin_keep says what thinning keeps: give thin_older_than too")};
    }
    GcOptions o;
    o.retention.keep_last = keep_last;
    o.retention.keep_every = keep_every;
    if (keep_within) o.retention.keep_within_s = Value(ParseDuration(*keep_within));
    o.retention.keep = keep;
    o.retention.held = held;
    o.retention.allow_removing_newest = allow_removing_newest;
    o.retention.group = group;
    o.retention.thin_older_than = thin_older_than;
    o.retention.thin_keep = thin_keep;
    o.dry_run = dry_run;
    o.rewrite_below = rewrite_below;
    // The callbacks run on this thread, between gc's steps: the GIL is taken
    // back for them. A callback's exception is kept and raised after gc.
    std::optional<py::error_already_set> failed;
    o.on_phase = FromEngineThread<const std::string&>(on_phase, failed);
    ProgressFn bytes = FromEngineThread<uint64_t, uint64_t>(progress, failed);
    GcReport r;
    {
      py::gil_scoped_release nogil;
      r = Value(repo_->CollectGarbage(o, bytes));
    }
    if (failed) throw std::move(*failed);
    return JsonToPython(DescribeGcReport(r, dry_run));
  }

  py::object stats(const std::string& name, const std::vector<std::string>& tensors) {
    std::vector<TensorStats> s;
    {
      py::gil_scoped_release nogil;
      s = Value(repo_->Stats(name, tensors));
    }
    Json j = Json::MakeArray();
    for (const auto& t : s) j.Push(DescribeTensorStats(t));
    return JsonToPython(j);
  }

  py::object copy_to(PyRepository& destination, const std::vector<std::string>& names, bool all,
                     std::optional<uint64_t> last, py::object on_phase, py::object progress) {
    CopyOptions o;
    o.names = names;
    o.all = all;
    o.last = last;
    // As gc's: the callbacks run on this thread, with the GIL taken back.
    std::optional<py::error_already_set> failed;
    o.on_phase = FromEngineThread<const std::string&>(on_phase, failed);
    ProgressFn bytes = FromEngineThread<uint64_t, uint64_t>(progress, failed);
    CopyReport r;
    {
      py::gil_scoped_release nogil;
      r = Value(CopyCheckpoints(*repo_, *destination.repo_, o, bytes));
    }
    if (failed) throw std::move(*failed);
    return JsonToPython(DescribeCopyReport(r));
  }

  py::dict verify(std::optional<std::string> name) {
    VerifyReport r;
    {
      py::gil_scoped_release nogil;
      r = Value(repo_->Verify(name));
    }
    return JsonToPython(DescribeVerifyReport(r)).cast<py::dict>();
  }

  py::list diff(const std::string& a, const std::string& b) {
    std::vector<TensorDiff> diffs;
    {
      py::gil_scoped_release nogil;
      diffs = Value(repo_->Diff(a, b));
    }
    py::list out;
    for (const auto& d : diffs) out.append(JsonToPython(DescribeTensorDiff(d)));
    return out;
  }

  py::dict du(const std::vector<std::string>& names, bool by_kind) {
    UsageFigures figures;
    {
      py::gil_scoped_release nogil;
      figures = Value(MeasureUsage(*repo_, names, by_kind));
    }
    return JsonToPython(DescribeUsage(figures, repo_->remote())).cast<py::dict>();
  }

  py::dict buffer_stats() const {
    BufferPoolStats s = repo_->buffer_stats();
    py::dict d;
    d["allocations"] = s.allocations;
    d["reuses"] = s.reuses;
    d["bytes_held"] = s.bytes_held;
    return d;
  }

  Repository& core() const { return *repo_; }

  py::dict store_counters() const {
    const FetchCounts f = repo_->fetch_counts();
    const RequestCounts r = repo_->store_requests();
    py::dict d;
    d["chunks_fetched"] = f.chunks;
    d["stored_bytes_fetched"] = f.stored_bytes;
    d["get_requests"] = r.get;
    d["list_requests"] = r.list;
    d["put_requests"] = r.put;
    d["requests"] = r.total();
    return d;
  }

 private:
  std::shared_ptr<Repository> repo_;
};

// Every rank's agreement on `step` (AgreeCollective): `error` None where
// this rank's part went well.
void CollectiveAgree(py::object group, const std::string& step, const std::optional<std::string>& error,
                     const std::string& what) {
  TorchCommunicator comm(std::move(group));
  const std::string said = error ? (error->empty() ? std::string("(no message)") : *error) : std::string();
  Status st;
  {
    py::gil_scoped_release nogil;
    st = AgreeCollective(comm, step, said);
  }
  CheckCollective(st, what);
}

// The status a ckptfs exception stands for: its class's code, its text.
Status StatusOfException(const py::handle& e) {
  StatusCode code = StatusCode::kIOError;
  const std::pair<PyObject*, StatusCode> classes[] = {
      {g_not_found, StatusCode::kNotFound},    {g_invalid, StatusCode::kInvalidArgument},
      {g_exists, StatusCode::kAlreadyExists},  {g_corruption, StatusCode::kCorruption},
      {g_unsupported, StatusCode::kUnsupported}, {g_error, StatusCode::kInternal}};
  for (const auto& [cls, c] : classes) {
    if (PyObject_IsInstance(e.ptr(), cls) == 1) {
      code = c;
      break;
    }
  }
  if (code == StatusCode::kInternal && PyObject_IsInstance(e.ptr(), g_io) == 1) code = StatusCode::kIOError;
  return Status(code, py::str(e).cast<std::string>());
}

// Rank 0's `data` on every rank (ShareFromRankZero), or, where rank 0
// gives `error` (an exception), an error of its class on every rank.
py::bytes CollectiveFromRankZero(py::object group, const std::string& step, const py::bytes& data,
                                 const py::object& error, const std::string& what) {
  TorchCommunicator comm(std::move(group));
  const Status rank0 = error.is_none() ? Status::OK() : StatusOfException(error);
  const std::string mine = data;
  Result<std::string> got = Status::Internal("not run");
  {
    py::gil_scoped_release nogil;
    got = ShareFromRankZero(comm, step, rank0, mine);
  }
  CheckCollective(got.status(), what);
  return py::bytes(*got);
}

// The opening sync of a collective open (ShareOpeningSync): `repo` None
// where this rank's open failed, `error` saying why.
void CollectiveOpenSync(py::object group, PyRepository* repo, const std::optional<std::string>& error,
                        const std::string& what) {
  TorchCommunicator comm(std::move(group));
  Repository* core = repo != nullptr ? &repo->core() : nullptr;
  const std::string said = error.value_or("");
  Status st;
  {
    py::gil_scoped_release nogil;
    st = ShareOpeningSync(error ? nullptr : core, said, comm);
  }
  CheckCollective(st, what);
}

// Step 1 of a collective save (PlanCollectiveSave): ([put each entry],
// unique bytes, held bytes, [bytes per rank]). `error`: this rank's
// failure to describe its values; `digests` (16 bytes each, one per
// entry) with verify_replicas.
py::tuple CollectivePlanSave(py::object group, const std::string& name, const std::vector<PlanTuple>& entries,
                             const std::optional<std::string>& error, const std::vector<std::string>& digests,
                             bool verify_replicas, const std::string& what) {
  Status local = error ? Status::InvalidArgument(*error) : Status::OK();
  std::vector<PlanEntry> mine;
  for (size_t i = 0; local.ok() && i < entries.size(); ++i) {
    try {
      mine.push_back(ToPlanEntry(entries[i]));
    } catch (const StatusError& e) {
      local = e.status.WithContext("'" + std::get<0>(entries[i]).substr(0, std::get<0>(entries[i]).find('\0')) + "'");
    }
  }
  std::vector<ChunkId> ids;
  for (size_t i = 0; local.ok() && i < digests.size(); ++i) {
    ChunkId id;
    if (digests[i].size() != id.bytes.size()) {
      local = Status::InvalidArgument("a digest is 16 bytes");
      break;
    }
    std::memcpy(id.bytes.data(), digests[i].data(), id.bytes.size());
    ids.push_back(id);
  }
  TorchCommunicator comm(std::move(group));
  Result<CollectiveSavePlan> plan = Status::Internal("not run");
  {
    py::gil_scoped_release nogil;
    plan = PlanCollectiveSave(comm, name, mine, local, ids, verify_replicas);
  }
  CheckCollective(plan.status(), what);
  return py::make_tuple(std::vector<bool>(plan->put.begin(), plan->put.end()), plan->unique_bytes,
                        plan->held_bytes, plan->bytes_per_rank);
}

// The one line a command-line process prints when a memory-mapped input
// faults (truncated while read) instead of dying with "Bus error".
char g_bus_error_message[512];
size_t g_bus_error_length = 0;
extern "C" void OnBusError(int) {
  ssize_t ignored = ::write(STDERR_FILENO, g_bus_error_message, g_bus_error_length);
  (void)ignored;
  ::_exit(1);
}

}  // namespace
}  // namespace ckptfs::python

using namespace ckptfs;
using namespace ckptfs::python;

PYBIND11_MODULE(_core, m) {
  m.doc() = "C++ core of ckptfs (use the ckptfs package, not this module)";
  m.attr("__version__") = CKPTFS_VERSION;
  m.attr("STAGE_MIN_BYTES") = StagedCopy::kMinBytes;
  m.def("release_staging_memory", [] { return StagingCache::Get().Release(); });
  m.def("note_staged_save", [](uint64_t bytes) { StagingCache::Get().NoteSave(bytes); }, py::arg("nbytes"));

  g_error = NewErrorClass(m, "Error", PyExc_Exception, nullptr, "An error from ckptfs; str() is a one-line message.");
  g_not_found = NewErrorClass(m, "NotFoundError", g_error, PyExc_LookupError,
                              "A repository, checkpoint, tensor or blob does not exist.");
  g_invalid = NewErrorClass(m, "InvalidArgumentError", g_error, PyExc_ValueError,
                            "Arguments that do not fit (dtype, shape, region, name, option).");
  g_exists = NewErrorClass(m, "AlreadyExistsError", g_error, nullptr, "A name is taken (a committed checkpoint).");
  g_corruption = NewErrorClass(m, "CorruptionError", g_error, nullptr, "Stored bytes fail a check.");
  g_io = NewErrorClass(m, "StorageError", g_error, PyExc_OSError, "The operating system refused an operation (disk full, permissions).");
  g_unsupported = NewErrorClass(m, "UnsupportedError", g_error, nullptr, "Valid, but not handled by this build.");
  g_collective = NewErrorClass(m, "CollectiveError", g_error, nullptr,
                               "A collective save or load failed on some rank; raised on every rank.");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      PyObject* cls = e.status.detail() == StatusDetail::kCollective ? g_collective : ErrorClassFor(e.status.code());
      PyErr_SetString(cls, e.status.message().c_str());
    }
  });

  m.def("collective_agree", &CollectiveAgree, py::arg("group"), py::arg("step"), py::arg("error"), py::arg("what"),
        "Every rank's agreement on a collective step: raises CollectiveError on every rank when `error` is given "
        "on any.");
  m.def("collective_from_rank_0", &CollectiveFromRankZero, py::arg("group"), py::arg("step"), py::arg("data"),
        py::arg("error"), py::arg("what"),
        "Rank 0's bytes on every rank, or rank 0's `error` (an exception) raised as its class on every rank.");
  m.def("collective_open_sync", &CollectiveOpenSync, py::arg("group"), py::arg("repo"), py::arg("error"),
        py::arg("what"), "The opening sync of a collective open: one listing of the store for the group.");
  m.def("collective_plan_save", &CollectivePlanSave, py::arg("group"), py::arg("name"), py::arg("entries"),
        py::arg("error"), py::arg("digests"), py::arg("verify_replicas"), py::arg("what"),
        "Step 1 of a collective save: ([put each entry], unique bytes, held bytes, [bytes per rank]).");
  m.def("deliver_on_device", [](const std::vector<std::optional<std::string>>& tokens) {
    std::vector<std::string> t;
    for (const auto& x : tokens) t.push_back(x.value_or(""));
    return DeliverOnDevice(t);
  }, py::arg("tokens"), "Whether a collective load's regions travel device to device, given every rank's device token.");
  m.def("read_shared_tier", [](const std::string& fast_path) { return Value(ReadSharedTier(fast_path)); },
        py::arg("fast_path"));
  m.def("write_shared_tier", [](const std::string& fast_path, const std::string& url) {
    Check(WriteSharedTier(fast_path, url));
  }, py::arg("fast_path"), py::arg("url"));
  m.def("new_save_attempt", &NewSaveAttempt,
        "A new save attempt: every rank of one save passes the same to begin (WriterOptions::attempt).");
  m.def("digest", [](py::buffer data) {
    py::buffer_info b = data.request();
    if (!PyBuffer_IsContiguous(b.view(), 'C')) throw StatusError{Status::InvalidArgument("not contiguous memory")};
    std::span<const std::byte> bytes(static_cast<const std::byte*>(b.ptr), static_cast<size_t>(b.size * b.itemsize));
    ChunkId id;
    {
      py::gil_scoped_release nogil;
      id = ChunkId::Of(bytes);
    }
    return id.ToHex();
  }, py::arg("data"), "The XXH3-128 of a contiguous buffer's bytes, in hex (a chunk id's hash), computed without the GIL.");
  m.def("check_input_file", [](const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) Check(Status::FromErrno(errno, "opening " + path));
    const Status st = RefusePseudoFile(fd, path);
    ::close(fd);
    Check(st);
  }, py::arg("path"), "Raises InvalidArgumentError when `path` is a file of a kernel filesystem (procfs, sysfs and the like), whose "
     "size is not what reading it gives.");
  m.def("exit_on_bus_error", [](const std::string& message) {
    g_bus_error_length = std::min(message.size(), sizeof g_bus_error_message);
    std::memcpy(g_bus_error_message, message.data(), g_bus_error_length);
    std::signal(SIGBUS, OnBusError);
  }, py::arg("message"), "For a command-line process: a fault of a memory-mapped input (a file truncated while it is read) prints "
     "`message` and exits 1, instead of dying with 'Bus error'.");
  m.def("cuda_available", [] {
    std::string why;
    bool ok = gpu::CudaAvailable(&why);
    return std::make_pair(ok, why);
  }, "(available, reason): whether this build can stage through a GPU, and why not.");

  py::class_<SaveHandle>(m, "SaveHandle")
      .def("done", &SaveHandle::done)
      .def("wait", &SaveHandle::wait, py::arg("timeout") = py::none())
      .def("result", &SaveHandle::result)
      .def_property_readonly("blocking_seconds", &SaveHandle::blocking_seconds);

  py::class_<Writer>(m, "Writer")
      .def("put", &Writer::put, py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("kind"),
           py::arg("local_shape"), py::arg("offsets"), py::arg("start"), py::arg("address"), py::arg("nbytes"),
           py::arg("device"), py::arg("stage") = false)
      .def("put_file", &Writer::put_file, py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("kind"),
           py::arg("local_shape"), py::arg("offsets"), py::arg("start"), py::arg("path"), py::arg("file_offset"),
           py::arg("bytes"))
      .def("put_blob", &Writer::put_blob, py::arg("name"), py::arg("data"))
      .def("begin_blob", &Writer::begin_blob, py::arg("name"))
      .def("append_blob", &Writer::append_blob, py::arg("data"), py::arg("unit") = false, py::arg("dtype") = "U8")
      .def("end_blob", &Writer::end_blob)
      .def("commit", &Writer::commit, py::arg("snapshot"))
      .def("abort", &Writer::abort);

  py::class_<StagingBuffer>(m, "StagingBuffer", py::buffer_protocol())
      .def(py::init<uint64_t>(), py::arg("nbytes"))
      .def("copy_from", &StagingBuffer::copy_from, py::arg("address"), py::arg("nbytes"))
      .def_buffer([](StagingBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {static_cast<py::ssize_t>(1)});
      });

  py::class_<Reader>(m, "Reader")
      .def("tensors", &Reader::tensors)
      .def("blobs", &Reader::blobs)
      .def("identity", &Reader::identity)
      .def("tensor_info", &Reader::tensor_info, py::arg("name"))
      .def("read", &Reader::read, py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("kind"),
           py::arg("local_shape"), py::arg("offsets"), py::arg("start"), py::arg("address"), py::arg("nbytes"),
           py::arg("device"))
      .def("blob", &Reader::blob, py::arg("name"))
      .def("read_blob", &Reader::read_blob, py::arg("name"), py::arg("offset"), py::arg("out"))
      .def("read_blob_bytes", &Reader::read_blob_bytes, py::arg("name"), py::arg("offset"), py::arg("size"))
      .def("show", &Reader::show);

  py::class_<PyRepository>(m, "Repository")
      .def_static("init", &PyRepository::Init, py::arg("path"), py::arg("chunk_size"), py::arg("pack_size"),
                  py::arg("compression"), py::arg("level"), py::arg("adaptive"), py::arg("cache_dir"))
      .def_static("open", &PyRepository::Open, py::arg("path"), py::arg("threads"), py::arg("cache_bytes"),
                  py::arg("cache_dir"), py::arg("io_threads"), py::arg("opening_sync") = true)
      .def_property_readonly("path", &PyRepository::path)
      .def_property_readonly("config", &PyRepository::config)
      .def("describe_import", &PyRepository::describe_import, py::arg("paths"), py::arg("blob_files"),
           py::arg("follow_symlinks") = false)
      .def("import_safetensors", &PyRepository::import_safetensors, py::arg("name"), py::arg("paths"),
           py::arg("blob_files"), py::arg("rank"), py::arg("world_size"), py::arg("step"), py::arg("tags"),
           py::arg("follow_symlinks") = false, py::arg("overwrite") = false)
      .def("begin", &PyRepository::begin, py::arg("name"), py::arg("rank"), py::arg("world_size"), py::arg("step"),
           py::arg("tags"), py::arg("compress_every_chunk") = false, py::arg("attempt") = "",
           py::arg("overwrite") = false)
      .def("begin_collective", &PyRepository::begin_collective, py::arg("group"), py::arg("name"), py::arg("step"),
           py::arg("tags"), py::arg("await_ranks"), py::arg("attempt"), py::arg("overwrite"), py::arg("what"))
      .def("load_collective", &PyRepository::load_collective, py::arg("group"), py::arg("name"), py::arg("targets"),
           py::arg("error"), py::arg("device_token"), py::arg("progress"), py::arg("what"),
           py::arg("nearer") = std::vector<PyRepository*>{})
      .def("open_checkpoint", &PyRepository::open_checkpoint, py::arg("name"), py::arg("lease") = true,
           py::arg("nearer") = std::vector<PyRepository*>{})
      .def("tier_status", &PyRepository::tier_status, py::arg("shared"))
      .def("tier_status_and_trim", &PyRepository::tier_status_and_trim, py::arg("shared"), py::arg("keep_last"))
      .def("drain", &PyRepository::drain, py::arg("shared"), py::arg("names"), py::arg("on_phase"))
      .def("plan_fast_trim", &PyRepository::plan_fast_trim, py::arg("shared"), py::arg("keep_last"),
           py::arg("short_of_space") = false)
      .def("undrained", &PyRepository::undrained, py::arg("shared"))
      .def("replicate", &PyRepository::replicate, py::arg("group"), py::arg("name"), py::arg("replicas"),
           py::arg("jump"), py::arg("what"), py::arg("back") = false, py::arg("strategy") = "ring")
      .def("checkpoints", &PyRepository::checkpoints, py::arg("include_pending"))
      .def("refresh", &PyRepository::refresh)
      .def("pending_ranks", &PyRepository::pending_ranks, py::arg("name"))
      .def("rm", &PyRepository::rm, py::arg("names"))
      .def("compose", &PyRepository::compose, py::arg("name"), py::arg("blobs"), py::arg("step"), py::arg("tags"),
           py::arg("overwrite"), py::arg("tensors") = std::vector<PyRepository::TensorFromTuple>{})
      .def("stats", &PyRepository::stats, py::arg("name"), py::arg("tensors"))
      .def("gc", &PyRepository::gc, py::arg("keep_last"), py::arg("keep_every"), py::arg("keep_within"),
           py::arg("keep"), py::arg("allow_removing_newest"), py::arg("dry_run"),
           py::arg("rewrite_below"), py::arg("on_phase"), py::arg("progress"), py::arg("group") = "",
           py::arg("thin_older_than") = std::nullopt, py::arg("thin_keep") = std::vector<std::string>{},
           py::arg("held") = std::vector<std::pair<std::string, std::string>>{})
      .def("verify", &PyRepository::verify, py::arg("name"))
      .def("diff", &PyRepository::diff, py::arg("a"), py::arg("b"))
      .def("du", &PyRepository::du, py::arg("names"), py::arg("by_kind") = false)
      .def("copy_to", &PyRepository::copy_to, py::arg("destination"), py::arg("names"), py::arg("all"),
           py::arg("last"), py::arg("on_phase"), py::arg("progress"))
      .def("buffer_stats", &PyRepository::buffer_stats)
      .def("store_counters", &PyRepository::store_counters);
}
