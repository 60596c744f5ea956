#include "ckpt/files.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <span>
#include <unordered_set>

#include "ckpt/describe.h"
#include "core/json.h"
#include "ckpt/merge.h"
#include "io/file_names.h"

namespace ckptfs {

Result<std::unique_ptr<CheckpointFiles>> CheckpointFiles::Build(std::unique_ptr<CheckpointReader> reader) {
  std::unique_ptr<CheckpointFiles> f(new CheckpointFiles());
  const auto& tensors = reader->tensors();
  const auto& blobs = reader->blobs();
  f->files_.reserve(tensors.size() + 2 + 2 * blobs.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorRecord& t = tensors[i];
    // .npy headers are made again on each read that needs one, not kept.
    f->files_.push_back({FileKind::kTensor, FileNameFor(t.name, ".npy"), i, NpyHeader(t.dtype, t.shape).size() + t.ByteSize()});
  }
  // "format": "pt" is what Hugging Face's loaders ask of a safetensors file
  // before they read it as torch weights.
  // model.safetensors: the offsets of its tensors and its header's size;
  // the header itself is made when it is read, like metadata.json.
  f->safetensors_metadata_ = {{"format", "pt"}, {"ckptfs.checkpoint", reader->info().name}};
  if (reader->info().step) f->safetensors_metadata_.emplace_back("ckptfs.step", std::to_string(*reader->info().step));
  f->reader_ = std::move(reader);
  f->safetensors_header_size_ = f->WriteSafetensorsHeaderTo(nullptr);
  f->tensor_offsets_.reserve(tensors.size());
  uint64_t pos = f->safetensors_header_size_;
  for (const TensorRecord& t : tensors) {
    f->tensor_offsets_.push_back(pos);
    pos += t.ByteSize();
  }
  f->files_.push_back({FileKind::kSafetensors, "model.safetensors", 0, pos});

  // metadata.json: only its size now (written a tensor at a time and
  // dropped); its text is made when it is first read.
  uint64_t metadata_size = 0;
  CKPT_RETURN_IF_ERROR(f->WriteMetadata([&](std::string_view piece) { metadata_size += piece.size(); }));
  f->files_.push_back({FileKind::kMetadata, "metadata.json", 0, metadata_size});
  for (size_t i = 0; i < blobs.size(); ++i) {
    f->files_.push_back({FileKind::kBlob, "blobs/" + FileNameFor(blobs[i].name, ""), i, blobs[i].size});
  }
  // A blob whose name is a plain file name also stands beside the tensors,
  // unless a file there has that name: a checkpoint imported from a model
  // directory is then a model directory again (config.json and tokenizer
  // files next to model.safetensors, as Hugging Face's loaders expect).
  std::set<std::string, std::less<>> taken = {"blobs"};
  for (const auto& file : f->files_) taken.insert(file.name);
  for (size_t i = 0; i < blobs.size(); ++i) {
    const std::string& n = blobs[i].name;
    if (FileNameFor(n, "") != n || taken.count(n)) continue;
    taken.insert(n);
    f->files_.push_back({FileKind::kBlob, n, i, blobs[i].size});
  }
  f->opened_.reset(new std::atomic<bool>[f->files_.size()]());
  f->by_path_.resize(f->files_.size());
  for (size_t i = 0; i < f->files_.size(); ++i) f->by_path_[i] = static_cast<uint32_t>(i);
  std::sort(f->by_path_.begin(), f->by_path_.end(),
            [&](uint32_t a, uint32_t b) { return f->files_[a].name < f->files_[b].name; });
  std::vector<size_t> by_name(tensors.size());
  for (size_t i = 0; i < by_name.size(); ++i) by_name[i] = i;
  std::sort(by_name.begin(), by_name.end(), [&](size_t a, size_t b) { return f->files_[a].name < f->files_[b].name; });
  f->next_tensor_file_.assign(tensors.size(), SIZE_MAX);
  for (size_t k = 0; k + 1 < by_name.size(); ++k) f->next_tensor_file_[by_name[k]] = by_name[k + 1];
  return f;
}

// The text is `ckpt show --json`'s description plus each tensor's and
// blob's file, as Json::Dump(2) writes it, but made one tensor at a time:
// a checkpoint of millions of tensors never holds the whole tree.
Status CheckpointFiles::WriteMetadata(const std::function<void(std::string_view)>& out) const {
  const CheckpointReader& r = *reader_;
  CKPT_ASSIGN_OR_RETURN(StoredSizes stored, r.StoredBytes());
  Json head = DescribeRecord(r.info());
  head.Set("stored_bytes", stored.total);
  head.Set("tensors", Json::MakeArray());
  Json blob_list = Json::MakeArray();
  for (size_t i = 0; i < r.blobs().size(); ++i) {
    Json b = DescribeBlob(r.blobs()[i]);
    b.Set("file", "blobs/" + FileNameFor(r.blobs()[i].name, ""));
    blob_list.Push(std::move(b));
  }
  head.Set("blobs", std::move(blob_list));
  // The head as Dump(2) writes it with an empty tensor list; the tensors
  // go where "[]" stands, each indented as an element of that list.
  const std::string text = head.Dump(2) + "\n";
  const std::string_view marker = "\"tensors\": []";
  const size_t at = text.find(marker);
  if (at == std::string::npos) return Status::Internal("metadata.json: no tensor list to fill");
  const size_t open = at + marker.size() - 1;  // the ']'
  out(std::string_view(text).substr(0, open));
  std::string piece;
  for (size_t i = 0; i < r.tensors().size(); ++i) {
    Json t = DescribeTensor(r.tensors()[i], stored.tensors[i]);
    t.Set("file", files_[i].name);
    piece = i ? ",\n    " : "\n    ";
    const std::string dumped = t.Dump(2);
    for (char c : dumped) {
      piece.push_back(c);
      if (c == '\n') piece.append(4, ' ');
    }
    out(piece);
  }
  out(r.tensors().empty() ? std::string_view() : std::string_view("\n  "));
  out(std::string_view(text).substr(open));
  return Status::OK();
}

uint64_t CheckpointFiles::WriteSafetensorsHeaderTo(const std::function<void(std::string_view)>& out) const {
  const auto& tensors = reader_->tensors();
  return WriteSafetensorsHeader(
      tensors.size(), [&](size_t i) { return TensorMetaRef{tensors[i].name, tensors[i].dtype, tensors[i].shape}; },
      safetensors_metadata_, out);
}

Result<std::shared_ptr<const std::string>> CheckpointFiles::Text(FileKind kind) const {
  std::lock_guard lock(text_mu_);
  std::weak_ptr<const std::string>& cached = kind == FileKind::kMetadata ? metadata_ : safetensors_header_;
  if (auto live = cached.lock()) return live;
  auto text = std::make_shared<std::string>();
  auto append = [&](std::string_view piece) { text->append(piece); };
  if (kind == FileKind::kMetadata) {
    text->reserve(files_[reader_->tensors().size() + 1].size);
    CKPT_RETURN_IF_ERROR(WriteMetadata(append));
  } else {
    text->reserve(safetensors_header_size_);
    WriteSafetensorsHeaderTo(append);
  }
  cached = text;
  return std::shared_ptr<const std::string>(std::move(text));
}

const CheckpointFile* CheckpointFiles::Find(std::string_view path) const {
  auto it = std::lower_bound(by_path_.begin(), by_path_.end(), path,
                             [&](uint32_t i, std::string_view p) { return std::string_view(files_[i].name) < p; });
  return it != by_path_.end() && files_[*it].name == path ? &files_[*it] : nullptr;
}

const CheckpointFile* CheckpointFiles::NextTensorFile(const CheckpointFile& file) const {
  if (file.kind != FileKind::kTensor) return nullptr;
  const size_t next = next_tensor_file_[file.index];
  return next == SIZE_MAX ? nullptr : &files_[next];
}

uint64_t CheckpointFiles::HeaderSize(const CheckpointFile& file) const {
  switch (file.kind) {
    case FileKind::kTensor: {
      const TensorRecord& t = reader_->tensors()[file.index];
      return file.size - t.ByteSize();
    }
    case FileKind::kSafetensors: return safetensors_header_size_;
    default: return 0;
  }
}

size_t CheckpointFiles::SafetensorsTensorAt(uint64_t pos) const {
  const auto& offsets = tensor_offsets_;
  const auto& tensors = reader_->tensors();
  // The last tensor starting at or before pos; zero-size tensors share their
  // offset with the next one and are stepped over.
  size_t i = static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), pos) - offsets.begin()) - 1;
  while (i + 1 < offsets.size() && offsets[i] + tensors[i].ByteSize() <= pos) ++i;
  return i;
}

