// A committed checkpoint presented as files, without FUSE: what the mount
// shows, what `ckpt export` writes and what `ckpt cat` prints come from
// here, so they are the same bytes.
//
//   <tensor file name>.npy   one per tensor, the whole merged tensor (.npy 1.0/2.0)
//   model.safetensors        every tensor, with ckptfs.checkpoint/ckptfs.step metadata
//   metadata.json            `ckpt show --json` plus the file showing each tensor and blob
//   blobs/<blob file name>   one per blob, its bytes
//   <blob name>              the same bytes again for each blob whose name is a plain
//                            file name no other file here has (config.json beside
//                            model.safetensors, for Hugging Face's loaders)
//
// File names escape tensor and blob names (io/file_names.h). Sizes are exact
// and known without reading tensor data. Read() fills any byte range; a
// FileReadahead per open file decodes the chunks a sequential reader will
// want next, across tensor boundaries.
//
// Thread safety: a CheckpointFiles is immutable once built and may be read
// from any number of threads. A FileReadahead belongs to one open file; its
// methods are serialised by an internal mutex.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/read_plan.h"
#include "ckpt/repository.h"
#include "io/safetensors.h"

namespace ckptfs {

enum class FileKind : uint8_t { kTensor, kSafetensors, kMetadata, kBlob };

struct CheckpointFile {
  FileKind kind;
  std::string name;   // path inside the checkpoint's directory ("blobs/x", and "x" for a plain-named blob)
  size_t index = 0;   // tensor or blob index in the reader's lists
  uint64_t size = 0;  // exact, in bytes
};

// Bytes of a file served in place (CheckpointFiles::ReadInPlace): pieces of
// memory, in file order, that this object keeps alive until Clear. Clear
// tells the chunk cache that the chunk bytes among them have been used.
// Reusable from read to read, so its vectors stop allocating.
class FilePieces {
 public:
  FilePieces() = default;
  FilePieces(const FilePieces&) = delete;
  FilePieces& operator=(const FilePieces&) = delete;
  ~FilePieces() { Clear(); }
  const std::vector<std::span<const std::byte>>& pieces() const { return pieces_; }
  void Clear();

 private:
  friend class CheckpointFiles;
  const CheckpointReader* reader_ = nullptr;
  std::vector<std::span<const std::byte>> pieces_;
  std::vector<ChunkSlice> slices_;
  std::string owned_;  // a .npy header made for the read (its capacity is reused)
  std::shared_ptr<const std::string> text_;  // metadata.json's text, while pieces point into it
};

class CheckpointFiles {
 public:
  // The files of `reader`'s checkpoint. Reads the catalog (stored sizes for
  // metadata.json), never tensor data.
  static Result<std::unique_ptr<CheckpointFiles>> Build(std::unique_ptr<CheckpointReader> reader);

  const CheckpointReader& reader() const { return *reader_; }
  // Tensors in the reader's order, then model.safetensors, metadata.json and
  // the blobs in the reader's order.
  const std::vector<CheckpointFile>& files() const { return files_; }
  // The file at `path` ("x.npy", "blobs/rng"); nullptr when there is none.
  // O(log n).
  const CheckpointFile* Find(std::string_view path) const;
  const CheckpointFile& tensor_file(size_t tensor) const { return files_[tensor]; }
  const CheckpointFile& safetensors_file() const { return files_[reader_->tensors().size()]; }
  const CheckpointFile& blob_file(size_t blob) const { return files_[reader_->tensors().size() + 2 + blob]; }

  // Copies bytes [offset, offset + dst.size()) of `file` into dst. InvalidArgument
  // when the range runs past the end; a read error names the chunk and pack.
  Status Read(const CheckpointFile& file, uint64_t offset, std::span<std::byte> dst) const;

  // Bytes [offset, offset + n) of `file` as pieces of memory instead of a
  // copy: the headers and metadata held here and slices of decoded chunks
  // in the chunk cache (CheckpointReader::SliceBytes). False, with `out`
  // empty, for blobs and for ranges that would take more than max_pieces
  // pieces (e.g. a narrow column shard contributes a piece per row): use
  // Read then. Errors as for Read.
  Result<bool> ReadInPlace(const CheckpointFile& file, uint64_t offset, size_t n, size_t max_pieces,
                           FilePieces& out) const;
  // Where tensor data of `file` starts: the .npy header's size, or for
  // model.safetensors its header's size. 0 for other files.
  uint64_t HeaderSize(const CheckpointFile& file) const;
  // The .npy file after `file` in byte order of file names (the order of
  // the mount's directory listing, of `sorted(os.listdir())` and of a shell
  // glob in the C locale); nullptr after the last one and for other files.
  const CheckpointFile* NextTensorFile(const CheckpointFile& file) const;

