// Importing safetensors files and Hugging Face model directories into a
// checkpoint: `ckpt import` and the Python package's import_safetensors.
//
// In two steps, so that nothing is written unless every input is sound:
// Prepare reads and checks every input (headers, shard maps, names,
// coverage, an index's weight map, blob files), then PutInto writes into a
// CheckpointWriter that the caller begins and commits.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckpt/repository.h"
#include "core/json.h"
#include "core/status.h"

namespace ckptfs {

class MappedFile;
class SafetensorsFile;
struct SafetensorsShard;

// The weight files of a model directory that transformers wrote as
// torch.save files before safetensors: pytorch_model.bin, its shards
// pytorch_model-0000K-of-0000N.bin and pytorch_model.bin.index.json.
bool IsTorchWeightsFileName(std::string_view name);

// Whether directory `dir` holds such weight files and no *.safetensors: its
// weights are read with torch (the Python package), not by the engine.
bool HoldsTorchWeightsOnly(const std::string& dir);

struct ImportInputs {
  // Safetensors files, or model directories (as save_pretrained writes
  // them): a directory gives its *.safetensors files as tensors, checks them
  // against its *.safetensors.index.json, and gives every other regular
  // file as a blob of the same name; subdirectories and hidden files are
  // left out and passed to `left_out` ("PATH (a directory)"), and so are
  // torch.save weight files (IsTorchWeightsFileName) beside safetensors
  // ones. A directory whose weights are torch.save files only is refused
  // (Unsupported): the Python package imports it with torch.
  std::vector<std::string> paths;
  // More blobs: (name, file).
  std::vector<std::pair<std::string, std::string>> blob_files;
  // The files are one rank's part only (a rank of several): the check that
  // they hold every element of each tensor is left to the commit.
  bool partial = false;
  std::function<void(const std::string&)> left_out;
  // A symbolic link in a directory is followed only if it resolves inside
  // that directory; one to elsewhere is refused (InvalidArgument naming it
  // and its target) unless this is set. A dangling link is left out.
  bool follow_symlinks = false;
};

class PreparedImport {
 public:
  // Reads and checks every input; writes nothing. InvalidArgument (or the
  // I/O error) naming the file and what is wrong.
  static Result<PreparedImport> Prepare(const ImportInputs& inputs);
  PreparedImport(PreparedImport&&) noexcept;
  PreparedImport& operator=(PreparedImport&&) noexcept;
  ~PreparedImport();

  uint64_t total_bytes() const { return total_; }  // tensor and blob bytes to write
  // What PutInto would put (`ckpt import --dry-run`): "tensors" (name,
  // dtype, shape of the global tensor, bytes of this input, shards) and
  // "blobs" (name, bytes), "tensor_bytes", "blob_bytes", and "links"
  // (path, target) of the symbolic links followed.
  Json Describe() const;

  // Puts every tensor shard and blob into `writer`. `progress` gets bytes
  // done and total_bytes(); `cancelled`, asked before each tensor and blob,
  // stops it with FailedPrecondition ("cancelled"; the caller aborts the
  // writer).
  Status PutInto(CheckpointWriter& writer, const ProgressFn& progress = {},
                 const std::function<bool()>& cancelled = {}) const;

 private:
  PreparedImport();
  struct Blob {
    std::string name;
    std::shared_ptr<const MappedFile> file;
  };
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::vector<SafetensorsShard>> shards_;
  std::vector<Blob> blobs_;
  std::vector<std::pair<std::string, std::string>> links_;  // followed: link, target
  uint64_t total_ = 0;
};

}  // namespace ckptfs
