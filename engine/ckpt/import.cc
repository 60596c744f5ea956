#include "ckpt/import.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string_view>

#include "core/json.h"
#include "core/region.h"
#include "io/mapped_file.h"
#include "io/safetensors.h"

namespace ckptfs {
namespace {

// What the paths of an import hold: safetensors files, and the other files
// of a model directory, which become blobs.
struct Found {
  std::vector<std::string> safetensors;
  std::vector<std::pair<std::string, std::string>> blob_files;  // blob name, path
  std::vector<std::string> indexes;                            // *.safetensors.index.json
};

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// The names of a directory, sorted.
Result<std::vector<std::string>> ListDir(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (!d) return Status::FromErrno(errno, "listing " + path);
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    if (std::string_view n = e->d_name; n != "." && n != "..") names.emplace_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

// A directory (a Hugging Face model directory written by save_pretrained)
// gives its *.safetensors files as tensors, its *.safetensors.index.json as a
// check, and every other regular file as a blob of the same name.
// Subdirectories, hidden files and torch.save weight files beside the
// safetensors ones are left out, and said so through `left_out`; a
// directory whose weights are torch.save files only is refused.
//
// A symbolic link among its names is followed only if it resolves inside
// the directory, or with `follow_symlinks`; each one followed is added to
// `links` (link, target). A link elsewhere is refused (InvalidArgument
// naming it and its target); a dangling one is left out.
Status AddImportPath(const std::string& path, Found* in, const std::function<void(const std::string&)>& left_out,
                     bool follow_symlinks, std::vector<std::pair<std::string, std::string>>* links) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return Status::FromErrno(errno, "reading " + path);
  if (!S_ISDIR(st.st_mode)) {
    in->safetensors.push_back(path);
    return Status::OK();
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(path));
  const size_t safetensors_before = in->safetensors.size();
  std::vector<std::string> torch_weights;
  std::string real_dir;
  std::vector<std::string> outside;  // "LINK -> TARGET" of links that leave the directory
  for (const auto& n : names) {
    const std::string full = path + "/" + n;
    if (::lstat(full.c_str(), &st) != 0) return Status::FromErrno(errno, "reading " + full);
    if (S_ISLNK(st.st_mode) && n[0] != '.') {
      // A link is followed only where it stays inside the directory, or
      // when the caller says so: otherwise it could bring in any file the
      // importer can read (as root, /etc/shadow as config.json).
      if (real_dir.empty()) {
        char* r = ::realpath(path.c_str(), nullptr);
        if (!r) return Status::FromErrno(errno, "resolving " + path);
        real_dir = r;
        std::free(r);
      }
      char* r = ::realpath(full.c_str(), nullptr);
      const std::string target = r ? std::string(r) : std::string();
      std::free(r);
      if (target.empty()) {
        if (left_out) left_out(full + " (a symbolic link to nothing)");
        continue;
      }
      const bool inside = target.size() > real_dir.size() && target.starts_with(real_dir) &&
                          (real_dir == "/" || target[real_dir.size()] == '/');
      if (!inside && !follow_symlinks) {
        outside.push_back(full + " -> " + target);
        continue;
      }
      if (links) links->emplace_back(full, target);
    }
    if (::stat(full.c_str(), &st) != 0) return Status::FromErrno(errno, "reading " + full);
    if (n[0] == '.' || !S_ISREG(st.st_mode)) {
      if (left_out) {
        left_out(full + " (" + (n[0] == '.' ? "a hidden file" : S_ISDIR(st.st_mode) ? "a directory" : "not a regular file") +
                 ")");
      }
      continue;
    }
    if (EndsWith(n, ".safetensors")) {
      in->safetensors.push_back(full);
    } else if (EndsWith(n, ".safetensors.index.json")) {
      in->indexes.push_back(full);
    } else if (IsTorchWeightsFileName(n)) {
      torch_weights.push_back(full);
    } else {
      in->blob_files.emplace_back(n, full);
    }
  }
  if (!outside.empty()) {
    return Status::InvalidArgument(
        outside.front() + (outside.size() > 1 ? " (and " + std::to_string(outside.size() - 1) + " more)" : "") +
        ": a symbolic link in " + path + " to a file outside it, refused; import with --follow-symlinks (Python: "
        "follow_symlinks=True) to take what links point to wherever it is (a Hugging Face cache snapshot links "
        "to ../../blobs)");
  }
  if (!torch_weights.empty()) {
    if (in->safetensors.size() == safetensors_before) {
      return Status::Unsupported(path + " holds its weights as torch.save files (" +
                                 torch_weights.front().substr(path.size() + 1) +
                                 (torch_weights.size() > 1 ? " and more" : "") +
                                 "), which are read with torch: import it with 'ckpt import' or "
                                 "ckptfs.formats.import_checkpoint, with torch installed");
    }
    for (const auto& w : torch_weights) {
      if (left_out) left_out(w + " (torch.save weights; the directory's safetensors files are imported)");
    }
  }
  if (in->safetensors.size() == safetensors_before) {
    // Not a model directory: perhaps a training run's directory, with a
    // checkpoint in each subdirectory.
    std::vector<std::string> inside;
    for (const auto& n : names) {
      const std::string full = path + "/" + n;
      if (n[0] == '.' || ::stat(full.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
      auto sub = ListDir(full);
      if (!sub.ok()) continue;
      for (const auto& m : *sub) {
        if (m == ".metadata" || EndsWith(m, ".safetensors") || IsTorchWeightsFileName(m)) {
          inside.push_back(n);
          break;
        }
      }
    }
    std::string hint;
    for (size_t i = 0; i < inside.size() && i < 3; ++i) hint += (i ? ", " : "") + inside[i];
    if (inside.size() > 3) hint += " and " + std::to_string(inside.size() - 3) + " more";
    if (!hint.empty()) hint = "; checkpoints are in its subdirectories (" + hint + "): import each by its own path";
    return Status::InvalidArgument(path + " holds no weights to import (no *.safetensors, no DCP .metadata)" + hint);
  }
  return Status::OK();
}

// A regular file (after symbolic links) of at most `limit` bytes, whole.
// Opened without blocking, so a FIFO is refused instead of waited on.
Result<std::string> ReadRegularFile(const std::string& path, uint64_t limit) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, "opening " + path);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + " is not a regular file");
  }
  if (Status pseudo = RefusePseudoFile(fd, path); !pseudo.ok()) {
    ::close(fd);
    return pseudo;
  }
  if (static_cast<uint64_t>(st.st_size) > limit) {
    ::close(fd);
    return Status::InvalidArgument(path + " has " + std::to_string(st.st_size) + " bytes, more than the " +
                                   std::to_string(limit) + " such a file may have");
  }
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::read(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Status err = n < 0 ? Status::FromErrno(errno, "reading " + path)
                         : Status::IOError(path + " became shorter while it was read");
      ::close(fd);
      return err;
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return data;
}

// A safetensors index must name exactly the tensors the files hold, each in
// the file that holds it.
Status CheckSafetensorsIndex(const std::string& index_path,
                             const std::vector<std::unique_ptr<SafetensorsFile>>& files) {
  auto text = ReadRegularFile(index_path, 64 << 20);
  if (!text.ok()) return text.status();
  auto index = Json::Parse(*text, text->size() / 4 + 64);
  if (!index.ok()) return index.status().WithContext(index_path);
  const Json* map = index->Find("weight_map");
  if (!map || !map->is_object()) return Status::InvalidArgument(index_path + ": no \"weight_map\" object");
  std::map<std::string, std::string> where;  // tensor -> file name
  for (const auto& f : files) {
    const std::string base = f->path().substr(f->path().find_last_of('/') + 1);
    for (const auto& t : f->header().tensors) where[t.name] = base;
  }
  for (const auto& [tensor, file] : map->as_object()) {
    auto it = where.find(tensor);
    if (!file.is_string()) return Status::InvalidArgument(index_path + ": the file of '" + tensor + "' is not a string");
    if (it == where.end()) {
      return Status::InvalidArgument(index_path + " names tensor '" + tensor + "' (in " + file.as_string() +
                                     "), which no imported file holds");
    }
    if (it->second != file.as_string()) {
      return Status::InvalidArgument(index_path + " places tensor '" + tensor + "' in " + file.as_string() +
                                     ", but it is in " + it->second);
    }
  }
  if (map->as_object().size() != where.size()) {
    for (const auto& [tensor, file] : where) {
      if (!map->Find(tensor)) {
        return Status::InvalidArgument(index_path + " does not name tensor '" + tensor + "' of " + file);
      }
    }
  }
  return Status::OK();
}

}  // namespace

