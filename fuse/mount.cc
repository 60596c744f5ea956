// libfuse3 low-level filesystem over a ckptfs repository.
#define FUSE_USE_VERSION 312
#include "mount.h"

#include <dirent.h>
#include <malloc.h>
#include <fuse_lowlevel.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <fstream>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "backend/store_url.h"
#include "ckpt/files.h"
#include "ckpt/repository.h"
#include "core/buffer_pool.h"

namespace ckptfs::mount {
namespace {

// Content inside a checkpoint never changes: the kernel may keep it.
constexpr double kImmutableTimeout = 3600.0;
// The root changes as checkpoints come and go.
constexpr double kRootTimeout = 1.0;
// A read reply of more pieces than this (a narrow column shard gives one
// per row) is copied into one buffer instead: the kernel walks every piece.
constexpr size_t kMaxReplyPieces = 64;

// The device ("MAJOR:MINOR") of the filesystem mounted last at `dir` (a
// canonical path), from /proc/self/mountinfo; empty when none is found.
// Not stat(): for our own mount that is a request to this daemon, which
// may not be serving (yet, or any more).
std::string MountedDevice(const std::string& dir) {
  auto unescape = [](const std::string& field) {  // mountinfo writes ' ' as \040, etc.
    auto octal = [](char c) { return c >= '0' && c <= '7'; };
    std::string out;
    for (size_t i = 0; i < field.size(); ++i) {
      if (field[i] == '\\' && i + 3 < field.size() && octal(field[i + 1]) && octal(field[i + 2]) &&
          octal(field[i + 3])) {
        out += static_cast<char>((field[i + 1] - '0') * 64 + (field[i + 2] - '0') * 8 + (field[i + 3] - '0'));
        i += 3;
      } else {
        out += field[i];
      }
    }
    return out;
  };
  std::ifstream in("/proc/self/mountinfo");
  std::string line, found;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string id, parent, device, root, point;
    if (fields >> id >> parent >> device >> root >> point && unescape(point) == dir) found = device;
  }
  return found;
}

// Raises the kernel readahead of the mount at `dir` (best effort: needs
// root).
void RaiseReadahead(const std::string& dir, size_t bytes) {
  const std::string device = MountedDevice(dir);
  if (device.empty()) return;
  FILE* f = std::fopen(("/sys/class/bdi/" + device + "/read_ahead_kb").c_str(), "w");
  if (!f) return;
  std::fprintf(f, "%zu\n", bytes >> 10);
  std::fclose(f);
}

// kGroup: a directory of the checkpoints whose names begin "GROUP/" (a run).
enum class Kind { kRoot, kLatest, kGroup, kCheckpoint, kBlobsDir, kFile };

// One committed checkpoint as the mount shows it: its files (the engine's
// CheckpointFiles) and the range of inode numbers they have. Immutable once
// built, but for the kernel's count of lookups.
//
// Inode numbers are computed, not stored: file i is ino_base + i, the
// checkpoint's directory ino_base + N and its blobs/ directory
// ino_base + N + 1 (N files). A mount of a checkpoint of 10^6 tensors
// holds no table entry per file.
struct CheckpointView {
  std::string name;    // the checkpoint's; empty for a model view
  std::string commit;  // CommitOf the record it shows
  uint64_t mtime = 0;  // commit time, seconds
  std::unique_ptr<CheckpointFiles> files;
  fuse_ino_t ino_base = 0;
  uint64_t lookups = 0;  // guarded by Filesystem::mu_: the kernel's references to its inodes
  // A training checkpoint's model view, its directory "model/" (files.h
  // HasModelView): built at its first use, guarded by Filesystem::mu_.
  bool has_model = false;
  std::shared_ptr<CheckpointView> model;
  std::weak_ptr<CheckpointView> parent;  // of a model view: its checkpoint's view
  size_t file_count() const { return files->files().size(); }
  fuse_ino_t dir_ino() const { return ino_base + file_count(); }
  fuse_ino_t blobs_ino() const { return ino_base + file_count() + 1; }
  fuse_ino_t inode_count() const { return file_count() + 2; }
};

struct Node {
  Kind kind;
  std::shared_ptr<CheckpointView> view;  // null for root, latest and groups
  size_t file = 0;                       // index into view->files->files()
  std::string group;                     // a group's name ("run1", "run1/eval")
};

// What directory `dir` ("" for the root, else a group) holds of checkpoint
// `name`: the entry's name and whether it is the checkpoint itself (else a
// group inside `dir`); nullopt when the name is not under `dir`.
std::optional<std::pair<std::string, bool>> EntryUnder(const std::string& dir, const std::string& name) {
  if (!InGroup(name, dir)) return std::nullopt;
  std::string_view rest = name;
  if (!dir.empty()) rest.remove_prefix(dir.size() + 1);
  const size_t slash = rest.find('/');
  if (slash == std::string_view::npos) return std::pair(std::string(rest), true);
  return std::pair(std::string(rest.substr(0, slash)), false);
}

struct DirEntry {
  std::string name;
  fuse_ino_t ino;
  mode_t mode;
};

// What an open directory lists: a few named entries, then (for a
// checkpoint's directory and its blobs/) files of the view by index, whose
// names are taken from the view as each ReadDir reaches them.
struct DirListing {
  std::vector<DirEntry> named;
  std::shared_ptr<CheckpointView> view;
  std::vector<uint32_t> files;
  size_t size() const { return named.size() + files.size(); }
};

struct OpenFile {
  OpenFile(std::shared_ptr<CheckpointView> v, const CheckpointFile& f, uint64_t window)
      : view(std::move(v)), file(f), readahead(*view->files, f, window) {}
  std::shared_ptr<CheckpointView> view;  // keeps `file` alive
  const CheckpointFile& file;
  FileReadahead readahead;
  // While any file of a checkpoint is open (or mapped: the kernel releases
  // a file only at its last munmap), removing the checkpoint leaves its
  // bytes for this mount (docs/DESIGN.md "Removal and read leases").
  CheckpointLease lease;
};

// The one place a file handle becomes an OpenFile.
OpenFile& OpenFileOf(const fuse_file_info* fi) { return *reinterpret_cast<OpenFile*>(fi->fh); }

class Filesystem {
 public:
  Filesystem(std::unique_ptr<Repository> repo, const MountOptions& options)
      : repo_(std::move(repo)), options_(options) {
  }

