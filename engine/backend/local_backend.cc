// The local directory backend.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <list>
#include <mutex>
#include <unordered_map>

#include "backend/backend.h"
#include "backend/durable_file.h"
#include "core/crash_point.h"
#include "core/random.h"

namespace ckptfs {
namespace {

Status MakeDirs(const std::string& path) {
  size_t pos = 0;
  while (true) {
    pos = path.find('/', pos + 1);
    std::string part = path.substr(0, pos);
    if (!part.empty() && ::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) {
      return Status::FromErrno(errno, "creating directory " + part);
    }
    if (pos == std::string::npos) return Status::OK();
  }
}


class LocalBackend final : public Backend {
 public:
  explicit LocalBackend(std::string root) : root_(std::move(root)) {}

  // An object is a DurableFile under a hidden temporary name.
  class Writer final : public ObjectWriter {
   public:
    explicit Writer(std::unique_ptr<DurableFile> file) : file_(std::move(file)) {}
    Status Append(std::span<const std::byte> data) override { return file_->Append(data); }
    Status Commit() override { return file_->Commit(); }
    void Abort() override { file_->Abort(); }
    uint64_t size() const override { return file_->size(); }

   private:
    std::unique_ptr<DurableFile> file_;
  };

  Result<std::unique_ptr<ObjectWriter>> Create(std::string_view key) override {
    CKPT_RETURN_IF_ERROR(CheckKey(key));
    std::string path = Path(key);
    std::string dir = path.substr(0, path.rfind('/'));
    CKPT_RETURN_IF_ERROR(MakeDirs(dir));
    CKPT_ASSIGN_OR_RETURN(auto file, DurableFile::Create(path, dir + "/.tmp-" + RandomHex(16)));
    EvictFd(path);
    return std::unique_ptr<ObjectWriter>(new Writer(std::move(file)));
  }

  Status PutIfAbsent(std::string_view key, std::span<const std::byte> data) override {
    CKPT_RETURN_IF_ERROR(CheckKey(key));
    std::string path = Path(key);
    std::string dir = path.substr(0, path.rfind('/'));
    CKPT_RETURN_IF_ERROR(MakeDirs(dir));
    CKPT_ASSIGN_OR_RETURN(auto file, DurableFile::Create(path, dir + "/.tmp-" + RandomHex(16)));
    CKPT_RETURN_IF_ERROR(file->Append(data));
    EvictFd(path);
    Status st = file->Commit(/*replace=*/false);
    if (st.IsAlreadyExists()) return Status::AlreadyExists("object '" + std::string(key) + "' exists in " + Describe());
    return st;
  }

  Status ReadRange(std::string_view key, uint64_t offset, std::span<std::byte> out) override {
    CKPT_RETURN_IF_ERROR(CheckKey(key));
    CKPT_ASSIGN_OR_RETURN(auto file, OpenFd(Path(key)));
    size_t done = 0;
    while (done < out.size()) {
      ssize_t r = ::pread(file->fd, out.data() + done, out.size() - done,
                          static_cast<off_t>(offset + done));
      if (r < 0) {
        if (errno == EINTR) continue;
        return Status::FromErrno(errno, "reading " + Path(key));
      }
      if (r == 0) {
        return Status::InvalidArgument("read of " + std::to_string(out.size()) + " bytes at " +
                                       std::to_string(offset) + " is past the end of " + Path(key));
      }
      done += static_cast<size_t>(r);
    }
    return Status::OK();
  }

  bool ReadsWithKernelCopy() const override { return true; }

  Result<uint64_t> Size(std::string_view key) override {
    CKPT_RETURN_IF_ERROR(CheckKey(key));
    struct stat st;
    std::string path = Path(key);
    if (::stat(path.c_str(), &st) != 0) return Status::FromErrno(errno, "stat of " + path);
    return static_cast<uint64_t>(st.st_size);
  }

  Result<std::vector<std::string>> List(std::string_view prefix) override {
    std::vector<std::string> keys;
    // Walk from the deepest directory the prefix names.
    std::string p(prefix);
    std::string dir_rel = p.substr(0, p.rfind('/') == std::string::npos ? 0 : p.rfind('/'));
    CKPT_RETURN_IF_ERROR(Walk(dir_rel, p, keys));
    std::sort(keys.begin(), keys.end());
    return keys;
  }

  // Every write replaces the file (a rename), so a key written again has
  // another inode or modification time.
  Result<std::vector<ListedObject>> ListTagged(std::string_view prefix) override {
    CKPT_ASSIGN_OR_RETURN(std::vector<std::string> keys, List(prefix));
    std::vector<ListedObject> out;
    out.reserve(keys.size());
    for (std::string& k : keys) {
      struct stat st;
      if (::stat(Path(k).c_str(), &st) != 0) {
        if (errno == ENOENT) continue;  // deleted since the listing
        return Status::FromErrno(errno, "stat of " + Path(k));
      }
      std::string tag = std::to_string(st.st_ino) + "-" + std::to_string(st.st_size) + "-" +
                        std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec);
      out.push_back({std::move(k), std::move(tag)});
    }
    return out;
  }

