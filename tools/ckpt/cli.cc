#include "cli.h"

#include "core/json.h"

#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>

namespace ckptfs::cli {

const std::vector<OptionSpec> kGlobalOptions = {
    {"repo", 'r', true, false, "PATH", "repository: a directory or s3://BUCKET/PREFIX (default: $CKPT_REPO)"},
    {"cache-dir", 0, true, false, "DIR",
     "where this host keeps the catalog of an S3 repository (default: $CKPT_CACHE_DIR, else ~/.cache/ckptfs)"},
    {"progress", 0, false, false, "", "show progress even when stderr is not a terminal (=json: JSON lines)", true},
    {"quiet", 0, false, false, "", "show no progress"},
};

std::string HelpText(const CommandSpec& spec) {
  std::string s = "usage: ckpt " + spec.name + " [options]" + (spec.usage.empty() ? "" : " " + spec.usage) +
                  "\n\n" + spec.summary + "\n";
  if (!spec.details.empty()) s += "\n" + spec.details + "\n";
  auto add = [&](const OptionSpec& o) {
    std::string line = "  " + (o.short_name ? std::string("-") + o.short_name + ", " : std::string("    ")) + "--" + o.name;
    if (o.takes_value) line += " " + o.value_name;
    if (o.inline_value_allowed) line += "[=json]";
    if (line.size() < 28) line.append(28 - line.size(), ' ');
    else line += "\n" + std::string(28, ' ');
    s += line + o.help + "\n";
  };
  s += "\noptions:\n";
  for (const auto& o : spec.options) add(o);
  add({"help", 'h', false, false, "", "show this help"});
  s += "\nglobal options (before or after the command):\n";
  for (const auto& o : kGlobalOptions) add(o);
  return s;
}

namespace {

const OptionSpec* FindOption(const std::vector<OptionSpec>& options, const std::string& arg, bool long_form) {
  for (const auto& o : options) {
    if (long_form ? o.name == arg : (o.short_name != 0 && o.short_name == arg[1])) return &o;
  }
  return nullptr;
}

// One option at argv[*i] (which starts with '-'), looked up in `options`
// then the global options. Nullptr (and OK) when it is none of them.
Result<const OptionSpec*> TakeOption(const std::vector<OptionSpec>& options, int argc, char** argv, int* i,
                                     Args* args) {
  const std::string a = argv[*i];
  const OptionSpec* opt = nullptr;
  std::optional<std::string> inline_value;
  if (a.rfind("--", 0) == 0) {
    std::string name = a.substr(2);
    if (size_t eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    opt = FindOption(options, name, true);
    if (!opt) opt = FindOption(kGlobalOptions, name, true);
  } else {
    opt = FindOption(options, a, false);
    if (!opt) opt = FindOption(kGlobalOptions, a, false);
    if (opt && a.size() > 2) inline_value = a.substr(2);
  }
  if (!opt) return static_cast<const OptionSpec*>(nullptr);
  std::string value;
  if (opt->takes_value) {
    if (inline_value) {
      value = *inline_value;
    } else if (*i + 1 < argc) {
      value = argv[++*i];
    } else {
      return Status::InvalidArgument("option --" + opt->name + " needs a value");
    }
  } else if (inline_value) {
    if (!opt->inline_value_allowed) return Status::InvalidArgument("option --" + opt->name + " takes no value");
    value = *inline_value;
  }
  auto& slot = args->values[opt->name];
  if (!slot.empty() && !opt->repeatable) return Status::InvalidArgument("option --" + opt->name + " given twice");
  slot.push_back(value);
  return opt;
}

}  // namespace

Result<int> ParseLeadingGlobals(int argc, char** argv, int first, Args* args) {
  int i = first;
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.size() < 2 || a[0] != '-' || a == "--" || a == "-h" || a == "--help" || a == "--version") break;
    CKPT_ASSIGN_OR_RETURN(const OptionSpec* opt, TakeOption({}, argc, argv, &i, args));
    if (!opt) return Status::InvalidArgument("unknown option '" + a + "' before the command (see 'ckpt --help')");
  }
  return i;
}

Status Parse(const CommandSpec& spec, int argc, char** argv, int first, Args* args, bool* help_shown) {
  *help_shown = false;
  bool only_positional = false;
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (only_positional || a.size() < 2 || a[0] != '-' || a == "-") {
      args->positional.push_back(a);
      continue;
    }
    if (a == "--") {
      only_positional = true;
      continue;
    }
    if (a == "-h" || a == "--help") {
      std::fputs(HelpText(spec).c_str(), stdout);
      *help_shown = true;
      return Status::OK();
    }
    CKPT_ASSIGN_OR_RETURN(const OptionSpec* opt, TakeOption(spec.options, argc, argv, &i, args));
    if (!opt) return Status::InvalidArgument("unknown option '" + a + "' (see 'ckpt " + spec.name + " --help')");
  }
  if (args->positional.size() < spec.min_args) {
    return Status::InvalidArgument("missing arguments: usage: ckpt " + spec.name + " " + spec.usage);
  }
  if (args->positional.size() > spec.max_args) {
    return Status::InvalidArgument("too many arguments: usage: ckpt " + spec.name + " " + spec.usage);
  }
  return Status::OK();
}