  void SetSession(fuse_session* se) { session_ = se; }

  // ---- requests ------------------------------------------------------------

  void Lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
    auto node = GetNode(parent);
    if (!node) return (void)fuse_reply_err(req, ENOENT);
    std::string_view n = name;
    fuse_ino_t ino = 0;
    if (node->kind == Kind::kRoot && n == "latest") {
      if (LatestName().empty()) return (void)fuse_reply_err(req, ENOENT);
      ino = kLatestIno;
    } else if (node->kind == Kind::kRoot || node->kind == Kind::kGroup) {
      const std::string full = node->group.empty() ? std::string(n) : node->group + "/" + std::string(n);
      auto view = ViewOf(full);
      if (view.ok()) {
        ino = (*view)->dir_ino();
      } else if (!view.status().IsNotFound()) {
        return ReplyError(req, view.status());  // damaged records: EIO, logged
      } else if (!HoldsCheckpoints(full)) {
        return (void)fuse_reply_err(req, ENOENT);
      } else {
        ino = GroupIno(full);
      }
    } else if (node->kind == Kind::kCheckpoint || node->kind == Kind::kBlobsDir) {
      const auto& v = node->view;
      if (node->kind == Kind::kCheckpoint && n == "blobs") {
        ino = v->blobs_ino();
      } else if (node->kind == Kind::kCheckpoint && v->has_model && n == kModelViewDir) {
        auto model = ModelOf(v);
        if (!model.ok()) return ReplyError(req, model.status());
        ino = (*model)->dir_ino();
      } else {
        const CheckpointFile* f = nullptr;
        if (node->kind == Kind::kBlobsDir) {
          f = v->files->Find(std::string(kBlobsPrefix) + std::string(n));
        } else if (!n.starts_with(kBlobsPrefix)) {
          f = v->files->Find(n);
        }
        if (!f) return (void)fuse_reply_err(req, ENOENT);
        ino = v->ino_base + static_cast<fuse_ino_t>(f - v->files->files().data());
      }
    } else {
      return (void)fuse_reply_err(req, ENOTDIR);
    }
    fuse_entry_param e{};
    e.ino = ino;
    auto found = GetNode(ino, /*count_lookup=*/true);
    if (!found) return (void)fuse_reply_err(req, ENOENT);  // its checkpoint changed meanwhile
    const Node target = *found;
    e.attr = Attr(ino, target);
    double timeout = (target.kind == Kind::kCheckpoint || target.kind == Kind::kLatest || target.kind == Kind::kGroup)
                         ? kRootTimeout
                         : kImmutableTimeout;
    e.attr_timeout = timeout;
    e.entry_timeout = timeout;
    fuse_reply_entry(req, &e);
  }