bool IsTorchWeightsFileName(std::string_view name) {
  return name.starts_with("pytorch_model") && (EndsWith(name, ".bin") || name == "pytorch_model.bin.index.json");
}

bool HoldsTorchWeightsOnly(const std::string& dir) {
  auto names = ListDir(dir);
  if (!names.ok()) return false;
  bool torch_weights = false;
  for (const auto& n : *names) {
    if (EndsWith(n, ".safetensors")) return false;
    torch_weights = torch_weights || IsTorchWeightsFileName(n);
  }
  return torch_weights;
}

PreparedImport::PreparedImport() = default;
PreparedImport::PreparedImport(PreparedImport&&) noexcept = default;
PreparedImport& PreparedImport::operator=(PreparedImport&&) noexcept = default;
PreparedImport::~PreparedImport() = default;

Result<PreparedImport> PreparedImport::Prepare(const ImportInputs& inputs) {
  PreparedImport p;
  Found found;
  for (const auto& path : inputs.paths) {
    CKPT_RETURN_IF_ERROR(AddImportPath(path, &found, inputs.left_out, inputs.follow_symlinks, &p.links_));
  }
  for (const auto& path : found.safetensors) {
    CKPT_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(path));
    auto shards = ShardsOfSafetensors(f->header());
    if (!shards.ok()) return shards.status().WithContext(path);
    for (const auto& t : f->header().tensors) {
      Status name_ok = ValidateMemberName("tensor name", t.name);
      if (!name_ok.ok()) return name_ok.WithContext(path);
      p.total_ += t.end - t.begin;
    }
    p.files_.push_back(std::move(f));
    p.shards_.push_back(std::move(shards).value());
  }
  // The per-rank files of torch's HuggingFaceStorageWriter give offsets
  // only: a tensor's global shape is the extent of all of its shards.
  {
    std::vector<const SafetensorsHeader*> headers;
    for (const auto& f : p.files_) headers.push_back(&f->header());
    CKPT_RETURN_IF_ERROR(WidenToExtents(headers, p.shards_));
  }
  // A whole checkpoint's files must hold every element of each tensor. Too
  // few is a rank's part of a sharded checkpoint given alone: refused now,
  // rather than at the commit after every byte was written. (Gaps between
  // parts that do add up are still found at the commit.)
  if (!inputs.partial) {
    std::map<std::string_view, std::pair<uint64_t, uint64_t>> held;  // name -> (elements held, elements)
    for (size_t fi = 0; fi < p.files_.size(); ++fi) {
      for (const SafetensorsShard& shard : p.shards_[fi]) {
        auto& h = held[p.files_[fi]->header().tensors[shard.tensor].name];
        h.first += shard.region.NumElements();
        h.second = NumElements(shard.global_shape);
      }
    }
    for (const auto& [tensor, h] : held) {
      if (h.first < h.second) {
        return Status::InvalidArgument(
            "tensor '" + std::string(tensor) + "': the files hold " + std::to_string(h.first) + " of its " +
            std::to_string(h.second) + " elements; nothing was written. To import one rank's part of a sharded "
            "checkpoint, give its rank and the world size (ckpt import --rank R --world-size N; Python: rank=, "
            "world_size=): the other ranks' imports complete it");
      }
    }
  }
  for (const auto& index : found.indexes) CKPT_RETURN_IF_ERROR(CheckSafetensorsIndex(index, p.files_));
  // Blob files are mapped, not read into memory: a model directory may hold
  // files of many GB beside its weights (a trainer's optimizer.pt). Each
  // must be a regular file after symbolic links (not a FIFO, a device such
  // as /dev/zero, or a directory).
  for (const auto& [blob_name, path] : found.blob_files) {
    CKPT_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path, /*sequential=*/true));
    p.total_ += file->size();
    p.blobs_.push_back({blob_name, std::move(file)});
  }
  for (const auto& [blob_name, path] : inputs.blob_files) {
    CKPT_RETURN_IF_ERROR(ValidateMemberName("blob name", blob_name));
    auto file = MappedFile::Open(path, /*sequential=*/true);
    if (!file.ok()) return file.status().WithContext("blob " + blob_name);
    p.total_ += (*file)->size();
    p.blobs_.push_back({blob_name, std::move(file).value()});
  }
  return p;
}

