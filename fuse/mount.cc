// libfuse3 low-level filesystem over a ckptfs repository.
#define FUSE_USE_VERSION 312
#include "mount.h"

#include <dirent.h>
#include <fuse_lowlevel.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ckpt/repository.h"
#include "ckpt/describe.h"
#include "core/json.h"
#include "io/safetensors.h"
#include "names.h"

namespace ckptfs::mount {
namespace {

// Content inside a checkpoint never changes: the kernel may keep it.
constexpr double kImmutableTimeout = 3600.0;
// The root changes as checkpoints come and go.
constexpr double kRootTimeout = 1.0;

enum class Kind { kRoot, kLatest, kCheckpoint, kTensor, kSafetensors, kMetadata, kBlobsDir, kBlob };

// Everything the mount shows of one committed checkpoint; immutable once built.
struct CheckpointView {
  std::string name;
  uint64_t sequence = 0;
  uint64_t mtime = 0;  // commit time, seconds
  std::unique_ptr<CheckpointReader> reader;
  std::vector<std::string> tensor_files;  // per tensor (reader order)
  std::vector<std::string> npy_headers;
  std::vector<std::string> blob_files;
  std::map<std::string, size_t> tensor_by_file, blob_by_file;
  SafetensorsLayout safetensors;
  std::string metadata;
};

struct Node {
  Kind kind;
  std::shared_ptr<CheckpointView> view;  // null for root and latest
  size_t index = 0;                      // tensor or blob
  uint64_t lookups = 0;
};

struct DirEntry {
  std::string name;
  fuse_ino_t ino;
  mode_t mode;
};

struct OpenFile {
  std::shared_ptr<CheckpointView> view;
  Kind kind;
  size_t index;
  std::mutex mu;
  uint64_t next_offset = 0;       // furthest byte a reader reached
  uint64_t prefetched_until = 0;  // tensor bytes already asked for
};

class Filesystem {
 public:
  Filesystem(std::unique_ptr<Repository> repo, const MountOptions& options)
      : repo_(std::move(repo)), options_(options) {
    nodes_[FUSE_ROOT_ID] = Node{Kind::kRoot, nullptr, 0, 1};
    nodes_[kLatestIno] = Node{Kind::kLatest, nullptr, 0, 1};
  }

  void SetSession(fuse_session* se) { session_ = se; }

  // ---- requests ------------------------------------------------------------

  void Lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
    auto node = GetNode(parent);
    if (!node) return (void)fuse_reply_err(req, ENOENT);
    std::string n = name;
    fuse_ino_t ino = 0;
    if (node->kind == Kind::kRoot) {
      if (n == "latest") {
        if (LatestName().empty()) return (void)fuse_reply_err(req, ENOENT);
        ino = kLatestIno;
      } else {
        auto view = ViewOf(n);
        if (!view.ok()) {
          if (view.status().IsNotFound()) return (void)fuse_reply_err(req, ENOENT);
          return ReplyError(req, view.status());  // damaged records: EIO, logged
        }
        ino = InodeFor(Kind::kCheckpoint, *view, 0);
      }
    } else if (node->kind == Kind::kCheckpoint) {
      const auto& v = node->view;
      if (n == "model.safetensors") {
        ino = InodeFor(Kind::kSafetensors, v, 0);
      } else if (n == "metadata.json") {
        ino = InodeFor(Kind::kMetadata, v, 0);
      } else if (n == "blobs") {
        ino = InodeFor(Kind::kBlobsDir, v, 0);
      } else if (auto it = v->tensor_by_file.find(n); it != v->tensor_by_file.end()) {
        ino = InodeFor(Kind::kTensor, v, it->second);
      } else {
        return (void)fuse_reply_err(req, ENOENT);
      }
    } else if (node->kind == Kind::kBlobsDir) {
      auto it = node->view->blob_by_file.find(n);
      if (it == node->view->blob_by_file.end()) return (void)fuse_reply_err(req, ENOENT);
      ino = InodeFor(Kind::kBlob, node->view, it->second);
    } else {
      return (void)fuse_reply_err(req, ENOTDIR);
    }
    fuse_entry_param e{};
    e.ino = ino;
    Node target;
    {
      std::lock_guard lock(mu_);
      Node& t = nodes_[ino];
      ++t.lookups;
      target = t;
    }
    e.attr = Attr(ino, target);
    double timeout = (target.kind == Kind::kCheckpoint || target.kind == Kind::kLatest) ? kRootTimeout : kImmutableTimeout;
    e.attr_timeout = timeout;
    e.entry_timeout = timeout;
    fuse_reply_entry(req, &e);
  }