Result<bool> CheckpointFiles::Walk(const CheckpointFile& file, uint64_t offset, size_t n,
                                   const std::function<void(std::string_view, bool)>& literal,
                                   const std::function<Result<bool>(size_t, uint64_t, size_t)>& tensor) const {
  auto part = [&](std::string_view s, uint64_t at, size_t len, bool transient) {
    if (len > 0) literal(s.substr(at, len), transient);
  };
  switch (file.kind) {
    case FileKind::kMetadata: {
      // Held here for the call; ReadInPlace and open files hold it longer.
      CKPT_ASSIGN_OR_RETURN(auto text, Text(FileKind::kMetadata));
      part(*text, offset, n, false);
      return true;
    }
    case FileKind::kBlob:
      return Status::Internal("a blob has no layout to walk");
    case FileKind::kTensor: {
      const TensorRecord& t = reader_->tensors()[file.index];
      const uint64_t header_size = file.size - t.ByteSize();
      std::string h;
      if (offset < header_size) h = NpyHeader(t.dtype, t.shape);
      size_t in_header = 0;
      if (offset < header_size) {
        in_header = std::min<size_t>(n, header_size - offset);
        part(h, offset, in_header, true);
      }
      if (in_header == n) return true;
      return tensor(file.index, offset + in_header - header_size, n - in_header);
    }
    case FileKind::kSafetensors: {
      size_t done = 0;
      while (done < n) {
        const uint64_t pos = offset + done;
        if (pos < safetensors_header_size_) {
          // Held here for the call; ReadInPlace and open files hold it longer.
          CKPT_ASSIGN_OR_RETURN(auto header, Text(FileKind::kSafetensors));
          const size_t len = std::min<size_t>(n - done, safetensors_header_size_ - pos);
          part(*header, pos, len, false);
          done += len;
          continue;
        }
        const size_t i = SafetensorsTensorAt(pos);
        const uint64_t in = pos - tensor_offsets_[i];
        const size_t len = std::min<uint64_t>(n - done, reader_->tensors()[i].ByteSize() - in);
        CKPT_ASSIGN_OR_RETURN(bool go_on, tensor(i, in, len));
        if (!go_on) return false;
        done += len;
      }
      return true;
    }
  }
  return Status::Internal("unknown file kind");
}

