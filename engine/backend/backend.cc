#include "backend/backend.h"

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>

namespace ckptfs {

bool IsValidObjectKey(std::string_view key) {
  if (key.empty() || key.size() > 1024) return false;
  size_t start = 0;
  while (start <= key.size()) {
    size_t end = key.find('/', start);
    if (end == std::string_view::npos) end = key.size();
    std::string_view seg = key.substr(start, end - start);
    if (seg.empty() || seg[0] == '.') return false;
    for (char c : seg) {
      bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '.' || c == '_' || c == '-' || c == '~';
      if (!ok) return false;
    }
    start = end + 1;
  }
  return true;
}

Status Backend::Put(std::string_view key, std::span<const std::byte> data) {
  CKPT_ASSIGN_OR_RETURN(auto writer, Create(key));
  Status st = writer->Append(data);
  if (!st.ok()) {
    writer->Abort();
    return st;
  }
  return writer->Commit();
}

Result<std::string> Backend::ReadAll(std::string_view key, uint64_t max_bytes) {
  CKPT_ASSIGN_OR_RETURN(uint64_t size, Size(key));
  if (size > max_bytes) {
    return Status::ResourceExhausted("object '" + std::string(key) + "' in " + Describe() + " is " +
                                     std::to_string(size) + " bytes, more than the " + std::to_string(max_bytes) +
                                     " such an object may have");
  }
  std::string out(size, '\0');
  CKPT_RETURN_IF_ERROR(ReadRange(key, 0, std::as_writable_bytes(std::span(out.data(), out.size()))));
  return out;
}

Result<std::vector<ListedObject>> Backend::ListTagged(std::string_view prefix) {
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> keys, List(prefix));
  std::vector<ListedObject> out;
  out.reserve(keys.size());
  for (std::string& k : keys) out.push_back({std::move(k), ""});
  return out;
}

Result<std::string> Backend::Tag(std::string_view key) {
  CKPT_ASSIGN_OR_RETURN(std::vector<ListedObject> listed, ListTagged(key));
  for (ListedObject& o : listed) {
    if (o.key == key) return std::move(o.tag);
  }
  return Status::NotFound("no object '" + std::string(key) + "' in " + Describe());
}

namespace {

class MemoryBackend final : public Backend {
 public:
  class Writer final : public ObjectWriter {
   public:
    Writer(MemoryBackend* owner, std::string key) : owner_(owner), key_(std::move(key)) {}
    Status Append(std::span<const std::byte> data) override {
      if (done_) return Status::FailedPrecondition("object writer already finished");
      buf_.append(reinterpret_cast<const char*>(data.data()), data.size());
      return Status::OK();
    }
    Status Commit() override {
      if (done_) return Status::FailedPrecondition("object writer already finished");
      done_ = true;
      std::lock_guard lock(owner_->mu_);
      owner_->objects_[key_] = std::make_shared<const std::string>(std::move(buf_));
      return Status::OK();
    }
    void Abort() override { done_ = true; buf_.clear(); }
    uint64_t size() const override { return buf_.size(); }

   private:
    MemoryBackend* owner_;
    std::string key_;
    std::string buf_;
    bool done_ = false;
  };

  Result<std::unique_ptr<ObjectWriter>> Create(std::string_view key) override {
    if (!IsValidObjectKey(key)) return Status::InvalidArgument("invalid object key '" + std::string(key) + "'");
    return std::unique_ptr<ObjectWriter>(new Writer(this, std::string(key)));
  }

  Status PutIfAbsent(std::string_view key, std::span<const std::byte> data) override {
    if (!IsValidObjectKey(key)) return Status::InvalidArgument("invalid object key '" + std::string(key) + "'");
    std::lock_guard lock(mu_);
    auto [it, added] = objects_.try_emplace(std::string(key));
    if (!added) return Status::AlreadyExists("object '" + std::string(key) + "' exists");
    it->second = std::make_shared<const std::string>(reinterpret_cast<const char*>(data.data()), data.size());
    return Status::OK();
  }

  Status ReadRange(std::string_view key, uint64_t offset, std::span<std::byte> out) override {
    CKPT_ASSIGN_OR_RETURN(auto obj, Get(key));
    if (offset > obj->size() || out.size() > obj->size() - offset) {
      return Status::InvalidArgument("read of " + std::to_string(out.size()) + " bytes at " +
                                     std::to_string(offset) + " is past the end of '" +
                                     std::string(key) + "' (" + std::to_string(obj->size()) + " bytes)");
    }
    std::copy_n(reinterpret_cast<const std::byte*>(obj->data()) + offset, out.size(), out.data());
    return Status::OK();
  }