Json PreparedImport::Describe() const {
  // One entry per tensor, its shards' bytes summed, in first-seen order.
  std::vector<std::string> order;
  std::map<std::string, Json> tensors;
  std::map<std::string, std::pair<uint64_t, uint64_t>> sizes;  // bytes, shards
  uint64_t tensor_bytes = 0, blob_bytes = 0;
  for (size_t f = 0; f < files_.size(); ++f) {
    const SafetensorsHeader& h = files_[f]->header();
    for (const SafetensorsShard& s : shards_[f]) {
      const SafetensorsTensor& t = h.tensors[s.tensor];
      auto [it, fresh] = tensors.try_emplace(t.name);
      if (fresh) {
        order.push_back(t.name);
        Json j = Json::MakeObject();
        j.Set("name", t.name);
        j.Set("dtype", std::string(DTypeName(t.dtype)));
        Json shape = Json::MakeArray();
        for (uint64_t d : s.global_shape) shape.Push(d);
        j.Set("shape", std::move(shape));
        it->second = std::move(j);
      }
      sizes[t.name].first += t.end - t.begin;
      sizes[t.name].second += 1;
      tensor_bytes += t.end - t.begin;
    }
  }
  Json list = Json::MakeArray();
  for (const auto& name : order) {
    Json j = std::move(tensors[name]);
    j.Set("bytes", sizes[name].first);
    j.Set("shards", sizes[name].second);
    list.Push(std::move(j));
  }
  Json blobs = Json::MakeArray();
  for (const Blob& b : blobs_) {
    Json j = Json::MakeObject();
    j.Set("name", b.name);
    j.Set("bytes", b.file->size());
    blob_bytes += b.file->size();
    blobs.Push(std::move(j));
  }
  Json out = Json::MakeObject();
  out.Set("tensors", std::move(list));
  out.Set("blobs", std::move(blobs));
  out.Set("tensor_bytes", tensor_bytes);
  out.Set("blob_bytes", blob_bytes);
  Json links = Json::MakeArray();
  for (const auto& [link, target] : links_) {
    Json j = Json::MakeObject();
    j.Set("path", link);
    j.Set("target", target);
    links.Push(std::move(j));
  }
  out.Set("links", std::move(links));
  return out;
}