 private:
  CheckpointFiles() = default;
  friend class FileReadahead;
  // Walks bytes [offset, offset + n) of a tensor, safetensors or metadata
  // file in order: header and metadata bytes go to `literal` (with
  // transient true when they were made for this walk and vanish after the
  // call, as .npy headers do; false when held here for as long as this
  // object lives), tensor data to `tensor` (tensor index, offset in it,
  // length), which returns false to stop the walk; the result is then false.
  Result<bool> Walk(const CheckpointFile& file, uint64_t offset, size_t n,
                    const std::function<void(std::string_view, bool)>& literal,
                    const std::function<Result<bool>(size_t, uint64_t, size_t)>& tensor) const;
  // metadata.json's text, in pieces, to `out`.
  Status WriteMetadata(const std::function<void(std::string_view)>& out) const;
  // metadata.json's text (kind kMetadata) or model.safetensors's header
  // (kSafetensors): the one in use, or made anew when nobody holds it.
  Result<std::shared_ptr<const std::string>> Text(FileKind kind) const;
  // model.safetensors's header, in pieces to `out` (null: counted only);
  // returns its size.
  uint64_t WriteSafetensorsHeaderTo(const std::function<void(std::string_view)>& out) const;
  // The tensor holding byte `pos` of model.safetensors (pos past its header).
  size_t SafetensorsTensorAt(uint64_t pos) const;

  std::unique_ptr<CheckpointReader> reader_;
  std::vector<CheckpointFile> files_;
  std::unique_ptr<std::atomic<bool>[]> opened_;  // per file: opened before
  std::vector<size_t> next_tensor_file_;          // per tensor file: NextTensorFile's index
  std::vector<uint32_t> by_path_;                 // indices of files_ in name order: Find's binary search
  // First opens of .npy files: the last one, and whether each followed its
  // predecessor in name order (only then do readers prefetch across files).
  mutable std::atomic<size_t> last_first_open_{SIZE_MAX};
  mutable std::atomic<bool> opens_follow_names_{true};
  std::vector<std::pair<std::string, std::string>> safetensors_metadata_;
  uint64_t safetensors_header_size_ = 0;
  std::vector<uint64_t> tensor_offsets_;  // in model.safetensors, per tensor
  mutable std::mutex text_mu_;
  // Made on demand, held by readers only (guarded by text_mu_).
  mutable std::weak_ptr<const std::string> metadata_, safetensors_header_;
};

// ---- the model view of a training checkpoint ----
// A training state saved through DCP or torch.save ({"model": ...,
// "optim": ...}) names the model's tensors "model.…" beside the
// optimizer's, so from_pretrained does not load its directory. Its model
// view (the mount's NAME/model/) reads the tensors under "model." named
// without it, and the blobs that are not items of the saved state
// (config.json and the other files saved beside it). A checkpoint has one
// when the nesting the Python package stores with it (the blob
// "ckptfs.torch.structure") has a dict "model" at its top, and no file of
// its directory is named "model". Deciding reads that blob.
inline constexpr std::string_view kModelViewDir = "model";
bool HasModelView(const CheckpointFiles& files);
// The view's reader (CheckpointReader::Subset); null when there is none.
std::unique_ptr<CheckpointReader> ModelViewOf(const CheckpointFiles& files);

// The sequential-read policy of one open file. A reader that continues
// where it stopped (within a few chunks: kernel readahead sends requests
// slightly out of order) gets the next `window` bytes of tensor data decoded
// ahead of it into the repository's chunk cache; in model.safetensors the
// window runs on into the following tensors. Chunks it has left well behind
// are dropped from the cache (drop-behind), so a sequential read circulates
// a window's worth of buffers instead of filling the cache with data the
// kernel's page cache already holds.
//
// A reader nearing the end of a .npy file gets the rest of its window from
// the following .npy files in name order (CheckpointFiles::NextTensorFile),
// so that `cat DIR/*.npy` or an np.load loop finds a file's first chunks
// decoded when it opens it. This stops while files are being opened out of
// that order (each first open is checked against it) and resumes once they
// are opened in it again.
class FileReadahead {
 public:
  FileReadahead(const CheckpointFiles& files, const CheckpointFile& file, uint64_t window);
  // When the file is opened: starts decoding its first chunks, the first
  // time the file is opened only (later opens are usually served from the
  // kernel's page cache and should cost nothing).
  void OnOpen();
  // Before bytes [offset, offset + n) are read.
  void BeforeRead(uint64_t offset, uint64_t n);
  // The file offset up to which data has been asked for.
  uint64_t prefetched_until() const {
    std::lock_guard lock(mu_);
    return prefetched_until_;
  }

 private:
  // Calls fn(tensor index, offset in the tensor, length) for the tensor
  // data of `file` between file offsets [from, to).
  void ForEachTensorRange(const CheckpointFile& file, uint64_t from, uint64_t to,
                          const std::function<void(size_t, uint64_t, uint64_t)>& fn) const;
  // Asks for tensor data of `file` between file offsets [from, to).
  void PrefetchFileRange(const CheckpointFile& file, uint64_t from, uint64_t to);
  // Asks for bytes [from, to) of the .npy files that follow this one, taken
  // as one stream (NextTensorFile).
  void PrefetchFollowing(uint64_t from, uint64_t to);
  // Drops from the chunk cache the chunks of [dropped_until_, until) that
  // the reader does not need again.
  void DropBehind(uint64_t until);

  const CheckpointFiles& files_;
  const CheckpointFile& file_;
  const uint64_t window_;
  const uint64_t slack_;
  mutable std::mutex mu_;
  uint64_t next_offset_ = 0;       // furthest byte a reader reached
  uint64_t prefetched_until_ = 0;  // file offset up to which prefetch was asked
  uint64_t dropped_until_ = 0;     // file offset before which chunks were dropped
  uint64_t following_until_ = 0;   // bytes of the following files prefetch was asked for
  std::shared_ptr<const std::string> text_;  // metadata.json's, while this file is open
};

}  // namespace ckptfs