  // A view the kernel no longer references, and that is not the current
  // view of its checkpoint (removed, or committed again), gives its inode
  // range up.
  void Forget(fuse_ino_t ino, uint64_t n) {
    std::lock_guard lock(mu_);
    if (ino == FUSE_ROOT_ID || ino == kLatestIno || group_names_.count(ino)) return;
    auto it = ViewHolding(ino);
    if (it == by_base_.end()) return;
    CheckpointView& v = *it->second;
    v.lookups = v.lookups > n ? v.lookups - n : 0;
    if (v.lookups == 0 && !IsCurrent(v)) ReleaseLocked(it->second);
  }

  void GetAttr(fuse_req_t req, fuse_ino_t ino) {
    auto node = GetNode(ino);
    if (!node) return (void)fuse_reply_err(req, ENOENT);
    struct stat st = Attr(ino, *node);
    bool changing = node->kind == Kind::kRoot || node->kind == Kind::kLatest || node->kind == Kind::kCheckpoint ||
                    node->kind == Kind::kGroup;
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
    auto entries = std::make_unique<DirListing>();
    entries->named.push_back({".", ino, S_IFDIR});
    entries->named.push_back({"..", FUSE_ROOT_ID, S_IFDIR});
    if (node->kind == Kind::kRoot || node->kind == Kind::kGroup) {
      auto list = repo_->ListCheckpoints(false);
      if (!list.ok()) return ReplyError(req, list.status());
      if (node->kind == Kind::kRoot && !list->empty()) entries->named.push_back({"latest", kLatestIno, S_IFLNK});
      std::set<std::string> groups;
      for (const auto& c : *list) {
        auto entry = EntryUnder(node->group, c.name);
        if (!entry) continue;
        if (!entry->second) {
          const std::string full = node->group.empty() ? entry->first : node->group + "/" + entry->first;
          if (groups.insert(entry->first).second) entries->named.push_back({entry->first, GroupIno(full), S_IFDIR});
          continue;
        }
        // A checkpoint whose records are damaged is left out of the listing;
        // looking it up gives EIO with the reason in the log.
        auto view = ViewOf(c);
        if (view.ok()) entries->named.push_back({entry->first, (*view)->dir_ino(), S_IFDIR});
      }
    } else if (node->kind == Kind::kCheckpoint || node->kind == Kind::kBlobsDir) {
      const auto& v = node->view;
      if (node->kind == Kind::kCheckpoint) entries->named.push_back({"blobs", v->blobs_ino(), S_IFDIR});
      if (node->kind == Kind::kCheckpoint && v->has_model) {
        auto model = ModelOf(v);
        if (model.ok()) entries->named.push_back({std::string(kModelViewDir), (*model)->dir_ino(), S_IFDIR});
      }
      // In the order of CheckpointFiles: tensors, model.safetensors, metadata.json.
      const auto& files = v->files->files();
      entries->view = v;
      for (size_t i = 0; i < files.size(); ++i) {
        const bool in_blobs = files[i].name.starts_with(kBlobsPrefix);
        if (in_blobs == (node->kind == Kind::kBlobsDir)) entries->files.push_back(static_cast<uint32_t>(i));
      }
    } else {
      return (void)fuse_reply_err(req, ENOTDIR);
    }
    fi->fh = reinterpret_cast<uint64_t>(entries.release());
    fi->cache_readdir = node->kind != Kind::kRoot && node->kind != Kind::kGroup;
    fi->keep_cache = node->kind != Kind::kRoot && node->kind != Kind::kGroup;
    fuse_reply_open(req, fi);
  }