Status CheckpointFiles::Read(const CheckpointFile& file, uint64_t offset, std::span<std::byte> dst) const {
  if (offset > file.size || dst.size() > file.size - offset) {
    return Status::InvalidArgument("read past the end of " + file.name);
  }
  if (dst.empty()) return Status::OK();
  const CheckpointReader& r = *reader_;
  if (file.kind == FileKind::kBlob) return r.ReadBlob(r.blobs()[file.index], offset, dst);
  size_t done = 0;
  return Walk(
             file, offset, dst.size(),
             [&](std::string_view s, bool) {
               std::memcpy(dst.data() + done, s.data(), s.size());
               done += s.size();
             },
             [&](size_t i, uint64_t in, size_t len) -> Result<bool> {
               CKPT_RETURN_IF_ERROR(r.ReadBytes(r.tensors()[i], in, dst.subspan(done, len)));
               done += len;
               return true;
             })
      .status();
}

void FilePieces::Clear() {
  if (!slices_.empty()) reader_->Consumed(slices_);
  slices_.clear();
  pieces_.clear();
  text_.reset();
  reader_ = nullptr;
}

Result<bool> CheckpointFiles::ReadInPlace(const CheckpointFile& file, uint64_t offset, size_t n, size_t max_pieces,
                                          FilePieces& out) const {
  out.Clear();
  if (offset > file.size || n > file.size - offset) return Status::InvalidArgument("read past the end of " + file.name);
  if (file.kind == FileKind::kBlob) return false;
  out.reader_ = reader_.get();
  if (file.kind == FileKind::kMetadata || (file.kind == FileKind::kSafetensors && offset < safetensors_header_size_)) {
    CKPT_ASSIGN_OR_RETURN(out.text_, Text(file.kind));  // the pieces point into it
  }
  Result<bool> fits = Walk(
      file, offset, n,
      [&](std::string_view s, bool transient) {
        if (transient) {
          // A header made for this read (at most one per walk): kept by `out`.
          out.owned_.assign(s);
          s = out.owned_;
        }
        out.pieces_.emplace_back(reinterpret_cast<const std::byte*>(s.data()), s.size());
      },
      [&](size_t i, uint64_t in, size_t len) -> Result<bool> {
        const size_t first = out.slices_.size();
        if (out.pieces_.size() >= max_pieces) return false;
        CKPT_ASSIGN_OR_RETURN(bool sliced, reader_->SliceBytes(reader_->tensors()[i], in, len,
                                                               max_pieces - out.pieces_.size(), out.slices_));
        if (!sliced) return false;
        for (size_t k = first; k < out.slices_.size(); ++k) {
          const ChunkSlice& c = out.slices_[k];
          if (c.length > 0) out.pieces_.emplace_back(c.data->data() + c.offset, c.length);
        }
        return true;
      });
  if (!fits.ok() || !*fits) out.Clear();
  return fits;
}

