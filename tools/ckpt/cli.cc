#include "cli.h"

#include "core/json.h"

#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>

namespace ckptfs::cli {

std::string HelpText(const CommandSpec& spec) {
  std::string s = "usage: ckpt " + spec.name + (spec.options.empty() ? "" : " [options]") +
                  (spec.usage.empty() ? "" : " " + spec.usage) + "\n\n" + spec.summary + "\n";
  if (!spec.details.empty()) s += "\n" + spec.details + "\n";
  s += "\noptions:\n";
  auto add = [&](const std::string& flags, const std::string& help) {
    std::string line = "  " + flags;
    if (line.size() < 28) line.append(28 - line.size(), ' ');
    else line += "\n" + std::string(28, ' ');
    s += line + help + "\n";
  };
  for (const auto& o : spec.options) {
    std::string flags = o.short_name ? std::string("-") + o.short_name + ", " : "    ";
    flags += "--" + o.name;
    if (o.takes_value) flags += " " + o.value_name;
    add(flags, o.help);
    // Parsed before the command's own options (main.cc), for every command
    // that opens a repository.
    if (o.name == "repo") {
      add("    --cache-dir DIR", "where this host keeps the catalog of an S3 repository (default: $CKPT_CACHE_DIR, "
                               "else ~/.cache/ckptfs)");
    }
  }
  add("-h, --help", "show this help");
  return s;
}

Result<Args> Parse(const CommandSpec& spec, int argc, char** argv, int first, bool* help_shown) {
  Args args;
  *help_shown = false;
  bool only_positional = false;
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (only_positional || a.size() < 2 || a[0] != '-' || a == "-") {
      args.positional.push_back(a);
      continue;
    }
    if (a == "--") {
      only_positional = true;
      continue;
    }
    if (a == "-h" || a == "--help") {
      std::fputs(HelpText(spec).c_str(), stdout);
      *help_shown = true;
      return args;
    }
    const OptionSpec* opt = nullptr;
    std::optional<std::string> inline_value;
    if (a.rfind("--", 0) == 0) {
      std::string name = a.substr(2);
      size_t eq = name.find('=');
      if (eq != std::string::npos) {
        inline_value = name.substr(eq + 1);
        name = name.substr(0, eq);
      }
      for (const auto& o : spec.options) {
        if (o.name == name) opt = &o;
      }
    } else if (a.size() >= 2) {
      for (const auto& o : spec.options) {
        if (o.short_name == a[1]) opt = &o;
      }
      if (opt && a.size() > 2) inline_value = a.substr(2);
    }
    if (!opt) return Status::InvalidArgument("unknown option '" + a + "' (see 'ckpt " + spec.name + " --help')");
    std::string value;
    if (opt->takes_value) {
      if (inline_value) {
        value = *inline_value;
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return Status::InvalidArgument("option --" + opt->name + " needs a value");
      }
    } else if (inline_value) {
      return Status::InvalidArgument("option --" + opt->name + " takes no value");
    }
    auto& slot = args.values[opt->name];
    if (!slot.empty() && !opt->repeatable) return Status::InvalidArgument("option --" + opt->name + " given twice");
    slot.push_back(value);
  }
  if (args.positional.size() < spec.min_args) {
    return Status::InvalidArgument("missing arguments: usage: ckpt " + spec.name + " " + spec.usage);
  }
  if (args.positional.size() > spec.max_args) {
    return Status::InvalidArgument("too many arguments: usage: ckpt " + spec.name + " " + spec.usage);
  }
  return args;
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