  void Forget(fuse_ino_t ino, uint64_t n) {
    std::lock_guard lock(mu_);
    if (ino == FUSE_ROOT_ID || ino == kLatestIno) return;
    auto it = nodes_.find(ino);
    if (it == nodes_.end()) return;
    it->second.lookups = it->second.lookups > n ? it->second.lookups - n : 0;
    if (it->second.lookups == 0) {
      ino_of_.erase(KeyOf(it->second.kind, it->second.view, it->second.index));
      nodes_.erase(it);
    }
  }

  void GetAttr(fuse_req_t req, fuse_ino_t ino) {
    auto node = GetNode(ino);
    if (!node) return (void)fuse_reply_err(req, ENOENT);
    struct stat st = Attr(ino, *node);
    bool changing = node->kind == Kind::kRoot || node->kind == Kind::kLatest || node->kind == Kind::kCheckpoint;
    fuse_reply_attr(req, &st, changing ? kRootTimeout : kImmutableTimeout);
  }

  void ReadLink(fuse_req_t req, fuse_ino_t ino) {
    if (ino != kLatestIno) return (void)fuse_reply_err(req, EINVAL);
    std::string target = LatestName();
    if (target.empty()) return (void)fuse_reply_err(req, ENOENT);
    fuse_reply_readlink(req, target.c_str());
  }

  void OpenDir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
    auto node = GetNode(ino);
    if (!node) return (void)fuse_reply_err(req, ENOENT);
    auto entries = std::make_unique<std::vector<DirEntry>>();
    entries->push_back({".", ino, S_IFDIR});
    entries->push_back({"..", FUSE_ROOT_ID, S_IFDIR});
    if (node->kind == Kind::kRoot) {
      auto list = repo_->ListCheckpoints(false);
      if (!list.ok()) return ReplyError(req, list.status());
      if (!list->empty()) entries->push_back({"latest", kLatestIno, S_IFLNK});
      for (const auto& c : *list) {
        // A checkpoint whose records are damaged is left out of the listing;
        // looking it up gives EIO with the reason in the log.
        auto view = ViewOf(c);
        if (view.ok()) entries->push_back({c.name, InodeFor(Kind::kCheckpoint, *view, 0), S_IFDIR});
      }
    } else if (node->kind == Kind::kCheckpoint) {
      const auto& v = node->view;
      for (size_t i = 0; i < v->tensor_files.size(); ++i) {
        entries->push_back({v->tensor_files[i], InodeFor(Kind::kTensor, v, i), S_IFREG});
      }
      entries->push_back({"model.safetensors", InodeFor(Kind::kSafetensors, v, 0), S_IFREG});
      entries->push_back({"metadata.json", InodeFor(Kind::kMetadata, v, 0), S_IFREG});
      entries->push_back({"blobs", InodeFor(Kind::kBlobsDir, v, 0), S_IFDIR});
    } else if (node->kind == Kind::kBlobsDir) {
      const auto& v = node->view;
      for (size_t i = 0; i < v->blob_files.size(); ++i) {
        entries->push_back({v->blob_files[i], InodeFor(Kind::kBlob, v, i), S_IFREG});
      }
    } else {
      return (void)fuse_reply_err(req, ENOTDIR);
    }
    fi->fh = reinterpret_cast<uint64_t>(entries.release());
    fi->cache_readdir = node->kind != Kind::kRoot;
    fi->keep_cache = node->kind != Kind::kRoot;
    fuse_reply_open(req, fi);
  }