  void ReadDir(fuse_req_t req, size_t size, off_t off, fuse_file_info* fi) {
    auto* entries = reinterpret_cast<DirListing*>(fi->fh);
    std::vector<char> buf(size);
    size_t used = 0;
    std::string name;
    for (size_t i = static_cast<size_t>(off); i < entries->size(); ++i) {
      struct stat st{};
      if (i < entries->named.size()) {
        const DirEntry& e = entries->named[i];
        st.st_ino = e.ino;
        st.st_mode = e.mode;
        name = e.name;
      } else {
        const uint32_t index = entries->files[i - entries->named.size()];
        const std::string& path = entries->view->files->files()[index].name;
        name = path.starts_with(kBlobsPrefix) ? path.substr(kBlobsPrefix.size()) : path;
        st.st_ino = entries->view->ino_base + index;
        st.st_mode = S_IFREG;
      }
      size_t n = fuse_add_direntry(req, buf.data() + used, size - used, name.c_str(), &st,
                                   static_cast<off_t>(i + 1));
      if (n > size - used) break;
      used += n;
    }
    fuse_reply_buf(req, buf.data(), used);
  }

  void ReleaseDir(fuse_req_t req, fuse_file_info* fi) {
    delete reinterpret_cast<DirListing*>(fi->fh);
    fuse_reply_err(req, 0);
  }