FileReadahead::FileReadahead(const CheckpointFiles& files, const CheckpointFile& file, uint64_t window)
    : files_(files),
      file_(file),
      window_(window),
      slack_(4 * files.reader().chunk_size()) {
  // metadata.json's text and model.safetensors's header are made at their
  // first open and dropped when the last open file lets go of them.
  if (file.kind == FileKind::kMetadata || file.kind == FileKind::kSafetensors) {
    auto text = files.Text(file.kind);
    if (text.ok()) text_ = std::move(text).value();
  }
}

void FileReadahead::ForEachTensorRange(const CheckpointFile& file, uint64_t from, uint64_t to,
                                       const std::function<void(size_t, uint64_t, uint64_t)>& fn) const {
  to = std::min(to, file.size);
  if (from >= to || (file.kind != FileKind::kTensor && file.kind != FileKind::kSafetensors)) return;
  (void)files_.Walk(file, from, to - from, [](std::string_view, bool) {}, [&](size_t i, uint64_t in, size_t n) -> Result<bool> {
    if (n > 0) fn(i, in, n);
    return true;
  });
}

void FileReadahead::PrefetchFileRange(const CheckpointFile& file, uint64_t from, uint64_t to) {
  const CheckpointReader& r = files_.reader();
  ForEachTensorRange(file, from, to, [&](size_t i, uint64_t in, uint64_t n) { r.Prefetch(r.tensors()[i], in, n); });
}

void FileReadahead::PrefetchFollowing(uint64_t from, uint64_t to) {
  uint64_t start = 0;  // where the file `next` starts in the stream of following files
  for (const CheckpointFile* next = files_.NextTensorFile(file_); next && start < to;
       start += next->size, next = files_.NextTensorFile(*next)) {
    if (start + next->size > from) PrefetchFileRange(*next, std::max(from, start) - start, to - start);
  }
}

void FileReadahead::DropBehind(uint64_t until) {
  const CheckpointReader& r = files_.reader();
  if (until < dropped_until_ + r.chunk_size()) return;  // less than a chunk behind: nothing to gain yet
  auto chunks_of = [&](uint64_t from, uint64_t to, const std::function<void(const ChunkRef&)>& take) {
    ForEachTensorRange(file_, from, to, [&](size_t i, uint64_t in, uint64_t n) {
      auto chunks = ChunksForBytes(r.tensors()[i], in, n);
      if (chunks.ok()) {
        for (const ChunkRef& c : *chunks) take(c);
      }
    });
  };
  // What the reader still needs (from `until` to the end of the window)
  // stays, even where a chunk spans both sides.
  std::unordered_set<ChunkId, ChunkIdHash> ahead;
  chunks_of(until, std::max(prefetched_until_, until + r.chunk_size()), [&](const ChunkRef& c) { ahead.insert(c.id); });
  std::vector<ChunkRef> behind;
  chunks_of(dropped_until_, until, [&](const ChunkRef& c) {
    if (!ahead.count(c.id)) behind.push_back(c);
  });
  r.DropCached(behind);
  dropped_until_ = until;
}

void FileReadahead::OnOpen() {
  const size_t index = static_cast<size_t>(&file_ - files_.files_.data());
  if (window_ == 0 || files_.opened_[index].exchange(true)) return;
  if (file_.kind == FileKind::kTensor) {
    const size_t last = files_.last_first_open_.exchange(index);
    const bool follows = last == SIZE_MAX || files_.NextTensorFile(files_.files_[last]) == &file_;
    files_.opens_follow_names_.store(follows);
  }
  std::lock_guard lock(mu_);
  const uint64_t to = std::min(file_.size, files_.HeaderSize(file_) + window_);
  PrefetchFileRange(file_, 0, to);
  prefetched_until_ = to;
}