  void ReadDir(fuse_req_t req, size_t size, off_t off, fuse_file_info* fi) {
    auto* entries = reinterpret_cast<std::vector<DirEntry>*>(fi->fh);
    std::vector<char> buf(size);
    size_t used = 0;
    for (size_t i = static_cast<size_t>(off); i < entries->size(); ++i) {
      struct stat st{};
      st.st_ino = (*entries)[i].ino;
      st.st_mode = (*entries)[i].mode;
      size_t n = fuse_add_direntry(req, buf.data() + used, size - used, (*entries)[i].name.c_str(), &st,
                                   static_cast<off_t>(i + 1));
      if (n > size - used) break;
      used += n;
    }
    fuse_reply_buf(req, buf.data(), used);
  }

  void ReleaseDir(fuse_req_t req, fuse_file_info* fi) {
    delete reinterpret_cast<std::vector<DirEntry>*>(fi->fh);
    fuse_reply_err(req, 0);
  }

  void Open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
    if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC)) return (void)fuse_reply_err(req, EROFS);
    auto node = GetNode(ino);
    if (!node) return (void)fuse_reply_err(req, ENOENT);
    if (node->kind == Kind::kRoot || node->kind == Kind::kCheckpoint || node->kind == Kind::kBlobsDir) {
      return (void)fuse_reply_err(req, EISDIR);
    }
    if (node->kind == Kind::kLatest) return (void)fuse_reply_err(req, ELOOP);
    auto* f = new OpenFile{node->view, node->kind, node->index};
    fi->fh = reinterpret_cast<uint64_t>(f);
    fi->keep_cache = 1;  // immutable content: keep the page cache across opens
    fuse_reply_open(req, fi);
  }

  void Release(fuse_req_t req, fuse_file_info* fi) {
    delete reinterpret_cast<OpenFile*>(fi->fh);
    fuse_reply_err(req, 0);
  }

  void Read(fuse_req_t req, size_t size, off_t off, fuse_file_info* fi) {
    auto* f = reinterpret_cast<OpenFile*>(fi->fh);
    const uint64_t file_size = FileSize(*f->view, f->kind, f->index);
    const uint64_t offset = static_cast<uint64_t>(off);
    if (offset >= file_size) return (void)fuse_reply_buf(req, nullptr, 0);
    const size_t n = static_cast<size_t>(std::min<uint64_t>(size, file_size - offset));
    thread_local std::vector<std::byte> buf;
    if (buf.size() < n) buf.resize(n);
    std::span<std::byte> out(buf.data(), n);
    MaybePrefetch(*f, offset, n);
    Status st = Fill(*f, offset, out);
    if (!st.ok()) return ReplyError(req, st);
    fuse_reply_buf(req, reinterpret_cast<const char*>(buf.data()), n);
  }

  void GetXattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
    auto node = GetNode(ino);
    if (!node) return (void)fuse_reply_err(req, ENOENT);
    auto attrs = Xattrs(*node);
    auto it = std::find_if(attrs.begin(), attrs.end(), [&](const auto& a) { return a.first == name; });
    if (it == attrs.end()) return (void)fuse_reply_err(req, ENODATA);
    if (size == 0) return (void)fuse_reply_xattr(req, it->second.size());
    if (size < it->second.size()) return (void)fuse_reply_err(req, ERANGE);
    fuse_reply_buf(req, it->second.data(), it->second.size());
  }

  void ListXattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
    auto node = GetNode(ino);
    if (!node) return (void)fuse_reply_err(req, ENOENT);
    std::string list;
    for (const auto& [k, v] : Xattrs(*node)) {
      list += k;
      list.push_back('\0');
    }
    if (size == 0) return (void)fuse_reply_xattr(req, list.size());
    if (size < list.size()) return (void)fuse_reply_err(req, ERANGE);
    fuse_reply_buf(req, list.data(), list.size());
  }

  void StatFs(fuse_req_t req) {
    struct statvfs sv{};
    if (::statvfs(repo_->path().c_str(), &sv) != 0) std::memset(&sv, 0, sizeof sv);
    sv.f_namemax = 255;
    sv.f_flag |= ST_RDONLY;
    fuse_reply_statfs(req, &sv);
  }

  // ---- watching the repository -----------------------------------------------

  // Notices new and removed checkpoints and tells the kernel to drop what it
  // cached of the root.
  void Watch(std::stop_token stop) {
    if (options_.readahead_bytes) SetReadahead();
    std::set<std::string> known;
    std::string latest;
    bool first = true;
    std::mutex m;
    std::condition_variable_any cv;
    while (!stop.stop_requested()) {
      auto list = repo_->ListCheckpoints(false);
      if (list.ok()) {
        std::set<std::string> now;
        for (const auto& c : *list) now.insert(c.name);
        std::string new_latest = list->empty() ? "" : list->back().name;
        if (!first && session_) {
          for (const auto& n : known) {
            if (!now.count(n)) {
              DropView(n);
              fuse_lowlevel_notify_inval_entry(session_, FUSE_ROOT_ID, n.c_str(), n.size());
            }
          }
          if (new_latest != latest) {
            fuse_lowlevel_notify_inval_entry(session_, FUSE_ROOT_ID, "latest", 6);
            fuse_lowlevel_notify_inval_inode(session_, kLatestIno, 0, 0);
          }
          if (now != known) fuse_lowlevel_notify_inval_inode(session_, FUSE_ROOT_ID, 0, 0);
        }
        known = std::move(now);
        latest = std::move(new_latest);
        first = false;
      }
      std::unique_lock lock(m);
      cv.wait_for(lock, stop, std::chrono::milliseconds(static_cast<int>(options_.poll_seconds * 1000)),
                  [] { return false; });
    }
  }

 private:
  static constexpr fuse_ino_t kLatestIno = 2;

  // Raises the mount's kernel readahead (best effort: needs root). Runs once
  // the session serves requests, since stat of the mountpoint asks it.
  void SetReadahead() {
    struct stat st;
    if (::stat(options_.mountpoint.c_str(), &st) != 0) return;
    const std::string path = "/sys/class/bdi/" + std::to_string(major(st.st_dev)) + ":" +
                             std::to_string(minor(st.st_dev)) + "/read_ahead_kb";
    FILE* f = std::fopen(path.c_str(), "w");
    if (!f) return;
    std::fprintf(f, "%zu\n", options_.readahead_bytes >> 10);
    std::fclose(f);
  }

  static std::string KeyOf(Kind kind, const std::shared_ptr<CheckpointView>& v, size_t index) {
    return std::to_string(static_cast<int>(kind)) + "/" + (v ? v->name + "@" + std::to_string(v->sequence) : "") +
           "/" + std::to_string(index);
  }

  fuse_ino_t InodeFor(Kind kind, const std::shared_ptr<CheckpointView>& v, size_t index) {
    std::lock_guard lock(mu_);
    auto key = KeyOf(kind, v, index);
    auto it = ino_of_.find(key);
    if (it != ino_of_.end()) return it->second;
    fuse_ino_t ino = next_ino_++;
    ino_of_[key] = ino;
    nodes_[ino] = Node{kind, v, index, 0};
    return ino;
  }

  std::optional<Node> GetNode(fuse_ino_t ino) {
    std::lock_guard lock(mu_);
    auto it = nodes_.find(ino);
    if (it == nodes_.end()) return std::nullopt;
    return it->second;
  }

  std::string LatestName() {
    auto list = repo_->ListCheckpoints(false);
    if (!list.ok() || list->empty()) return "";
    return list->back().name;
  }

  void DropView(const std::string& name) {
    std::lock_guard lock(views_mu_);
    views_.erase(name);
  }

  // The view of committed checkpoint `name`, built on first use and kept
  // while its commit sequence is unchanged. Reads the catalog only, never
  // tensor data; an unchanged checkpoint costs one catalog lookup.
  // NotFound when no committed checkpoint has that name; Corruption when
  // its records are damaged.
  Result<std::shared_ptr<CheckpointView>> ViewOf(const std::string& name) {
    auto record = repo_->GetCheckpoint(name);
    if (!record.ok()) {
      DropView(name);
      return record.status();
    }
    return ViewOf(*record);
  }

  Result<std::shared_ptr<CheckpointView>> ViewOf(const CheckpointRecord& record) {
    const std::string& name = record.name;
    {
      std::lock_guard lock(views_mu_);
      auto it = views_.find(name);
      if (it != views_.end() && it->second->sequence == record.sequence) return it->second;
    }
    auto reader = repo_->OpenCheckpoint(name);
    if (!reader.ok()) {
      DropView(name);
      return reader.status();
    }
    auto v = std::make_shared<CheckpointView>();
    v->name = name;
    v->sequence = (*reader)->info().sequence;
    v->mtime = (*reader)->info().committed_unix_ms / 1000;
    v->reader = std::move(reader).value();
    std::vector<TensorMeta> metas;
    for (size_t i = 0; i < v->reader->tensors().size(); ++i) {
      const auto& t = v->reader->tensors()[i];
      v->tensor_files.push_back(FileNameFor(t.name, ".npy"));
      v->tensor_by_file[v->tensor_files.back()] = i;
      v->npy_headers.push_back(NpyHeader(t.dtype, t.shape));
      metas.push_back({t.name, t.dtype, t.shape});
    }
    for (size_t i = 0; i < v->reader->blobs().size(); ++i) {
      v->blob_files.push_back(FileNameFor(v->reader->blobs()[i].name, ""));
      v->blob_by_file[v->blob_files.back()] = i;
    }
    std::vector<std::pair<std::string, std::string>> meta = {{"ckptfs.checkpoint", name}};
    if (v->reader->info().step) meta.emplace_back("ckptfs.step", std::to_string(*v->reader->info().step));
    v->safetensors = LayoutSafetensors(metas, meta);
    v->metadata = MetadataJson(*v);
    std::lock_guard lock(views_mu_);
    views_[name] = v;
    return v;
  }

  // `ckpt show --json`'s description plus the file that shows each tensor
  // and blob.
  static std::string MetadataJson(const CheckpointView& v) {
    auto described = DescribeCheckpoint(*v.reader);
    if (!described.ok()) return Json(described.status().ToString()).Dump() + "\n";
    Json j = std::move(described).value();
    auto add_files = [&](const char* key, const std::vector<std::string>& files, const char* dir) {
      auto& list = j.Find(key)->as_array();
      for (size_t i = 0; i < list.size(); ++i) list[i].Set("file", std::string(dir) + files[i]);
    };
    add_files("tensors", v.tensor_files, "");
    add_files("blobs", v.blob_files, "blobs/");
    return j.Dump(2) + "\n";
  }

  static uint64_t FileSize(const CheckpointView& v, Kind kind, size_t index) {
    switch (kind) {
      case Kind::kTensor: return v.npy_headers[index].size() + v.reader->tensors()[index].ByteSize();
      case Kind::kSafetensors: return v.safetensors.total_size;
      case Kind::kMetadata: return v.metadata.size();
      case Kind::kBlob: return v.reader->blobs()[index].size;
      default: return 0;
    }
  }

  struct stat Attr(fuse_ino_t ino, const Node& node) {
    struct stat st{};
    st.st_ino = ino;
    st.st_uid = ::getuid();
    st.st_gid = ::getgid();
    st.st_blksize = 1 << 20;
    switch (node.kind) {
      case Kind::kRoot:
      case Kind::kCheckpoint:
      case Kind::kBlobsDir:
        st.st_mode = S_IFDIR | 0555;
        st.st_nlink = 2;
        break;
      case Kind::kLatest:
        st.st_mode = S_IFLNK | 0777;
        st.st_nlink = 1;
        st.st_size = static_cast<off_t>(LatestName().size());
        break;
      default:
        st.st_mode = S_IFREG | 0444;
        st.st_nlink = 1;
        st.st_size = static_cast<off_t>(FileSize(*node.view, node.kind, node.index));
        st.st_blocks = (st.st_size + 511) / 512;
    }
    const time_t t = node.view ? static_cast<time_t>(node.view->mtime) : mounted_at_;
    st.st_mtime = st.st_ctime = st.st_atime = t;
    return st;
  }

  std::vector<std::pair<std::string, std::string>> Xattrs(const Node& node) {
    std::vector<std::pair<std::string, std::string>> out;
    if (node.kind == Kind::kTensor) {
      const auto& t = node.view->reader->tensors()[node.index];
      out.emplace_back("user.ckptfs.name", t.name);
      out.emplace_back("user.ckptfs.dtype", std::string(DTypeName(t.dtype)));
      out.emplace_back("user.ckptfs.shape", ShapeToString(t.shape));
    } else if (node.kind == Kind::kBlob) {
      out.emplace_back("user.ckptfs.name", node.view->reader->blobs()[node.index].name);
    } else if (node.kind == Kind::kCheckpoint) {
      out.emplace_back("user.ckptfs.checkpoint", node.view->name);
      if (node.view->reader->info().step) {
        out.emplace_back("user.ckptfs.step", std::to_string(*node.view->reader->info().step));
      }
    }
    return out;
  }

  // Bytes [offset, offset + out.size()) of an open file.
  Status Fill(OpenFile& f, uint64_t offset, std::span<std::byte> out) {
    const CheckpointView& v = *f.view;
    const CheckpointReader& r = *v.reader;
    auto copy_string = [&](const std::string& s, uint64_t at, std::span<std::byte> dst) {
      std::memcpy(dst.data(), s.data() + at, dst.size());
    };
    switch (f.kind) {
      case Kind::kMetadata:
        copy_string(v.metadata, offset, out);
        return Status::OK();
      case Kind::kBlob:
        return r.ReadBlob(r.blobs()[f.index], offset, out);
      case Kind::kTensor: {
        const std::string& h = v.npy_headers[f.index];
        size_t done = 0;
        if (offset < h.size()) {
          done = std::min<size_t>(out.size(), h.size() - offset);
          copy_string(h, offset, out.subspan(0, done));
        }
        if (done == out.size()) return Status::OK();
        return r.ReadBytes(r.tensors()[f.index], offset + done - h.size(), out.subspan(done));
      }
      case Kind::kSafetensors: {
        const auto& L = v.safetensors;
        size_t done = 0;
        while (done < out.size()) {
          uint64_t pos = offset + done;
          if (pos < L.header.size()) {
            size_t n = std::min<size_t>(out.size() - done, L.header.size() - pos);
            copy_string(L.header, pos, out.subspan(done, n));
            done += n;
            continue;
          }
          // The tensor holding `pos`: the last one starting at or before it
          // (zero-size tensors share offsets and are skipped by n == 0).
          size_t i = static_cast<size_t>(std::upper_bound(L.offsets.begin(), L.offsets.end(), pos) - L.offsets.begin()) - 1;
          while (i + 1 < L.offsets.size() && L.offsets[i] + L.sizes[i] <= pos) ++i;
          uint64_t in = pos - L.offsets[i];
          size_t n = std::min<uint64_t>(out.size() - done, L.sizes[i] - in);
          RETURN_IF_ERROR(r.ReadBytes(r.tensors()[i], in, out.subspan(done, n)));
          done += n;
        }
        return Status::OK();
      }
      default:
        return Status::InvalidArgument("not a file");
    }
  }

  // A reader that continues where it stopped gets the next chunks decoded
  // ahead of it.
  void MaybePrefetch(OpenFile& f, uint64_t offset, size_t n) {
    if (options_.prefetch_chunks == 0) return;
    const CheckpointView& v = *f.view;
    uint64_t tensor_offset;
    size_t index;
    if (f.kind == Kind::kTensor) {
      index = f.index;
      tensor_offset = offset > v.npy_headers[index].size() ? offset - v.npy_headers[index].size() : 0;
    } else if (f.kind == Kind::kSafetensors) {
      const auto& L = v.safetensors;
      if (offset < L.header.size()) return;
      index = static_cast<size_t>(std::upper_bound(L.offsets.begin(), L.offsets.end(), offset) - L.offsets.begin()) - 1;
      tensor_offset = offset - L.offsets[index];
    } else {
      return;
    }
    std::lock_guard lock(f.mu);
    // Kernel readahead sends several requests at once, slightly out of
    // order: a read near the furthest point reached so far counts as
    // sequential.
    const uint64_t slack = 4 * repo_->config().chunk_size;
    bool sequential = offset + slack >= f.next_offset && offset <= f.next_offset + slack;
    f.next_offset = std::max(f.next_offset, offset + n);
    if (!sequential) {
      f.next_offset = offset + n;
      f.prefetched_until = 0;
      return;
    }
    const auto& t = v.reader->tensors()[index];
    const uint64_t window = options_.prefetch_chunks * repo_->config().chunk_size;
    uint64_t from = std::max(tensor_offset + n, f.prefetched_until);
    uint64_t to = std::min<uint64_t>(t.ByteSize(), tensor_offset + n + window);
    if (to <= from + repo_->config().chunk_size / 2) return;  // enough is in flight
    v.reader->Prefetch(t, from, to - from);
    f.prefetched_until = to;
  }

  // A failed read is EIO (logged with the chunk and pack the message names);
  // it never returns wrong bytes.
  static void ReplyError(fuse_req_t req, const Status& st) {
    if (st.code() == StatusCode::kResourceExhausted) return (void)fuse_reply_err(req, ENOMEM);
    std::fprintf(stderr, "ckptfs: read failed: %s\n", st.ToString().c_str());
    fuse_reply_err(req, EIO);
  }

  std::unique_ptr<Repository> repo_;
  MountOptions options_;
  fuse_session* session_ = nullptr;
  const time_t mounted_at_ = ::time(nullptr);
  std::mutex mu_;  // nodes_, ino_of_, next_ino_
  std::unordered_map<fuse_ino_t, Node> nodes_;
  std::unordered_map<std::string, fuse_ino_t> ino_of_;
  fuse_ino_t next_ino_ = 3;
  std::mutex views_mu_;
  std::map<std::string, std::shared_ptr<CheckpointView>> views_;
};