  void Open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
    if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC)) return (void)fuse_reply_err(req, EROFS);
    auto node = GetNode(ino);
    if (!node) return (void)fuse_reply_err(req, ENOENT);
    if (node->kind == Kind::kRoot || node->kind == Kind::kGroup || node->kind == Kind::kCheckpoint ||
        node->kind == Kind::kBlobsDir) {
      return (void)fuse_reply_err(req, EISDIR);
    }
    if (node->kind == Kind::kLatest) return (void)fuse_reply_err(req, ELOOP);
    const CheckpointFile& file = node->view->files->files()[node->file];
    auto lease = repo_->LeaseCheckpoint(node->view->files->reader());
    if (!lease.ok()) {
      if (lease.status().IsNotFound()) return (void)fuse_reply_err(req, ENOENT);  // removed and collected
      return ReplyError(req, lease.status());
    }
    auto* f = new OpenFile(node->view, file, options_.prefetch_chunks * repo_->config().chunk_size);
    f->lease = std::move(lease).value();
    f->readahead.OnOpen();
    fi->fh = reinterpret_cast<uint64_t>(f);
    fi->keep_cache = 1;  // immutable content: keep the page cache across opens
    opens_.fetch_add(1, std::memory_order_relaxed);
    fuse_reply_open(req, fi);
  }

  void Release(fuse_req_t req, fuse_file_info* fi) {
    OpenFile* f = &OpenFileOf(fi);
    const bool held_text = f->file.kind == FileKind::kMetadata || f->file.kind == FileKind::kSafetensors;
    delete f;
    fuse_reply_err(req, 0);
    // metadata.json's text or model.safetensors's header may have gone with
    // it (megabytes for a big checkpoint): give the memory back.
    if (held_text) ::malloc_trim(0);
  }

  void Read(fuse_req_t req, size_t size, off_t off, fuse_file_info* fi) {
    OpenFile& f = OpenFileOf(fi);
    const uint64_t offset = static_cast<uint64_t>(off);
    if (offset >= f.file.size) return (void)fuse_reply_buf(req, nullptr, 0);
    const size_t n = static_cast<size_t>(std::min<uint64_t>(size, f.file.size - offset));
    reads_.fetch_add(1, std::memory_order_relaxed);
    read_bytes_.fetch_add(n, std::memory_order_relaxed);
    f.readahead.BeforeRead(offset, n);
    // Replied straight from the decoded chunks in the cache where the
    // range is a few pieces (whole tensors: one or two per request); the
    // kernel copies them into the page cache, and the daemon copies
    // nothing.
    thread_local FilePieces pieces;
    thread_local std::vector<iovec> iov;
    auto in_place = f.view->files->ReadInPlace(f.file, offset, n, kMaxReplyPieces, pieces);
    if (!in_place.ok()) return ReplyError(req, in_place.status());
    if (*in_place) {
      iov.clear();
      for (const auto& p : pieces.pieces()) iov.push_back({const_cast<std::byte*>(p.data()), p.size()});
      fuse_reply_iov(req, iov.data(), static_cast<int>(iov.size()));
      pieces.Clear();
      return;
    }
    thread_local ScratchBuffer buf;
    std::span<std::byte> out(buf.Reserve(n), n);
    Status st = f.view->files->Read(f.file, offset, out);
    if (!st.ok()) return ReplyError(req, st);
    fuse_reply_buf(req, reinterpret_cast<const char*>(out.data()), n);
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
    std::map<std::string, std::string> known;  // name -> CommitOf its record
    std::string latest;
    bool first = true;
    std::mutex m;
    std::condition_variable_any cv;
    const double poll_seconds = options_.poll_seconds > 0 ? options_.poll_seconds : repo_->remote() ? 5.0 : 1.0;
    while (!stop.stop_requested()) {
      // A failed refresh (the store unreachable for a while) keeps what is
      // known; the next poll tries again.
      (void)repo_->Refresh();
      auto list = repo_->ListCheckpoints(false);
      if (list.ok()) {
        std::map<std::string, std::string> now;
        for (const auto& c : *list) now[c.name] = CommitOf(c);
        std::string new_latest = list->empty() ? "" : list->back().name;
        if (!first && session_) {
          // Removed, or removed and saved again (on another host, between
          // two polls): the kernel forgets the name's directory.
          for (const auto& [n, commit] : known) {
            const auto it = now.find(n);
            if (it == now.end() || it->second != commit) {
              DropView(n);
              const auto [parent, entry] = ParentOf(n);
              if (parent != 0) fuse_lowlevel_notify_inval_entry(session_, parent, entry.c_str(), entry.size());
            }
          }
          if (new_latest != latest) {
            fuse_lowlevel_notify_inval_entry(session_, FUSE_ROOT_ID, "latest", 6);
            fuse_lowlevel_notify_inval_inode(session_, kLatestIno, 0, 0);
          }
          if (now != known) {
            fuse_lowlevel_notify_inval_inode(session_, FUSE_ROOT_ID, 0, 0);
            std::vector<fuse_ino_t> groups;
            {
              std::lock_guard lock(mu_);
              for (const auto& [ino, group] : group_names_) groups.push_back(ino);
            }
            for (fuse_ino_t g : groups) fuse_lowlevel_notify_inval_inode(session_, g, 0, 0);
          }
        }
        known = std::move(now);
        latest = std::move(new_latest);
        first = false;
      }
      std::unique_lock lock(m);
      cv.wait_for(lock, stop, std::chrono::milliseconds(static_cast<int>(poll_seconds * 1000)),
                  [] { return false; });
    }
  }

 private:
  static constexpr fuse_ino_t kLatestIno = 2;
  static constexpr std::string_view kBlobsPrefix = "blobs/";

  // The view whose inode range holds `ino`, or by_base_.end() (mu_ held).
  std::map<fuse_ino_t, std::shared_ptr<CheckpointView>>::iterator ViewHolding(fuse_ino_t ino) {
    auto it = by_base_.upper_bound(ino);
    if (it == by_base_.begin()) return by_base_.end();
    --it;
    return ino < it->first + it->second->inode_count() ? it : by_base_.end();
  }
  // Whether `v` is what its checkpoint's name shows now (mu_ held).
  bool IsCurrent(const CheckpointView& v) {
    if (v.name.empty()) {  // a model view: current while its checkpoint's view is
      auto parent = v.parent.lock();
      return parent && parent->model.get() == &v && IsCurrent(*parent);
    }
    auto it = views_.find(v.name);
    return it != views_.end() && it->second.get() == &v;
  }

  // What inode `ino` is; with count_lookup, the kernel now holds one more
  // reference to it (Lookup's reply).
  std::optional<Node> GetNode(fuse_ino_t ino, bool count_lookup = false) {
    if (ino == FUSE_ROOT_ID) return Node{Kind::kRoot, nullptr, 0};
    if (ino == kLatestIno) return Node{Kind::kLatest, nullptr, 0};
    std::lock_guard lock(mu_);
    if (auto g = group_names_.find(ino); g != group_names_.end()) return Node{Kind::kGroup, nullptr, 0, g->second};
    auto it = ViewHolding(ino);
    if (it == by_base_.end()) return std::nullopt;
    const std::shared_ptr<CheckpointView>& v = it->second;
    if (count_lookup) ++v->lookups;
    const size_t index = ino - v->ino_base;
    if (index < v->file_count()) return Node{Kind::kFile, v, index};
    return Node{index == v->file_count() ? Kind::kCheckpoint : Kind::kBlobsDir, v, 0};
  }

  // The inode of group `group`, the same for the mount's life.
  fuse_ino_t GroupIno(const std::string& group) {
    std::lock_guard lock(mu_);
    auto [it, added] = group_inos_.emplace(group, next_ino_);
    if (added) group_names_[next_ino_++] = group;
    return it->second;
  }
  // Whether some committed checkpoint is in group `group`.
  bool HoldsCheckpoints(const std::string& group) {
    auto list = repo_->ListCheckpoints(false);
    if (!list.ok()) return false;
    return std::any_of(list->begin(), list->end(), [&](const CheckpointRecord& c) { return InGroup(c.name, group); });
  }
  // The directory holding checkpoint or group `name`, and its entry there.
  std::pair<fuse_ino_t, std::string> ParentOf(const std::string& name) {
    const size_t slash = name.rfind('/');
    if (slash == std::string::npos) return {FUSE_ROOT_ID, name};
    std::lock_guard lock(mu_);
    auto it = group_inos_.find(name.substr(0, slash));
    return {it == group_inos_.end() ? 0 : it->second, name.substr(slash + 1)};
  }

  std::string LatestName() {
    auto list = repo_->ListCheckpoints(false);
    if (!list.ok() || list->empty()) return "";
    return list->back().name;
  }

  // The checkpoint is gone: its view gives its inode range up once the
  // kernel holds none of its inodes.
  void DropView(const std::string& name) {
    std::lock_guard lock(mu_);
    auto it = views_.find(name);
    if (it == views_.end()) return;
    std::shared_ptr<CheckpointView> v = std::move(it->second);
    views_.erase(it);
    ReleaseLocked(v);
  }

  // Gives view `v` a fresh range of inode numbers (mu_ held).
  void PlaceLocked(const std::shared_ptr<CheckpointView>& v) {
    v->ino_base = next_ino_;
    next_ino_ += v->inode_count();
    by_base_[v->ino_base] = v;
  }
  // View `v` is no longer current: it, and its model view, give their
  // inode ranges up where the kernel holds none of their inodes (mu_ held).
  void ReleaseLocked(std::shared_ptr<CheckpointView> v) {
    if (v->lookups == 0) by_base_.erase(v->ino_base);
    if (v->model && v->model->lookups == 0) by_base_.erase(v->model->ino_base);
  }

  // The model view of checkpoint view `v` (v->has_model), built once.
  Result<std::shared_ptr<CheckpointView>> ModelOf(const std::shared_ptr<CheckpointView>& v) {
    {
      std::lock_guard lock(mu_);
      if (v->model) return v->model;
    }
    std::unique_ptr<CheckpointReader> part = ModelViewOf(*v->files);
    if (!part) return Status::Internal("checkpoint '" + v->name + "' has no model view");
    auto files = CheckpointFiles::Build(std::move(part));
    if (!files.ok()) return files.status();
    auto m = std::make_shared<CheckpointView>();
    m->commit = v->commit;
    m->mtime = v->mtime;
    m->files = std::move(files).value();
    m->parent = v;
    std::lock_guard lock(mu_);
    if (v->model) return v->model;  // built meanwhile
    PlaceLocked(m);
    v->model = m;
    return m;
  }

  // The view of committed checkpoint `name`, built on first use and kept
  // while its commit (sequence and identity) is unchanged. Reads the
  // catalog only, never tensor data; an unchanged checkpoint costs one
  // catalog lookup.
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

  // Which commit a record is: its sequence and its identity, since a name
  // removed and saved again on another host may reuse the sequence.
  static std::string CommitOf(const CheckpointRecord& record) {
    return std::to_string(record.sequence) + " " + CheckpointIdentity(record);
  }

  Result<std::shared_ptr<CheckpointView>> ViewOf(const CheckpointRecord& record) {
    const std::string& name = record.name;
    const std::string commit = CommitOf(record);
    {
      std::lock_guard lock(mu_);
      auto it = views_.find(name);
      if (it != views_.end() && it->second->commit == commit) return it->second;
    }
    // Views hold no lease: open files do.
    auto reader = repo_->OpenCheckpoint(name, ReadOptions{.lease = false});
    if (!reader.ok()) {
      DropView(name);
      return reader.status();
    }
    auto files = CheckpointFiles::Build(std::move(reader).value());
    if (!files.ok()) return files.status();
    // Building allocates and frees much (the catalog's records, metadata
    // sizes); give what is free back, so a mount of millions of tensors
    // keeps only what it holds.
    ::malloc_trim(0);
    auto v = std::make_shared<CheckpointView>();
    v->name = name;
    v->commit = commit;
    v->mtime = record.committed_unix_ms / 1000;
    v->files = std::move(files).value();
    v->has_model = HasModelView(*v->files);
    std::lock_guard lock(mu_);
    auto it = views_.find(name);
    if (it != views_.end() && it->second->commit == commit) return it->second;  // built meanwhile
    PlaceLocked(v);
    if (it != views_.end()) {
      // The name now shows a newer commit: the old view goes once the
      // kernel holds none of its inodes.
      ReleaseLocked(it->second);
      it->second = v;
    } else {
      views_[name] = v;
    }
    return v;
  }

  struct stat Attr(fuse_ino_t ino, const Node& node) {
    struct stat st{};
    st.st_ino = ino;
    st.st_uid = ::getuid();
    st.st_gid = ::getgid();
    st.st_blksize = 1 << 20;
    switch (node.kind) {
      case Kind::kRoot:
      case Kind::kGroup:
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
      case Kind::kFile:
        st.st_mode = S_IFREG | 0444;
        st.st_nlink = 1;
        st.st_size = static_cast<off_t>(node.view->files->files()[node.file].size);
        st.st_blocks = (st.st_size + 511) / 512;
    }
    const time_t t = node.view ? static_cast<time_t>(node.view->mtime) : mounted_at_;
    st.st_mtime = st.st_ctime = st.st_atime = t;
    return st;
  }

  std::vector<std::pair<std::string, std::string>> Xattrs(const Node& node) {
    std::vector<std::pair<std::string, std::string>> out;
    if (node.kind == Kind::kFile) {
      const CheckpointFile& f = node.view->files->files()[node.file];
      const CheckpointReader& r = node.view->files->reader();
      if (f.kind == FileKind::kTensor) {
        const auto& t = r.tensors()[f.index];
        out.emplace_back("user.ckptfs.name", t.name);
        out.emplace_back("user.ckptfs.dtype", std::string(DTypeName(t.dtype)));
        out.emplace_back("user.ckptfs.shape", ShapeToString(t.shape));
      } else if (f.kind == FileKind::kBlob) {
        out.emplace_back("user.ckptfs.name", r.blobs()[f.index].name);
      }
    } else if (node.kind == Kind::kRoot) {
      // What the daemon has served: the kernel's page cache answers reads
      // of files read before, and these counters show it.
      out.emplace_back("user.ckptfs.stats", "opens " + std::to_string(opens_.load()) + " reads " +
                                                std::to_string(reads_.load()) + " read_bytes " +
                                                std::to_string(read_bytes_.load()));
    } else if (node.kind == Kind::kCheckpoint) {
      out.emplace_back("user.ckptfs.checkpoint", node.view->name);
      if (const auto& step = node.view->files->reader().info().step) {
        out.emplace_back("user.ckptfs.step", std::to_string(*step));
      }
    }
    return out;
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
  std::mutex mu_;  // views_, by_base_, next_ino_, the groups' maps and each view's lookups
  // Groups' inodes, given on first sight and kept (one per group ever seen).
  std::map<std::string, fuse_ino_t> group_inos_;
  std::map<fuse_ino_t, std::string> group_names_;
  std::map<std::string, std::shared_ptr<CheckpointView>> views_;       // by checkpoint name: the current views
  std::map<fuse_ino_t, std::shared_ptr<CheckpointView>> by_base_;     // by first inode: views with inodes in use
  fuse_ino_t next_ino_ = 3;
  std::atomic<uint64_t> opens_{0}, reads_{0}, read_bytes_{0};  // files opened, read requests, bytes
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

Status RunMount(const MountOptions& given) {
  CKPT_RETURN_IF_ERROR(CheckMountpoint(given.mountpoint));
  // The daemon runs in "/" (fuse_daemonize changes there), so paths given
  // relative to the caller's directory are made absolute first.
  MountOptions options = given;
  auto absolute = [](const std::string& path) -> Result<std::string> {
    std::error_code ec;
    std::filesystem::path p = std::filesystem::absolute(path, ec);
    if (ec) return Status::FromErrno(ec.value(), "resolving '" + path + "' against the current directory");
    return p.string();
  };
  if (!IsObjectStoreUrl(options.repository)) {
    CKPT_ASSIGN_OR_RETURN(options.repository, absolute(options.repository));
  }
  for (std::string* dir : {&options.open.cache_dir, &options.open.cache_root}) {
    if (!dir->empty() && (*dir)[0] != '/') {
      CKPT_ASSIGN_OR_RETURN(*dir, absolute(*dir));
    }
  }
  OpenOptions open_options = options.open;
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
  // Resolved before mounting: afterwards, resolving it would ask this
  // daemon, which is not serving yet.
  char* resolved = ::realpath(options.mountpoint.c_str(), nullptr);
  const std::string canonical = resolved ? resolved : options.mountpoint;
  std::free(resolved);
  if (fuse_session_mount(se, options.mountpoint.c_str()) != 0) {
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return Status::IOError("could not mount on '" + options.mountpoint + "' (is /dev/fuse available, and fuse3 installed?)");
  }
  fuse_daemonize(options.foreground ? 1 : 0);
  if (options.readahead_bytes) RaiseReadahead(canonical, options.readahead_bytes);
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
    // Worker threads are kept, never torn down when idle: each holds
    // per-thread buffers (the reply, a pack read's stored bytes, codec
    // scratch) that a new thread would have to fault in again.
    fuse_loop_cfg_set_max_threads(config, 16);
    fuse_loop_cfg_set_idle_threads(config, 16);
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