void FileReadahead::BeforeRead(uint64_t offset, uint64_t n) {
  if (window_ == 0) return;
  std::lock_guard lock(mu_);
  const bool sequential = offset + slack_ >= next_offset_ && offset <= next_offset_ + slack_;
  next_offset_ = std::max(next_offset_, offset + n);
  if (!sequential) {
    next_offset_ = offset + n;
    prefetched_until_ = 0;
    dropped_until_ = offset;
    following_until_ = 0;
    return;
  }
  // Chunks well behind a sequential reader go back to the pool: the cache
  // then holds what is ahead, not everything read so far.
  if (offset > slack_) DropBehind(offset - slack_);
  const uint64_t from = std::max(offset + n, prefetched_until_);
  const uint64_t to = std::min(file_.size, offset + n + window_);
  // Enough is in flight unless the window moved on by half a chunk or more.
  if (to > from + files_.reader().chunk_size() / 2) {
    PrefetchFileRange(file_, from, to);
    prefetched_until_ = to;
  }
  // The part of the window past this file's end, in the files that follow.
  const uint64_t beyond = offset + n + window_ > file_.size ? offset + n + window_ - file_.size : 0;
  if (file_.kind == FileKind::kTensor && beyond > following_until_ + files_.reader().chunk_size() / 2 &&
      files_.opens_follow_names_.load()) {
    PrefetchFollowing(following_until_, beyond);
    following_until_ = beyond;
  }
}

// ---- the model view -----------------------------------------------------------------

namespace {
constexpr std::string_view kModelPrefix = "model.";
// What the Python package stores of a DCP or torch.save state's nesting
// (ckptfs/formats.py STRUCTURE_BLOB): {"dict": [[key, node], ...]},
// {"list"|"tuple": [node, ...]}, {"tensor": name} or {"value": name}.
constexpr std::string_view kStructureBlob = "ckptfs.torch.structure";
constexpr uint64_t kMaxStructureBytes = 64ull << 20;

void CollectValues(const Json& node, std::set<std::string>& values) {
  if (!node.is_object()) return;
  if (const Json* v = node.Find("value"); v && v->is_string()) values.insert(v->as_string());
  for (const char* kind : {"dict", "list", "tuple"}) {
    const Json* items = node.Find(kind);
    if (!items || !items->is_array()) continue;
    for (const Json& item : items->as_array()) {
      // A dict's entries are [key, node] pairs.
      const Json* child = &item;
      if (item.is_array() && item.as_array().size() == 2) child = &item.as_array()[1];
      CollectValues(*child, values);
    }
  }
}

// The saved state's non-tensor items, when its top is a dict holding a
// dict "model" (a training state: {"model": ..., "optim": ...}); nullopt
// otherwise, or when the checkpoint keeps no readable structure.
std::optional<std::set<std::string>> TrainingStateValues(const CheckpointReader& reader) {
  const BlobRecord* blob = reader.FindBlob(kStructureBlob);
  if (blob == nullptr || blob->size == 0 || blob->size > kMaxStructureBytes) return std::nullopt;
  std::string text(blob->size, '\0');
  if (!reader.ReadBlob(*blob, 0, std::as_writable_bytes(std::span(text))).ok()) return std::nullopt;
  auto top = Json::Parse(text);
  if (!top.ok() || !top->is_object()) return std::nullopt;
  const Json* items = top->Find("dict");
  if (!items || !items->is_array()) return std::nullopt;
  bool model = false;
  for (const Json& item : items->as_array()) {
    if (!item.is_array() || item.as_array().size() != 2) return std::nullopt;
    const Json& key = item.as_array()[0];
    const Json& node = item.as_array()[1];
    if (key.is_string() && key.as_string() == "model" && node.is_object() && node.Find("dict")) model = true;
  }
  if (!model) return std::nullopt;
  std::set<std::string> values;
  CollectValues(*top, values);
  return values;
}
}  // namespace

bool HasModelView(const CheckpointFiles& files) {
  if (files.Find(kModelViewDir) != nullptr) return false;
  const auto& tensors = files.reader().tensors();
  if (std::none_of(tensors.begin(), tensors.end(), [](const TensorRecord& t) {
        return t.name.size() > kModelPrefix.size() && std::string_view(t.name).starts_with(kModelPrefix);
      })) {
    return false;
  }
  return TrainingStateValues(files.reader()).has_value();
}

std::unique_ptr<CheckpointReader> ModelViewOf(const CheckpointFiles& files) {
  if (files.Find(kModelViewDir) != nullptr) return nullptr;
  auto values = TrainingStateValues(files.reader());
  if (!values) return nullptr;
  auto part = files.reader().Subset(kModelPrefix, [&](const BlobRecord& b) {
    return b.name != kStructureBlob && !values->count(b.name);
  });
  if (part->tensors().empty()) return nullptr;
  return part;
}

}  // namespace ckptfs