// The session's userdata: the filesystem is created after daemonizing, before
// the loop delivers the first request.
struct Holder {
  Filesystem* fs = nullptr;
};

Filesystem* Fs(fuse_req_t req) { return static_cast<Holder*>(fuse_req_userdata(req))->fs; }

void OpInit(void*, fuse_conn_info* conn) {
  // Large requests: max_write also sets the kernel's max_pages, which bounds
  // read requests too.
  conn->max_write = 1 << 20;
  conn->max_readahead = 16 << 20;
  // `latest` changes target; symlinks are not cached so it is never stale.
  conn->want &= ~FUSE_CAP_CACHE_SYMLINKS;
  conn->want &= ~FUSE_CAP_AUTO_INVAL_DATA;  // content never changes under a name
}

const fuse_lowlevel_ops kOps = [] {
  fuse_lowlevel_ops ops{};
  ops.init = OpInit;
  ops.lookup = [](fuse_req_t req, fuse_ino_t parent, const char* name) { Fs(req)->Lookup(req, parent, name); };
  ops.forget = [](fuse_req_t req, fuse_ino_t ino, uint64_t n) {
    Fs(req)->Forget(ino, n);
    fuse_reply_none(req);
  };
  ops.forget_multi = [](fuse_req_t req, size_t count, fuse_forget_data* forgets) {
    for (size_t i = 0; i < count; ++i) Fs(req)->Forget(forgets[i].ino, forgets[i].nlookup);
    fuse_reply_none(req);
  };
  ops.getattr = [](fuse_req_t req, fuse_ino_t ino, fuse_file_info*) { Fs(req)->GetAttr(req, ino); };
  ops.readlink = [](fuse_req_t req, fuse_ino_t ino) { Fs(req)->ReadLink(req, ino); };
  ops.opendir = [](fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) { Fs(req)->OpenDir(req, ino, fi); };
  ops.readdir = [](fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
    Fs(req)->ReadDir(req, size, off, fi);
  };
  ops.releasedir = [](fuse_req_t req, fuse_ino_t, fuse_file_info* fi) { Fs(req)->ReleaseDir(req, fi); };
  ops.open = [](fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) { Fs(req)->Open(req, ino, fi); };
  ops.read = [](fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
    Fs(req)->Read(req, size, off, fi);
  };
  ops.release = [](fuse_req_t req, fuse_ino_t, fuse_file_info* fi) { Fs(req)->Release(req, fi); };
  ops.getxattr = [](fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
    Fs(req)->GetXattr(req, ino, name, size);
  };
  ops.listxattr = [](fuse_req_t req, fuse_ino_t ino, size_t size) { Fs(req)->ListXattr(req, ino, size); };
  ops.statfs = [](fuse_req_t req, fuse_ino_t) { Fs(req)->StatFs(req); };
  return ops;
}();