Status PreparedImport::PutInto(CheckpointWriter& writer, const ProgressFn& progress,
                               const std::function<bool()>& cancelled) const {
  uint64_t done = 0;
  auto stop = [&] { return cancelled && cancelled(); };
  const Status kCancelled = Status::FailedPrecondition("import cancelled");
  for (size_t fi = 0; fi < files_.size(); ++fi) {
    const SafetensorsFile& f = *files_[fi];
    for (const SafetensorsShard& shard : shards_[fi]) {
      if (stop()) return kCancelled;
      const SafetensorsTensor& t = f.header().tensors[shard.tensor];
      TensorInfo info{t.name, t.dtype, shard.global_shape};
      // Lent from the mapping: the writer's threads keep it while they
      // work, so the next tensor is put without waiting for this one.
      std::span<const std::byte> data = f.Data(t);
      auto source = MappedSource::Make(f.mapping(), static_cast<uint64_t>(data.data() - f.mapping()->bytes().data()),
                                       data.size());
      if (!source.ok()) return source.status();
      Status st = writer.PutShard(info, shard.region, *source);
      if (!st.ok()) return st.WithContext(f.path());
      done += t.end - t.begin;
      if (progress) progress(done, total_);
    }
  }
  for (const auto& b : blobs_) {
    if (stop()) return kCancelled;
    CKPT_RETURN_IF_ERROR(writer.PutBlob(b.name, b.file->bytes()));
    done += b.file->size();
    if (progress) progress(done, total_);
  }
  if (stop()) return kCancelled;
  return Status::OK();
}

}  // namespace ckptfs
