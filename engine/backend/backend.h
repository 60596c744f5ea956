// Object backend: where packs and manifests live.
//
// A small object interface that both a local directory and an object store
// (S3 API) can implement. Keys are relative paths of [A-Za-z0-9._-] segments
// joined by '/'; a segment never starts with '.'.
//
// Contracts every implementation honours (tests/backend_conformance_test.cc):
//   - An object becomes visible only complete: Put and ObjectWriter::Commit
//     are atomic, and when they return OK the object is durable.
//   - Objects are never modified in place; Put over an existing key replaces
//     it atomically.
//   - ReadRange reads exactly the requested bytes or fails; reading past the
//     end is an error, never a short read.
//   - List returns keys with the prefix, sorted, including only committed objects.
//   - Delete of a missing key returns NotFound.
// Thread safety: all methods may be called concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace ckptfs {

// Streams a new object. Not thread-safe; one writer per object.
class ObjectWriter {
 public:
  virtual ~ObjectWriter() = default;
  // Appends bytes. May start writing them back to stable storage.
  virtual Status Append(std::span<const std::byte> data) = 0;
  // Makes the object durable and visible under its key. The writer is
  // finished afterwards, whatever the result.
  virtual Status Commit() = 0;
  // Discards everything written. Also what the destructor does when neither
  // Commit nor Abort was called.
  virtual void Abort() = 0;
  virtual uint64_t size() const = 0;
};

// Requests a backend has sent to an object store, by kind, retries
// included (all zero for local backends). Benchmarks and tests use them to
// show what an operation costs in requests.
struct RequestCounts {
  uint64_t get = 0;     // object and ranged reads
  uint64_t list = 0;    // listing pages
  uint64_t put = 0;     // objects and multipart parts
  uint64_t post = 0;    // multipart starts and completions
  uint64_t head = 0;
  uint64_t del = 0;
  uint64_t total() const { return get + list + put + post + head + del; }
  RequestCounts operator-(const RequestCounts& o) const {
    return {get - o.get, list - o.list, put - o.put, post - o.post, head - o.head, del - o.del};
  }
};

// An object a listing found, and a tag that changes when its key is written
// again with other bytes (an object store's ETag; a file's inode, size and
// modification time). Empty where the backend cannot tell.
struct ListedObject {
  std::string key;
  std::string tag;
};

// Bounds of whole-object reads: any object (a manifest of a checkpoint with
// millions of tensors stays far below it), and the small objects a
// repository holds (its config, lock and claim objects).
inline constexpr uint64_t kMaxWholeObject = 1ull << 30;
inline constexpr uint64_t kMaxSmallObject = 1ull << 20;

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Result<std::unique_ptr<ObjectWriter>> Create(std::string_view key) = 0;
  // Create + Append + Commit.
  virtual Status Put(std::string_view key, std::span<const std::byte> data);
  // Put only if no object has the key: AlreadyExists, and nothing changed,
  // when one has. Of writers racing on one key exactly one succeeds.
  virtual Status PutIfAbsent(std::string_view key, std::span<const std::byte> data) = 0;
  virtual Status ReadRange(std::string_view key, uint64_t offset, std::span<std::byte> out) = 0;
  // Whole object. An object larger than `max_bytes` is refused
  // (ResourceExhausted naming the key and the bound) before its bytes are
  // read: a store may hold anything under a key, and callers bound each
  // kind of object by the largest it can legitimately be.
  virtual Result<std::string> ReadAll(std::string_view key, uint64_t max_bytes = kMaxWholeObject);
  virtual Result<uint64_t> Size(std::string_view key) = 0;
  virtual Result<std::vector<std::string>> List(std::string_view prefix) = 0;
  // List, with each object's tag (ListedObject), in the same request(s) as
  // List where the backend can. The default lists without tags.
  virtual Result<std::vector<ListedObject>> ListTagged(std::string_view prefix);
  // The tag ListTagged gives object `key` (NotFound when there is none): one
  // request on an object store (a HEAD). The default lists the key.
  virtual Result<std::string> Tag(std::string_view key);
  virtual Status Delete(std::string_view key) = 0;
  // Removes what writers that never committed left behind (temporary files,
  // unfinished uploads). Only safe while no writer is active.
  // Returns the bytes it removed, where the backend knows them (an object
  // store's unfinished uploads count 0).
  virtual Result<uint64_t> RemoveIncomplete() { return uint64_t{0}; }
  // A short description for messages ("local:/data/repo/objects").
  virtual std::string Describe() const = 0;
  // Requests sent so far (see RequestCounts).
  virtual RequestCounts Requests() const { return {}; }
  // True when ReadRange's bytes are written into `out` by the kernel
  // (pread), false when user-space code copies them there (a network
  // client's receive buffer). See ReadChunk.
  virtual bool ReadsWithKernelCopy() const { return false; }
};

// Forwards every call to another backend: the base of backends that change
// a few calls of another (a test's full disk or failing store), which then
// override only those.
class BackendWrapper : public Backend {
 public:
  explicit BackendWrapper(std::shared_ptr<Backend> inner) : inner_(std::move(inner)) {}
  Result<std::unique_ptr<ObjectWriter>> Create(std::string_view key) override { return inner_->Create(key); }
  Status Put(std::string_view key, std::span<const std::byte> data) override { return inner_->Put(key, data); }
  Status PutIfAbsent(std::string_view key, std::span<const std::byte> data) override {
    return inner_->PutIfAbsent(key, data);
  }
  Status ReadRange(std::string_view key, uint64_t offset, std::span<std::byte> out) override {
    return inner_->ReadRange(key, offset, out);
  }
  Result<std::string> ReadAll(std::string_view key, uint64_t max_bytes = kMaxWholeObject) override {
    return inner_->ReadAll(key, max_bytes);
  }
  Result<uint64_t> Size(std::string_view key) override { return inner_->Size(key); }
  Result<std::vector<std::string>> List(std::string_view prefix) override { return inner_->List(prefix); }
  Result<std::vector<ListedObject>> ListTagged(std::string_view prefix) override {
    return inner_->ListTagged(prefix);
  }
  Result<std::string> Tag(std::string_view key) override { return inner_->Tag(key); }
  Status Delete(std::string_view key) override { return inner_->Delete(key); }
  Result<uint64_t> RemoveIncomplete() override { return inner_->RemoveIncomplete(); }
  std::string Describe() const override { return inner_->Describe(); }
  RequestCounts Requests() const override { return inner_->Requests(); }
  bool ReadsWithKernelCopy() const override { return inner_->ReadsWithKernelCopy(); }

 protected:
  Backend& inner() const { return *inner_; }

 private:
  std::shared_ptr<Backend> inner_;
};

// True when `key` is a valid object key.
bool IsValidObjectKey(std::string_view key);

// Objects as files under `root` (created if missing). Writes go to a hidden
// temporary file that is fsync'd and renamed into place, then the directory
// is fsync'd. Writeback is started as data is appended so that a Commit does
// not wait on one large flush.
Result<std::unique_ptr<Backend>> OpenLocalBackend(const std::string& root);

// Objects in memory: the reference implementation for tests.
std::unique_ptr<Backend> NewMemoryBackend();

// The objects of `store` under `prefix` (a valid key), as a backend of
// their own: key K here is PREFIX/K there. Shares `store` with its other
// users; requests are counted by `store`.
std::unique_ptr<Backend> NewPrefixedBackend(std::shared_ptr<Backend> store, std::string prefix);

}  // namespace ckptfs