Status CheckMountpoint(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return Status::NotFound("mountpoint '" + path + "' does not exist");
  if (!S_ISDIR(st.st_mode)) return Status::InvalidArgument("mountpoint '" + path + "' is not a directory");
  DIR* d = ::opendir(path.c_str());
  if (!d) return Status::FromErrno(errno, "opening mountpoint " + path);
  bool empty = true;
  while (struct dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
      empty = false;
      break;
    }
  }
  ::closedir(d);
  if (!empty) return Status::FailedPrecondition("mountpoint '" + path + "' is not empty");
  return Status::OK();
}

}  // namespace

Status RunMount(const MountOptions& options) {
  RETURN_IF_ERROR(CheckMountpoint(options.mountpoint));
  OpenOptions open_options;
  open_options.cache_bytes = options.cache_bytes;
  // Reads wait on the disk as much as they decode: twice as many workers as
  // cores keep both busy.
  open_options.threads = options.threads ? options.threads : 2 * std::max(1u, std::thread::hardware_concurrency());
  // Check the repository before mounting, so errors reach the caller; the
  // daemon opens it again after forking (LMDB environments and threads do
  // not survive fork).
  {
    auto probe = Repository::Open(options.repository, open_options);
    if (!probe.ok()) return probe.status();
  }
  std::vector<std::string> arg_storage = {"ckpt-mount", "-o", "ro,default_permissions,fsname=ckptfs,subtype=ckptfs"};
  if (options.allow_other) {
    arg_storage.push_back("-o");
    arg_storage.push_back("allow_other");
  }
  if (options.debug) arg_storage.push_back("-d");
  std::vector<char*> argv;
  for (auto& a : arg_storage) argv.push_back(a.data());
  fuse_args args = FUSE_ARGS_INIT(static_cast<int>(argv.size()), argv.data());

  std::unique_ptr<Filesystem> fs;
  Holder holder;
  fuse_session* se = fuse_session_new(&args, &kOps, sizeof(kOps), &holder);
  if (!se) return Status::Internal("could not create the FUSE session (see messages above)");
  if (fuse_set_signal_handlers(se) != 0) {
    fuse_session_destroy(se);
    return Status::Internal("could not install signal handlers");
  }
  if (fuse_session_mount(se, options.mountpoint.c_str()) != 0) {
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return Status::IOError("could not mount on '" + options.mountpoint + "' (is /dev/fuse available, and fuse3 installed?)");
  }
  fuse_daemonize(options.foreground ? 1 : 0);
  auto repo = Repository::Open(options.repository, open_options);
  Status result;
  if (!repo.ok()) {
    result = repo.status();
  } else {
    fs = std::make_unique<Filesystem>(std::move(repo).value(), options);
    fs->SetSession(se);
    holder.fs = fs.get();
    std::jthread watcher([&](std::stop_token stop) { fs->Watch(stop); });
    fuse_loop_config* config = fuse_loop_cfg_create();
    fuse_loop_cfg_set_max_threads(config, 16);
    fuse_loop_cfg_set_idle_threads(config, 4);
    int rc = fuse_session_loop_mt(se, config);
    fuse_loop_cfg_destroy(config);
    watcher.request_stop();
    watcher.join();
    if (rc < 0) result = Status::IOError(std::string("FUSE session ended with an error: ") + std::strerror(-rc));
  }
  fuse_session_unmount(se);
  fuse_remove_signal_handlers(se);
  fuse_session_destroy(se);
  return result;
}

}  // namespace ckptfs::mount