Result<uint64_t> ParseSize(const std::string& text) {
  if (text.empty()) return Status::InvalidArgument("empty size");
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || text[0] == '-') return Status::InvalidArgument("bad size '" + text + "'");
  std::string unit(end);
  uint64_t mult = 1;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "K" || unit == "KiB" || unit == "k") mult = 1ull << 10;
  else if (unit == "M" || unit == "MiB") mult = 1ull << 20;
  else if (unit == "G" || unit == "GiB") mult = 1ull << 30;
  else return Status::InvalidArgument("bad size unit in '" + text + "' (use K, M or G)");
  if (v > UINT64_MAX / mult) return Status::InvalidArgument("size '" + text + "' is too large");
  return static_cast<uint64_t>(v) * mult;
}

Result<int64_t> ParseInt(const std::string& text, const std::string& what) {
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0') {
    return Status::InvalidArgument(what + " must be an integer, not '" + text + "'");
  }
  return static_cast<int64_t>(v);
}

Result<std::optional<uint64_t>> Args::Size(const std::string& name) const {
  auto v = Get(name);
  if (!v) return std::optional<uint64_t>();
  auto n = ParseSize(*v);
  if (!n.ok()) return Status::InvalidArgument("--" + name + ": " + n.status().message());
  return std::optional<uint64_t>(*n);
}

Result<std::optional<int64_t>> Args::Int(const std::string& name, int64_t min) const {
  auto v = Get(name);
  if (!v) return std::optional<int64_t>();
  auto n = ParseInt(*v, "--" + name);
  if (!n.ok()) return n.status();
  if (*n < min) return Status::InvalidArgument("--" + name + " must be at least " + std::to_string(min));
  return std::optional<int64_t>(*n);
}

std::string HumanBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

namespace {
ProgressMode g_progress_mode = ProgressMode::kAuto;
int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

void SetProgressMode(ProgressMode mode) { g_progress_mode = mode; }
ProgressMode GetProgressMode() { return g_progress_mode; }

void Phase(const std::string& operation, const std::string& what) {
  ProgressMode mode = g_progress_mode;
  if (mode == ProgressMode::kAuto) mode = ::isatty(STDERR_FILENO) == 1 ? ProgressMode::kOn : ProgressMode::kOff;
  if (mode == ProgressMode::kOff) return;
  if (mode == ProgressMode::kJson) {
    std::fprintf(stderr, "{\"operation\": %s, \"phase\": %s, \"unix_ms\": %lld}\n", Json(operation).Dump().c_str(),
                 Json(what).Dump().c_str(),
                 static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            std::chrono::system_clock::now().time_since_epoch())
                                            .count()));
    return;
  }
  std::fprintf(stderr, "%s: %s\n", operation.c_str(), what.c_str());
}

Progress::Progress(std::string label)
    : label_(std::move(label)), terminal_(::isatty(STDERR_FILENO) == 1), start_ms_(NowMs()) {
  mode_ = g_progress_mode;
  if (mode_ == ProgressMode::kAuto) mode_ = terminal_ ? ProgressMode::kOn : ProgressMode::kOff;
}
Progress::~Progress() { Finish(); }

void Progress::Update(uint64_t done, uint64_t total) {
  if (mode_ == ProgressMode::kOff) return;
  done_ = done;
  total_ = total;
  const int64_t now = NowMs();
  // A terminal line is redrawn 5 times a second; lines for programs and
  // logs come once a second.
  const int64_t every = mode_ == ProgressMode::kOn && terminal_ ? 200 : 1000;
  if (done < total && now - last_ms_ < every) return;
  last_ms_ = now;
  Draw(done, total, false);
}

void Progress::Draw(uint64_t done, uint64_t total, bool final) {
  const double seconds = static_cast<double>(NowMs() - start_ms_) / 1000.0;
  const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0;
  const double eta = rate > 0 && total > done ? static_cast<double>(total - done) / rate : 0;
  if (mode_ == ProgressMode::kJson) {
    std::fprintf(stderr,
                 "{\"progress\": %s, \"done_bytes\": %llu, \"total_bytes\": %llu, \"bytes_per_second\": %.0f, "
                 "\"eta_seconds\": %.1f, \"elapsed_seconds\": %.1f, \"finished\": %s}\n",
                 Json(label_).Dump().c_str(), static_cast<unsigned long long>(done),
                 static_cast<unsigned long long>(total), rate, eta, seconds, final ? "true" : "false");
    return;
  }
  const double pct = total ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0;
  char tail[64] = "";
  if (!final && rate > 0 && done < total) std::snprintf(tail, sizeof tail, ", %.0f s left", eta);
  std::fprintf(stderr, "%s%s: %5.1f%% (%s of %s, %s/s%s)%s", terminal_ ? "\r" : "", label_.c_str(), pct,
               HumanBytes(done).c_str(), HumanBytes(total).c_str(), HumanBytes(static_cast<uint64_t>(rate)).c_str(),
               tail, terminal_ ? "\033[K" : "\n");
  printed_ = true;
}

void Progress::Finish() {
  if (mode_ == ProgressMode::kJson && (done_ || total_)) {
    Draw(done_, total_, true);
    done_ = total_ = 0;
    return;
  }
  if (mode_ == ProgressMode::kOn && terminal_ && printed_) std::fputs("\r\033[K", stderr);
  printed_ = false;
}

}  // namespace ckptfs::cli