  Result<uint64_t> Size(std::string_view key) override {
    CKPT_ASSIGN_OR_RETURN(auto obj, Get(key));
    return static_cast<uint64_t>(obj->size());
  }

  Result<std::vector<std::string>> List(std::string_view prefix) override {
    std::lock_guard lock(mu_);
    std::vector<std::string> keys;
    for (auto it = objects_.lower_bound(std::string(prefix)); it != objects_.end(); ++it) {
      if (it->first.compare(0, prefix.size(), prefix) != 0) break;
      keys.push_back(it->first);
    }
    return keys;
  }

  // Tagged by content, as an object store's ETag is.
  Result<std::vector<ListedObject>> ListTagged(std::string_view prefix) override {
    std::lock_guard lock(mu_);
    std::vector<ListedObject> out;
    for (auto it = objects_.lower_bound(std::string(prefix)); it != objects_.end(); ++it) {
      if (it->first.compare(0, prefix.size(), prefix) != 0) break;
      out.push_back({it->first, std::to_string(std::hash<std::string>{}(*it->second)) + "-" +
                                    std::to_string(it->second->size())});
    }
    return out;
  }

  Status Delete(std::string_view key) override {
    std::lock_guard lock(mu_);
    auto it = objects_.find(std::string(key));
    if (it == objects_.end()) return Status::NotFound("no object '" + std::string(key) + "'");
    objects_.erase(it);
    return Status::OK();
  }

  std::string Describe() const override { return "memory"; }

 private:
  Result<std::shared_ptr<const std::string>> Get(std::string_view key) {
    std::lock_guard lock(mu_);
    auto it = objects_.find(std::string(key));
    if (it == objects_.end()) return Status::NotFound("no object '" + std::string(key) + "'");
    return it->second;
  }

  std::mutex mu_;
  std::map<std::string, std::shared_ptr<const std::string>> objects_;
};

class PrefixedBackend final : public Backend {
 public:
  PrefixedBackend(std::shared_ptr<Backend> store, std::string prefix)
      : store_(std::move(store)), prefix_(std::move(prefix) + "/") {}

  Result<std::unique_ptr<ObjectWriter>> Create(std::string_view key) override { return store_->Create(Key(key)); }
  Status Put(std::string_view key, std::span<const std::byte> data) override { return store_->Put(Key(key), data); }
  Status PutIfAbsent(std::string_view key, std::span<const std::byte> data) override {
    return store_->PutIfAbsent(Key(key), data);
  }
  Status ReadRange(std::string_view key, uint64_t offset, std::span<std::byte> out) override {
    return store_->ReadRange(Key(key), offset, out);
  }
  Result<std::string> ReadAll(std::string_view key, uint64_t max_bytes) override {
    return store_->ReadAll(Key(key), max_bytes);
  }
  Result<uint64_t> Size(std::string_view key) override { return store_->Size(Key(key)); }
  Result<std::vector<std::string>> List(std::string_view prefix) override {
    CKPT_ASSIGN_OR_RETURN(std::vector<std::string> keys, store_->List(Key(prefix)));
    for (std::string& k : keys) k.erase(0, prefix_.size());
    return keys;
  }
  Result<std::vector<ListedObject>> ListTagged(std::string_view prefix) override {
    CKPT_ASSIGN_OR_RETURN(std::vector<ListedObject> listed, store_->ListTagged(Key(prefix)));
    for (ListedObject& o : listed) o.key.erase(0, prefix_.size());
    return listed;
  }
  Result<std::string> Tag(std::string_view key) override { return store_->Tag(Key(key)); }
  Status Delete(std::string_view key) override { return store_->Delete(Key(key)); }
  Result<uint64_t> RemoveIncomplete() override { return store_->RemoveIncomplete(); }
  std::string Describe() const override { return store_->Describe() + "/" + prefix_.substr(0, prefix_.size() - 1); }
  RequestCounts Requests() const override { return store_->Requests(); }
  bool ReadsWithKernelCopy() const override { return store_->ReadsWithKernelCopy(); }

 private:
  std::string Key(std::string_view key) const { return prefix_ + std::string(key); }

  std::shared_ptr<Backend> store_;
  std::string prefix_;  // ends with '/'
};

}  // namespace

std::unique_ptr<Backend> NewMemoryBackend() { return std::make_unique<MemoryBackend>(); }

std::unique_ptr<Backend> NewPrefixedBackend(std::shared_ptr<Backend> store, std::string prefix) {
  return std::make_unique<PrefixedBackend>(std::move(store), std::move(prefix));
}

}  // namespace ckptfs