  Status Delete(std::string_view key) override {
    CKPT_RETURN_IF_ERROR(CheckKey(key));
    std::string path = Path(key);
    EvictFd(path);
    CrashPoint();
    if (::unlink(path.c_str()) != 0) return Status::FromErrno(errno, "deleting " + path);
    CrashPoint();
    return FsyncDir(path.substr(0, path.rfind('/')));
  }

  Result<uint64_t> RemoveIncomplete() override {
    uint64_t bytes = 0;
    CKPT_RETURN_IF_ERROR(RemoveTemporaries(root_, &bytes));
    return bytes;
  }

  std::string Describe() const override { return "local:" + root_; }

 private:
  struct Fd {
    explicit Fd(int f) : fd(f) {}
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    ~Fd() { ::close(fd); }
    int fd;
  };

  Status CheckKey(std::string_view key) const {
    if (!IsValidObjectKey(key)) return Status::InvalidArgument("invalid object key '" + std::string(key) + "'");
    return Status::OK();
  }
  std::string Path(std::string_view key) const { return root_ + "/" + std::string(key); }

  Result<std::shared_ptr<Fd>> OpenFd(const std::string& path) {
    {
      std::lock_guard lock(mu_);
      auto it = fds_.find(path);
      if (it != fds_.end()) return it->second;
    }
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Status::FromErrno(errno, "opening " + path);
    auto file = std::make_shared<Fd>(fd);
    std::lock_guard lock(mu_);
    if (fds_.size() >= kMaxOpenFiles) fds_.clear();
    fds_.emplace(path, file);
    return file;
  }

  void EvictFd(const std::string& path) {
    std::lock_guard lock(mu_);
    fds_.erase(path);
  }

  static Status RemoveTemporaries(const std::string& dir, uint64_t* bytes) {
    DIR* d = ::opendir(dir.c_str());
    if (!d) return errno == ENOENT ? Status::OK() : Status::FromErrno(errno, "listing " + dir);
    Status st;
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      std::string path = dir + "/" + name;
      struct stat sb;
      if (::lstat(path.c_str(), &sb) != 0) continue;
      if (S_ISDIR(sb.st_mode)) {
        st = RemoveTemporaries(path, bytes);
        if (!st.ok()) break;
      } else if (name.rfind(".tmp-", 0) == 0) {
        if (::unlink(path.c_str()) == 0) {
          *bytes += static_cast<uint64_t>(sb.st_size);
        } else if (errno != ENOENT) {
          st = Status::FromErrno(errno, "removing " + path);
          break;
        }
      }
    }
    ::closedir(d);
    return st;
  }

  Status Walk(const std::string& dir_rel, const std::string& prefix, std::vector<std::string>& keys) {
    std::string dir = dir_rel.empty() ? root_ : root_ + "/" + dir_rel;
    DIR* d = ::opendir(dir.c_str());
    if (!d) {
      if (errno == ENOENT || errno == ENOTDIR) return Status::OK();
      return Status::FromErrno(errno, "listing " + dir);
    }
    Status st;
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name.empty() || name[0] == '.') continue;  // ., .., temporaries
      std::string rel = dir_rel.empty() ? name : dir_rel + "/" + name;
      bool is_dir = e->d_type == DT_DIR;
      if (e->d_type == DT_UNKNOWN) {
        struct stat sb;
        is_dir = ::stat((root_ + "/" + rel).c_str(), &sb) == 0 && S_ISDIR(sb.st_mode);
      }
      if (is_dir) {
        // Descend only where keys under it can match the prefix.
        std::string as_prefix = rel + "/";
        if (prefix.compare(0, std::min(prefix.size(), as_prefix.size()), as_prefix, 0,
                           std::min(prefix.size(), as_prefix.size())) == 0) {
          st = Walk(rel, prefix, keys);
          if (!st.ok()) break;
        }
      } else if (rel.compare(0, prefix.size(), prefix) == 0) {
        keys.push_back(rel);
      }
    }
    ::closedir(d);
    return st;
  }

  static constexpr size_t kMaxOpenFiles = 256;
  std::string root_;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Fd>> fds_;
};

}  // namespace

Result<std::unique_ptr<Backend>> OpenLocalBackend(const std::string& root) {
  CKPT_RETURN_IF_ERROR(MakeDirs(root));
  return std::unique_ptr<Backend>(new LocalBackend(root));
}

}  // namespace ckptfs
