// Shared helpers of the ckpt command-line tool: argument parsing, messages,
// progress, sizes.
#pragma once

#include <cstdint>
#include <climits>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace ckptfs::cli {

// Exit codes.
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;  // the operation failed
inline constexpr int kExitUsage = 2;  // the command line is wrong

struct OptionSpec {
  std::string name;        // long name without dashes: "chunk-size"
  char short_name = 0;     // 'r'
  bool takes_value = false;
  bool repeatable = false;
  std::string value_name;  // for help: "SIZE"
  std::string help;
  // A flag that may carry a value inline only: --progress, --progress=json.
  bool inline_value_allowed = false;
};

struct CommandSpec {
  std::string name;
  std::string usage;  // "NAME FILE..."
  std::string summary;
  std::string details;  // extra help text
  std::vector<OptionSpec> options;
  size_t min_args = 0;
  size_t max_args = 0;  // SIZE_MAX for unbounded
};

struct Args {
  std::vector<std::string> positional;
  std::map<std::string, std::vector<std::string>> values;
  bool Has(const std::string& name) const { return values.count(name) > 0; }
  std::optional<std::string> Get(const std::string& name) const {
    auto it = values.find(name);
    if (it == values.end() || it->second.empty()) return std::nullopt;
    return it->second.back();
  }
  std::vector<std::string> All(const std::string& name) const {
    auto it = values.find(name);
    return it == values.end() ? std::vector<std::string>{} : it->second;
  }
  // Typed values: nullopt when the option is absent; InvalidArgument naming
  // the option when its value is malformed or below `min`.
  Result<std::optional<uint64_t>> Size(const std::string& name) const;  // "4M", "64KiB", "4096"
  Result<std::optional<int64_t>> Int(const std::string& name, int64_t min = INT64_MIN) const;
};

// Options every command takes, before its name or after it: -r/--repo,
// --cache-dir, --progress[=json], --quiet. They are parsed with the
// command's own into the same Args, and read once into GlobalOptions
// (common.h).
extern const std::vector<OptionSpec> kGlobalOptions;

// Parses the global options at argv[first..] up to the first argument that
// is not one (the command's name) into *args, and returns that argument's
// index.
Result<int> ParseLeadingGlobals(int argc, char** argv, int first, Args* args);

// Parses argv[first..] into *args (which may already hold global options
// given before the command); --help prints help and sets *help_shown.
Status Parse(const CommandSpec& spec, int argc, char** argv, int first, Args* args, bool* help_shown);
std::string HelpText(const CommandSpec& spec);

// "4M", "64KiB", "1G", "4096" -> bytes.
Result<uint64_t> ParseSize(const std::string& text);
Result<int64_t> ParseInt(const std::string& text, const std::string& what);
// 1536 -> "1.5 KiB".
std::string HumanBytes(uint64_t bytes);

// Progress on stderr when it is a terminal; silent otherwise.
// How long operations report progress on stderr: kAuto draws a line when
// stderr is a terminal and says nothing otherwise; kOn draws it anyway (a
// line per update when stderr is not a terminal); kJson writes one JSON
// object per line for programs; kOff is quiet.
enum class ProgressMode { kAuto, kOn, kJson, kOff };
void SetProgressMode(ProgressMode mode);
ProgressMode GetProgressMode();

// A phase of a long operation starting ("gc: waiting for saves in
// progress"): a line on stderr when progress is shown (a terminal, or
// --progress), a JSON line with --progress=json, nothing otherwise.
void Phase(const std::string& operation, const std::string& what);

// Progress of one operation or phase: done and total bytes, the rate so
// far and the time left at that rate.
class Progress {
 public:
  explicit Progress(std::string label);
  ~Progress();
  void Update(uint64_t done, uint64_t total);
  void Finish();

 private:
  void Draw(uint64_t done, uint64_t total, bool final);
  std::string label_;
  ProgressMode mode_;
  bool terminal_;
  bool printed_ = false;
  int64_t start_ms_;
  int64_t last_ms_ = 0;
  uint64_t done_ = 0, total_ = 0;
};

}  // namespace ckptfs::cli
