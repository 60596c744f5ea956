#include "backend/s3_backend.h"

#include <curl/curl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include "core/buffer_pool.h"
#include "core/crash_point.h"
#include "core/random.h"
#include "backend/s3_xml.h"
#include "core/text.h"

namespace ckptfs {

namespace {

// Bounds of what the server may send into memory: an error document, the
// answer to a request that is not a whole-object read (a PUT's, a
// CompleteMultipartUpload's), and one page of a listing (1,000 keys of at
// most 1 KiB each, with their XML).
constexpr uint64_t kMaxErrorBody = 64 << 10;
constexpr uint64_t kMaxAnswerBody = 1 << 20;
constexpr uint64_t kMaxListingPage = 16 << 20;
constexpr size_t kMaxTag = 256;  // bytes of a listed ETag kept

bool IsUnreserved(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
         c == '.' || c == '~';
}

// SigV4's URI encoding: every byte but the unreserved ones as %XX.
std::string UriEncode(std::string_view s) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (IsUnreserved(c)) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

using Query = std::vector<std::pair<std::string, std::string>>;

// The canonical query string: encoded, sorted by name then value, and
// "name=" for empty values. libcurl's signer signs the query as given, so
// it must already be canonical.
std::string CanonicalQuery(Query q) {
  std::sort(q.begin(), q.end());
  std::string out;
  for (const auto& [k, v] : q) {
    if (!out.empty()) out += '&';
    out += UriEncode(k) + "=" + UriEncode(v);
  }
  return out;
}

bool ValidBucketName(std::string_view b) {
  if (b.size() < 3 || b.size() > 63) return false;
  for (char c : b) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.')) return false;
  }
  return b.front() != '-' && b.front() != '.' && b.back() != '-' && b.back() != '.';
}

void GlobalInit() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

struct Response {
  long status = 0;
  std::string body;  // unless the request read into a caller's span
  std::string etag;
  uint64_t received = 0;  // bytes of body
  int64_t content_length = -1;  // the Content-Length header (HEAD), -1 when absent
  uint64_t overflow_bound = 0;  // nonzero: the body went past this bound and was cut
};

struct Request {
  std::string method = "GET";
  std::string path;  // "/bucket/key", already safe for a URL
  Query query;
  std::span<const std::byte> body;
  bool has_body = false;
  std::optional<std::pair<uint64_t, uint64_t>> range;  // inclusive byte range
  std::span<std::byte> into;                           // ranged reads land here
  bool read_into = false;
  bool if_none_match = false;  // PUT only when no object has the key (412 otherwise)
  // The longest 2xx body taken into `body` (a longer one, announced or
  // sent, fails the request); error documents are cut at kMaxErrorBody.
  uint64_t max_body = kMaxAnswerBody;
};

struct Sink {
  Response* response;
  std::span<std::byte> into;
  bool read_into;
  uint64_t max_body;
  CURL* handle;
  bool overflow = false;
  uint64_t overflow_bound = 0;  // the bound that was passed
};

size_t WriteBody(char* data, size_t size, size_t n, void* user) {
  auto* sink = static_cast<Sink*>(user);
  const size_t bytes = size * n;
  long status = 0;
  curl_easy_getinfo(sink->handle, CURLINFO_RESPONSE_CODE, &status);
  const bool success = status >= 200 && status < 300;
  // What the server may send: a ranged read's span, the request's bound, or
  // a short error document. An announced length past it fails before any
  // byte is kept; a body that goes on past it fails as it arrives.
  const uint64_t bound = sink->read_into && success ? sink->into.size() : success ? sink->max_body : kMaxErrorBody;
  if (sink->response->received == 0) {
    curl_off_t announced = -1;
    curl_easy_getinfo(sink->handle, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &announced);
    if (announced > 0 && static_cast<uint64_t>(announced) > bound) {
      sink->overflow = true;
      sink->overflow_bound = bound;
      return 0;  // aborts the transfer
    }
  }
  if (sink->response->received + bytes > bound) {
    sink->overflow = true;
    sink->overflow_bound = bound;
    return 0;
  }
  if (sink->read_into && success) {  // an error document goes to body
    std::memcpy(sink->into.data() + sink->response->received, data, bytes);
  } else {
    sink->response->body.append(data, bytes);
  }
  sink->response->received += bytes;
  return bytes;
}

size_t WriteHeader(char* data, size_t size, size_t n, void* user) {
  auto* response = static_cast<Response*>(user);
  std::string_view line(data, size * n);
  auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
  // Header names are case-insensitive.
  if (line.size() > 5 && std::equal(line.begin(), line.begin() + 5, "etag:",
                                    [&](char a, char b) { return lower(a) == b; })) {
    std::string_view v = line.substr(5);
    while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
    while (!v.empty() && (v.back() == '\r' || v.back() == '\n' || v.back() == ' ')) v.remove_suffix(1);
    if (v.size() > 1024) return 0;  // no store sends such an ETag: abort
    response->etag = std::string(v);
  }
  return size * n;
}

bool RetryableTransport(CURLcode c) {
  switch (c) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
}

bool RetryableStatus(long s) { return s >= 500 || s == 429 || s == 408; }

// Easy handles, reused so that connections are kept alive across requests.
class HandlePool {
 public:
  ~HandlePool() {
    for (CURL* h : free_) curl_easy_cleanup(h);
  }
  CURL* Acquire() {
    {
      std::lock_guard lock(mu_);
      if (!free_.empty()) {
        CURL* h = free_.back();
        free_.pop_back();
        return h;
      }
    }
    return curl_easy_init();
  }
  void Release(CURL* h) {
    std::lock_guard lock(mu_);
    free_.push_back(h);
  }

 private:
  std::mutex mu_;
  std::vector<CURL*> free_;
};

class S3Client {
 public:
  S3Client(S3Location location, ObjectStoreOptions options) : loc_(std::move(location)), opt_(std::move(options)) {
    GlobalInit();
    while (!opt_.endpoint.empty() && opt_.endpoint.back() == '/') opt_.endpoint.pop_back();
    shown_ = RedactUrl(opt_.endpoint);
    credentials_ = {opt_.access_key, opt_.secret_key, opt_.session_token};
    sigv4_ = "aws:amz:" + opt_.region + ":s3";
  }

  const S3Location& location() const { return loc_; }
  const ObjectStoreOptions& options() const { return opt_; }
  // A buffer for one multipart part (options().part_size bytes). Object
  // writers take one when they first append and give it back when they
  // finish, so that a save does not touch a part's worth of fresh pages
  // (16 MiB, about 4,000 page faults) for every object it writes.
  BufferPool::Lease AcquirePart() { return parts_.Acquire(static_cast<size_t>(opt_.part_size)); }
  BufferPoolStats PartStats() const { return parts_.stats(); }
  std::string Where() const { return loc_.ToString() + " at " + shown_; }

  std::string ObjectPath(std::string_view key) const {
    std::string p = "/" + loc_.bucket + "/";
    if (!loc_.prefix.empty()) p += loc_.prefix + "/";
    return p + std::string(key);
  }
  std::string FullKey(std::string_view key) const {
    return loc_.prefix.empty() ? std::string(key) : loc_.prefix + "/" + std::string(key);
  }
  std::string BucketPath() const { return "/" + loc_.bucket; }

  // The request, retried on transport errors and retryable statuses. Any
  // other HTTP status is returned for the caller to judge.
  // Every attempt together ends within opt_.request_deadline_s.
  Result<Response> Perform(const Request& req) {
    std::string last_error;
    using Clock = std::chrono::steady_clock;
    const auto began = Clock::now();
    const auto deadline = began + std::chrono::seconds(std::max(1, opt_.request_deadline_s));
    auto past_deadline = [&] {
      return Status::IOError("S3 " + req.method + " " + req.path + " at " + shown_ +
                             ": no complete answer within " + std::to_string(opt_.request_deadline_s) +
                             " s (the deadline of one request, retries included; CKPT_S3_REQUEST_DEADLINE sets it)" +
                             (last_error.empty() ? "" : "; last error: " + last_error));
    };
    // Requests that change the store are where crash tests kill: before
    // one is sent, and once its answer is in.
    const bool mutating = req.method != "GET" && req.method != "HEAD";
    bool reloaded = false;
    for (int attempt = 0;; ++attempt) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return past_deadline();
      Response resp;
      if (mutating && attempt == 0) CrashPoint();
      CURLcode code = Once(req, &resp, left);
      if (mutating && code == CURLE_OK) CrashPoint();
      // Temporary credentials that expired mid-save: read them again and
      // retry, once per request (a HEAD's answer has no body naming why).
      if (code == CURLE_OK && (resp.status == 400 || resp.status == 403) && !reloaded) {
        const std::string why = XmlFirst(resp.body, "Code");
        if (why == "ExpiredToken" || why == "TokenRefreshRequired" || why == "RequestExpired" ||
            req.method == "HEAD") {
          reloaded = true;
          if (ReloadCredentials()) continue;
        }
      }
      if (code == CURLE_OK && !RetryableStatus(resp.status)) return resp;
      if (code == CURLE_WRITE_ERROR && resp.overflow_bound) {
        return Status::IOError("S3 " + req.method + " " + req.path + " at " + shown_ +
                               ": the answer is longer than the " + std::to_string(resp.overflow_bound) +
                               " bytes such an answer may have");
      }
      if (code == CURLE_OPERATION_TIMEDOUT && Clock::now() >= deadline) {
        last_error = curl_easy_strerror(code);
        return past_deadline();
      }
      if (code != CURLE_OK && !RetryableTransport(code)) {
        return Status::IOError("S3 " + req.method + " " + req.path + " at " + shown_ + ": " +
                               curl_easy_strerror(code));
      }
      last_error = code != CURLE_OK ? std::string(curl_easy_strerror(code))
                                    : "HTTP " + std::to_string(resp.status) + " " + XmlFirst(resp.body, "Code");
      const bool throttled = code == CURLE_OK && (resp.status == 429 || resp.status == 503);
      const bool waits = throttled && Clock::now() < began + std::chrono::seconds(opt_.throttle_wait_s);
      if (attempt >= opt_.max_retries && !waits) {
        return Status::IOError("S3 " + req.method + " " + req.path + " at " + shown_ + " failed after " +
                               std::to_string(attempt + 1) + " attempts: " + last_error +
                               (throttled && opt_.throttle_wait_s > 0
                                    ? " (throttled for " + std::to_string(opt_.throttle_wait_s) +
                                          " s; CKPT_S3_THROTTLE_WAIT sets how long a throttled request waits)"
                                    : ""));
      }
      const int64_t base_ms = std::min<int64_t>(100ll << std::min(attempt, 6), 5000);
      const auto pause = std::chrono::milliseconds(base_ms / 2 + int64_t(RandomU64() % uint64_t(base_ms / 2 + 1)));
      if (Clock::now() + pause >= deadline) return past_deadline();
      std::this_thread::sleep_for(pause);
    }
  }

  // A non-2xx answer as a Status saying what to check.
  Status ErrorOf(const Request& req, const Response& resp, std::string_view what) const {
    const std::string code = XmlFirst(resp.body, "Code");
    const std::string tag = code.empty() ? "HTTP " + std::to_string(resp.status) : code;
    if (code == "NoSuchBucket") {
      return Status::NotFound("bucket '" + loc_.bucket + "' does not exist at " + shown_ +
                              " ('ckpt init' creates it)")
          .WithDetail(StatusDetail::kBucketMissing);
    }
    if (resp.status == 404) return Status::NotFound(std::string(what) + " not found in " + Where());
    if (code == "InvalidAccessKeyId" || code == "SignatureDoesNotMatch" || code == "InvalidToken" ||
        code == "ExpiredToken") {
      return Status::FailedPrecondition("S3 at " + shown_ + " refused the credentials (" + code + "): check " +
                                        opt_.credentials_source);
    }
    if (resp.status == 403) {
      return Status::FailedPrecondition("access to " + Where() + " denied (" + tag + ")");
    }
    if (resp.status == 416) {
      return Status::InvalidArgument(std::string(what) + ": the range asked for lies past the object's end");
    }
    return Status::IOError("S3 " + req.method + " " + std::string(what) + " in " + Where() + ": " + tag);
  }

  // One request whose answer must be 2xx.
  Result<Response> Call(const Request& req, std::string_view what) {
    CKPT_ASSIGN_OR_RETURN(Response resp, Perform(req));
    if (resp.status < 200 || resp.status >= 300) return ErrorOf(req, resp, what);
    // CompleteMultipartUpload can fail with 200 and an error document.
    if (resp.body.find("<Error>") != std::string::npos) return ErrorOf(req, resp, what);
    return resp;
  }

  RequestCounts Counts() const {
    RequestCounts c;
    c.get = sent_[kGet].load(std::memory_order_relaxed);
    c.list = sent_[kList].load(std::memory_order_relaxed);
    c.put = sent_[kPut].load(std::memory_order_relaxed);
    c.post = sent_[kPost].load(std::memory_order_relaxed);
    c.head = sent_[kHead].load(std::memory_order_relaxed);
    c.del = sent_[kDelete].load(std::memory_order_relaxed);
    return c;
  }

 private:
  enum Kind { kGet, kList, kPut, kPost, kHead, kDelete, kKinds };
  static Kind KindOf(const Request& req) {
    if (req.method == "GET") {
      for (const auto& [k, v] : req.query) {
        if (k == "list-type") return kList;
      }
      return kGet;
    }
    if (req.method == "PUT") return kPut;
    if (req.method == "POST") return kPost;
    if (req.method == "HEAD") return kHead;
    return kDelete;
  }

  CURLcode Once(const Request& req, Response* resp, std::chrono::milliseconds time_left) {
    sent_[KindOf(req)].fetch_add(1, std::memory_order_relaxed);
    CURL* h = pool_.Acquire();
    if (!h) return CURLE_OUT_OF_MEMORY;
    curl_easy_reset(h);
    std::string url = opt_.endpoint + req.path;
    if (!req.query.empty()) url += "?" + CanonicalQuery(req.query);
    curl_slist* headers = nullptr;
    headers = curl_slist_append(headers, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    // (No "Expect:" header to turn 100-continue off: libcurl's signer would
    // sign the empty header it then leaves out, and the signature fails.)
    const ObjectStoreCredentials cred = Credentials();
    if (!cred.session_token.empty()) {
      headers = curl_slist_append(headers, ("x-amz-security-token: " + cred.session_token).c_str());
    }
    if (req.range) {
      headers = curl_slist_append(
          headers, ("Range: bytes=" + std::to_string(req.range->first) + "-" + std::to_string(req.range->second)).c_str());
    }
    if (req.has_body) headers = curl_slist_append(headers, "Content-Type: application/octet-stream");
    if (req.if_none_match) headers = curl_slist_append(headers, "If-None-Match: *");
    Sink sink{resp, req.into, req.read_into, req.max_body, h};
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4_.c_str());
    curl_easy_setopt(h, CURLOPT_USERNAME, cred.access_key.c_str());
    curl_easy_setopt(h, CURLOPT_PASSWORD, cred.secret_key.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    if (!opt_.reuse_connections) curl_easy_setopt(h, CURLOPT_FORBID_REUSE, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(opt_.connect_timeout_ms));
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, static_cast<long>(opt_.stall_timeout_s));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(std::max<int64_t>(1, time_left.count())));
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, WriteBody);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &sink);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, WriteHeader);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, resp);
    if (req.method == "HEAD") {
      curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (req.method != "GET") {
      curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, req.method.c_str());
    }
    if (req.has_body) {
      // The body is sent from the caller's memory, again on a retry.
      curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(req.body.size()));
      curl_easy_setopt(h, CURLOPT_POSTFIELDS, req.body.empty() ? "" : reinterpret_cast<const char*>(req.body.data()));
    }
    CURLcode code = curl_easy_perform(h);
    if (code == CURLE_OK) {
      curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &resp->status);
      curl_off_t length = -1;
      curl_easy_getinfo(h, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
      resp->content_length = length;
    }
    if (sink.overflow) resp->overflow_bound = sink.overflow_bound;
    curl_slist_free_all(headers);
    pool_.Release(h);
    return code;
  }

  // Replaces the credentials with those reload_credentials gives; false
  // when there is no way to reload or they did not change.
  bool ReloadCredentials() {
    if (!opt_.reload_credentials) return false;
    auto fresh = opt_.reload_credentials();
    if (!fresh.ok()) return false;
    std::lock_guard lock(credentials_mu_);
    if (*fresh == credentials_) return false;
    credentials_ = std::move(fresh).value();
    return true;
  }
  ObjectStoreCredentials Credentials() const {
    std::lock_guard lock(credentials_mu_);
    return credentials_;
  }

  S3Location loc_;
  ObjectStoreOptions opt_;
  // Idle part buffers kept for the next writers: two, which covers a
  // writer's pack and the small objects of its commit; more writers at
  // once get buffers of their own, freed when they finish.
  BufferPool parts_{static_cast<size_t>(opt_.part_size), 2};
  std::string shown_;  // the endpoint as messages show it: no password
  mutable std::mutex credentials_mu_;
  ObjectStoreCredentials credentials_;  // guarded by credentials_mu_ (opt_'s may be stale)
  std::string sigv4_;
  HandlePool pool_;
  std::array<std::atomic<uint64_t>, kKinds> sent_{};
};

Request MakeRequest(std::string method, std::string path, Query query = {}) {
  Request r;
  r.method = std::move(method);
  r.path = std::move(path);
  r.query = std::move(query);
  return r;
}

Request WithBody(Request r, std::span<const std::byte> body) {
  r.body = body;
  r.has_body = true;
  return r;
}

class S3Writer final : public ObjectWriter {
 public:
  S3Writer(std::shared_ptr<S3Client> client, std::string key) : client_(std::move(client)), key_(std::move(key)) {}
  ~S3Writer() override {
    if (!finished_) Abort();
  }

  Status Append(std::span<const std::byte> data) override {
    if (finished_) return Status::FailedPrecondition("object writer for '" + key_ + "' already finished");
    const size_t part_size = static_cast<size_t>(client_->options().part_size);
    while (!data.empty()) {
      if (!part_) part_ = client_->AcquirePart();
      const size_t n = std::min(data.size(), part_size - part_len_);
      std::memcpy(part_.data() + part_len_, data.data(), n);
      part_len_ += n;
      data = data.subspan(n);
      size_ += n;
      if (part_len_ == part_size) {
        Status st = UploadPart();
        if (!st.ok()) {
          Abort();
          return st;
        }
      }
    }
    return Status::OK();
  }

  Status Commit() override {
    if (finished_) return Status::FailedPrecondition("object writer for '" + key_ + "' already finished");
    Status st = Finish();
    if (!st.ok()) Abort();
    part_.Reset();
    part_len_ = 0;
    finished_ = true;
    return st;
  }

  void Abort() override {
    if (!upload_id_.empty()) {
      // Best effort: an upload left behind is removed by RemoveIncomplete.
      (void)client_->Call(MakeRequest("DELETE", client_->ObjectPath(key_), {{"uploadId", upload_id_}}),
                          "upload of '" + key_ + "'");
      upload_id_.clear();
    }
    part_.Reset();
    part_len_ = 0;
    finished_ = true;
  }

  uint64_t size() const override { return size_; }

 private:
  Status Finish() {
    const std::string path = client_->ObjectPath(key_);
    if (upload_id_.empty()) {  // small: one PUT
      return client_->Call(WithBody(MakeRequest("PUT", path), Part()), "object '" + key_ + "'").status();
    }
    if (part_len_ > 0) CKPT_RETURN_IF_ERROR(UploadPart());
    std::string xml = "<CompleteMultipartUpload>";
    for (size_t i = 0; i < etags_.size(); ++i) {
      xml += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" + etags_[i] + "</ETag></Part>";
    }
    xml += "</CompleteMultipartUpload>";
    auto body = std::as_bytes(std::span<const char>(xml.data(), xml.size()));
    CKPT_RETURN_IF_ERROR(
        client_->Call(WithBody(MakeRequest("POST", path, {{"uploadId", upload_id_}}), body), "object '" + key_ + "'")
            .status());
    upload_id_.clear();  // complete: nothing to abort
    return Status::OK();
  }

  Status UploadPart() {
    const std::string path = client_->ObjectPath(key_);
    if (upload_id_.empty()) {
      CKPT_ASSIGN_OR_RETURN(Response r, client_->Call(WithBody(MakeRequest("POST", path, {{"uploads", ""}}), {}),
                                                     "object '" + key_ + "'"));
      upload_id_ = XmlFirst(r.body, "UploadId");
      if (upload_id_.empty()) return Status::IOError("S3 gave no upload id for '" + key_ + "' in " + client_->Where());
    }
    const std::string number = std::to_string(etags_.size() + 1);
    CKPT_ASSIGN_OR_RETURN(
        Response r, client_->Call(WithBody(MakeRequest("PUT", path, {{"partNumber", number}, {"uploadId", upload_id_}}),
                                           Part()),
                                  "part " + number + " of '" + key_ + "'"));
    if (r.etag.empty()) return Status::IOError("S3 gave no ETag for part " + number + " of '" + key_ + "'");
    etags_.push_back(r.etag);
    part_len_ = 0;
    return Status::OK();
  }

  // The bytes appended since the last part was sent.
  std::span<const std::byte> Part() const {
    return part_ ? std::span<const std::byte>(part_.data(), part_len_) : std::span<const std::byte>();
  }

  std::shared_ptr<S3Client> client_;
  std::string key_;
  BufferPool::Lease part_;  // from the client's pool once something is appended
  size_t part_len_ = 0;
  std::string upload_id_;
  std::vector<std::string> etags_;
  uint64_t size_ = 0;
  bool finished_ = false;
};

class S3Backend final : public Backend {
 public:
  explicit S3Backend(std::shared_ptr<S3Client> client) : client_(std::move(client)) {}

  Result<std::unique_ptr<ObjectWriter>> Create(std::string_view key) override {
    CKPT_RETURN_IF_ERROR(CheckKey(key));
    return std::unique_ptr<ObjectWriter>(new S3Writer(client_, std::string(key)));
  }

  Status Put(std::string_view key, std::span<const std::byte> data) override {
    CKPT_RETURN_IF_ERROR(CheckKey(key));
    return client_->Call(WithBody(MakeRequest("PUT", client_->ObjectPath(key)), data), Quoted(key)).status();
  }

  // A conditional PUT (If-None-Match: *; AWS S3 and Ceph RGW honour it).
  // 412: the key exists. 409: a conditional write to the key raced this
  // one; asked again, the store answers 412 or takes it. When an attempt's
  // answer is lost and a retry finds the object, the answer is
  // AlreadyExists although that object may be this call's own.
  Status PutIfAbsent(std::string_view key, std::span<const std::byte> data) override {
    CKPT_RETURN_IF_ERROR(CheckKey(key));
    Request req = WithBody(MakeRequest("PUT", client_->ObjectPath(key)), data);
    req.if_none_match = true;
    for (int attempt = 0;; ++attempt) {
      CKPT_ASSIGN_OR_RETURN(Response r, client_->Perform(req));
      if (r.status == 412) return Status::AlreadyExists(Quoted(key) + " exists in " + client_->Where());
      if (r.status == 409 && attempt < client_->options().max_retries) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20 << std::min(attempt, 5)));
        continue;
      }
      if (r.status < 200 || r.status >= 300) return client_->ErrorOf(req, r, Quoted(key));
      return Status::OK();
    }
  }

  // One GET (the default asks for the size first).
  Result<std::string> ReadAll(std::string_view key, uint64_t max_bytes) override {
    CKPT_RETURN_IF_ERROR(CheckKey(key));
    Request req = MakeRequest("GET", client_->ObjectPath(key));
    req.max_body = max_bytes;
    CKPT_ASSIGN_OR_RETURN(Response r, client_->Call(req, Quoted(key)));
    if (r.content_length >= 0 && static_cast<uint64_t>(r.content_length) != r.body.size()) {
      return Status::IOError("S3 GET " + Quoted(key) + " in " + client_->Where() + ": the answer is " +
                             std::to_string(r.body.size()) + " bytes, not " + std::to_string(r.content_length));
    }
    return std::move(r.body);
  }

  Status ReadRange(std::string_view key, uint64_t offset, std::span<std::byte> out) override {
    CKPT_RETURN_IF_ERROR(CheckKey(key));
    if (out.empty()) {
      CKPT_ASSIGN_OR_RETURN(uint64_t size, Size(key));
      if (offset > size) return Status::InvalidArgument("read of " + Quoted(key) + " starts past its end");
      return Status::OK();
    }
    Request req = MakeRequest("GET", client_->ObjectPath(key));
    req.range = std::make_pair(offset, offset + out.size() - 1);
    req.into = out;
    req.read_into = true;
    CKPT_ASSIGN_OR_RETURN(Response r, client_->Perform(req));
    if (r.status != 206 && r.status != 200) return client_->ErrorOf(req, r, Quoted(key));
    if (r.received != out.size()) {
      return Status::IOError("S3 returned " + std::to_string(r.received) + " of the " + std::to_string(out.size()) +
                             " bytes asked for from " + Quoted(key) + " in " + client_->Where());
    }
    if (r.status == 200 && offset != 0) {
      return Status::IOError("S3 ignored the range asked for from " + Quoted(key) + " in " + client_->Where());
    }
    return Status::OK();
  }

  Result<uint64_t> Size(std::string_view key) override {
    CKPT_ASSIGN_OR_RETURN(Response r, Head(key));
    if (r.content_length < 0) return Status::IOError("S3 gave no size for " + Quoted(key) + " in " + client_->Where());
    return static_cast<uint64_t>(r.content_length);
  }

  // One HEAD: its ETag is the tag a listing gives.
  Result<std::string> Tag(std::string_view key) override {
    CKPT_ASSIGN_OR_RETURN(Response r, Head(key));
    return r.etag.substr(0, kMaxTag);
  }

  // A HEAD of `key`: its answer when the object is there; NotFound, or the
  // error that says why not, otherwise.
  Result<Response> Head(std::string_view key) {
    CKPT_RETURN_IF_ERROR(CheckKey(key));
    Request req = MakeRequest("HEAD", client_->ObjectPath(key));
    CKPT_ASSIGN_OR_RETURN(Response r, client_->Perform(req));
    if (r.status < 200 || r.status >= 300) {
      // A HEAD answer has no body to say whether the object or the bucket
      // is missing. A HEAD of the bucket tells which, without a listing:
      // listings are what object stores throttle first, and every rank's
      // commit looks for objects that are not there yet.
      if (r.status == 404) {
        auto bucket = client_->Perform(MakeRequest("HEAD", client_->BucketPath()));
        if (bucket.ok() && bucket->status >= 200 && bucket->status < 300) return client_->ErrorOf(req, r, Quoted(key));
      }
      // Otherwise a one-key listing asks for a body naming the error.
      if (r.status == 404 || r.status == 403) {
        Request get = MakeRequest("GET", client_->BucketPath(), {{"list-type", "2"}, {"max-keys", "1"}});
        auto probe = client_->Perform(get);
        if (probe.ok() && (probe->status < 200 || probe->status >= 300)) return client_->ErrorOf(get, *probe, Quoted(key));
      }
      return client_->ErrorOf(req, r, Quoted(key));
    }
    return r;
  }

  // Keys outside the prefix asked for are an error (the server is broken or
  // hostile); keys under it that ckptfs cannot have written (not valid
  // object keys) are left out, so nothing built from a listing ever names
  // an object outside this repository.
  Result<std::vector<std::string>> List(std::string_view prefix) override {
    CKPT_ASSIGN_OR_RETURN(std::vector<ListedObject> listed, ListObjects(prefix, /*tags=*/false));
    std::vector<std::string> keys;
    keys.reserve(listed.size());
    for (ListedObject& o : listed) keys.push_back(std::move(o.key));
    return keys;
  }

  // Each object's ETag is its tag (bounded: a store's tag is only ever
  // compared).
  Result<std::vector<ListedObject>> ListTagged(std::string_view prefix) override {
    return ListObjects(prefix, /*tags=*/true);
  }

  Result<std::vector<ListedObject>> ListObjects(std::string_view prefix, bool tags) {
    std::vector<ListedObject> keys;
    const std::string full = client_->FullKey(prefix);
    const size_t strip = client_->location().prefix.empty() ? 0 : client_->location().prefix.size() + 1;
    std::string token;
    std::set<std::string> tokens_seen;
    // Bounds of one listing: a store that sends a fresh token with every
    // page (the same keys again, or keys that never run out) is stopped
    // here, whatever its tokens, in bounded time and memory. Keys come in
    // ascending order (S3 lists in UTF-8 binary order), so a page that goes
    // back is an error at once; the keys, pages and bytes of one listing
    // are capped by max_list_keys, and pages that hold no key by 100.
    const uint64_t max_keys = client_->options().max_list_keys;
    const uint64_t max_pages = max_keys / 100 + 100;
    uint64_t empty_pages = 0;
    const uint64_t max_bytes = max_keys * 2048 + (64u << 20);
    uint64_t pages = 0, bytes = 0, listed = 0;
    std::string last_key;
    auto too_long = [&](const std::string& what) {
      return Status::IOError("S3 listing of " + client_->Where() + " under '" + full + "' passed " + what +
                             " without ending: the store's listing does not end (CKPT_S3_MAX_LIST_KEYS, now " +
                             std::to_string(max_keys) + ", bounds a listing)");
    };
    for (;;) {
      if (++pages > max_pages) return too_long(std::to_string(max_pages) + " pages");
      Query q = {{"list-type", "2"}, {"prefix", full}};
      if (!token.empty()) q.emplace_back("continuation-token", token);
      Request req = MakeRequest("GET", client_->BucketPath(), q);
      req.max_body = kMaxListingPage;
      CKPT_ASSIGN_OR_RETURN(Response r, client_->Call(req, "listing"));
      bytes += r.body.size();
      if (bytes > max_bytes) return too_long(std::to_string(max_bytes) + " bytes");
      const uint64_t listed_before = listed;
      for (std::string_view object : XmlAllRaw(r.body, "Contents")) {
        const std::string k = XmlFirst(object, "Key");
        if (k.compare(0, full.size(), full) != 0) {
          return Status::Corruption("S3 listing of " + client_->Where() + " under '" + full +
                                    "' returned a key outside it: the store is not answering what was asked");
        }
        if (listed > 0 && k <= last_key) {
          return Status::Corruption("S3 listing of " + client_->Where() + " under '" + full + "' returned '" + k +
                                    "' after '" + last_key +
                                    "': keys out of order or repeated, so the listing would not end");
        }
        last_key = k;
        if (++listed > max_keys) return too_long(std::to_string(max_keys) + " keys");
        std::string key = k.substr(strip);
        if (!IsValidObjectKey(key)) continue;
        keys.push_back({std::move(key), tags ? XmlFirst(object, "ETag").substr(0, kMaxTag) : std::string()});
      }
      if (XmlFirst(r.body, "IsTruncated") != "true") break;
      if (listed == listed_before && ++empty_pages > 100) return too_long("100 pages that hold no key");
      token = XmlFirst(r.body, "NextContinuationToken");
      if (token.empty()) return Status::IOError("S3 listing of " + client_->Where() + " is truncated without a token");
      if (!tokens_seen.insert(token).second) {
        return Status::IOError("S3 listing of " + client_->Where() +
                               " repeats a continuation token: the store's listing does not end");
      }
    }
    std::sort(keys.begin(), keys.end(), [](const ListedObject& a, const ListedObject& b) { return a.key < b.key; });
    return keys;
  }

  Status Delete(std::string_view key) override {
    CKPT_RETURN_IF_ERROR(Size(key).status());  // NotFound for a missing key
    return client_->Call(MakeRequest("DELETE", client_->ObjectPath(key)), Quoted(key)).status();
  }

  // Aborts the unfinished multipart uploads under this backend's prefix.
  // Only keys this backend could have written are aborted (valid object
  // keys under the prefix, built into the request path the way every other
  // request's is): a listed key such as "run/../../other-bucket/x" is
  // skipped, never sent.
  Result<uint64_t> RemoveIncomplete() override {
    const std::string prefix = client_->location().prefix.empty() ? "" : client_->location().prefix + "/";
    std::string key_marker, id_marker;
    std::set<std::pair<std::string, std::string>> markers_seen;
    for (;;) {
      Query q = {{"prefix", prefix}, {"uploads", ""}};
      if (!key_marker.empty()) q.emplace_back("key-marker", key_marker);
      if (!id_marker.empty()) q.emplace_back("upload-id-marker", id_marker);
      Request list = MakeRequest("GET", client_->BucketPath(), q);
      list.max_body = kMaxListingPage;
      CKPT_ASSIGN_OR_RETURN(Response r, client_->Call(list, "multipart uploads"));
      for (const std::string& upload : XmlAll(r.body, "Upload")) {
        const std::string full = XmlFirst(upload, "Key");
        const std::string id = XmlFirst(upload, "UploadId");
        if (id.empty() || full.compare(0, prefix.size(), prefix) != 0) continue;
        const std::string key = full.substr(prefix.size());
        if (!IsValidObjectKey(key)) continue;
        Request abort = MakeRequest("DELETE", client_->ObjectPath(key), {{"uploadId", id}});
        CKPT_ASSIGN_OR_RETURN(Response a, client_->Perform(abort));
        if ((a.status < 200 || a.status >= 300) && a.status != 404) {
          return client_->ErrorOf(abort, a, "upload of " + Quoted(key));
        }
      }
      if (XmlFirst(r.body, "IsTruncated") != "true") break;
      key_marker = XmlFirst(r.body, "NextKeyMarker");
      id_marker = XmlFirst(r.body, "NextUploadIdMarker");
      if (key_marker.empty() || !markers_seen.emplace(key_marker, id_marker).second) {
        return Status::IOError("S3 listing of multipart uploads in " + client_->Where() +
                               " is truncated without a new marker: the store's listing does not end");
      }
    }
    return uint64_t{0};  // the sizes of unfinished uploads are not listed
  }

  std::string Describe() const override { return client_->Where(); }
  RequestCounts Requests() const override { return client_->Counts(); }
  BufferPoolStats PartStats() const { return client_->PartStats(); }

 private:
  static std::string Quoted(std::string_view key) { return "object '" + std::string(key) + "'"; }
  static Status CheckKey(std::string_view key) {
    if (!IsValidObjectKey(key)) return Status::InvalidArgument("invalid object key '" + std::string(key) + "'");
    return Status::OK();
  }

  std::shared_ptr<S3Client> client_;
};

}  // namespace

std::string S3Location::ToString() const { return "s3://" + bucket + (prefix.empty() ? "" : "/" + prefix); }

bool IsS3Url(std::string_view url) { return url.substr(0, 5) == "s3://"; }

Result<S3Location> ParseS3Url(std::string_view url) {
  if (!IsS3Url(url)) return Status::InvalidArgument("'" + std::string(url) + "' is not an s3:// URL");
  std::string_view rest = url.substr(5);
  const size_t slash = rest.find('/');
  S3Location loc;
  loc.bucket = std::string(rest.substr(0, slash));
  if (slash != std::string_view::npos) {
    std::string_view p = rest.substr(slash + 1);
    while (!p.empty() && p.back() == '/') p.remove_suffix(1);
    loc.prefix = std::string(p);
  }
  if (!ValidBucketName(loc.bucket)) {
    return Status::InvalidArgument("'" + std::string(url) + "': '" + loc.bucket +
                                   "' is not a valid bucket name (3-63 of a-z, 0-9, '-', '.')");
  }
  if (!loc.prefix.empty() && !IsValidObjectKey(loc.prefix)) {
    return Status::InvalidArgument("'" + std::string(url) + "': the prefix must be path segments of [A-Za-z0-9._-]");
  }
  return loc;
}

namespace {

// The keys of section `section` of an INI-style AWS file ("key = value"
// lines under "[section]"; '#' and ';' start comments). Empty when the file
// or the section is missing. Files larger than 1 MiB are not read.
std::map<std::string, std::string> ReadAwsSection(const std::string& path, const std::string& section) {
  std::map<std::string, std::string> out;
  std::ifstream in(path);
  if (!in) return out;
  auto trim = [](std::string s) {
    const size_t a = s.find_first_not_of(" \t\r");
    const size_t b = s.find_last_not_of(" \t\r");
    return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
  };
  std::string line, current;
  size_t read = 0;
  while (std::getline(in, line)) {
    read += line.size() + 1;
    if (read > (1u << 20)) break;
    line = trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[' && line.back() == ']') {
      current = trim(line.substr(1, line.size() - 2));
      continue;
    }
    const size_t eq = line.find('=');
    if (current != section || eq == std::string::npos) continue;
    out[trim(line.substr(0, eq))] = trim(line.substr(eq + 1));
  }
  return out;
}

struct AwsFiles {
  std::string profile;
  std::string credentials;  // path of the shared credentials file
  std::string config;       // path of the config file
};

// Credentials of the profile from the shared credentials file, else from
// the config file; `source` says which. Empty when neither has both keys.
ObjectStoreCredentials ReadProfileCredentials(const AwsFiles& files, std::string* source) {
  const std::string config_section = files.profile == "default" ? "default" : "profile " + files.profile;
  for (const auto& [path, section] : {std::pair(files.credentials, files.profile), std::pair(files.config, config_section)}) {
    if (path.empty()) continue;
    auto keys = ReadAwsSection(path, section);
    ObjectStoreCredentials c{keys["aws_access_key_id"], keys["aws_secret_access_key"], keys["aws_session_token"]};
    if (!c.access_key.empty() && !c.secret_key.empty()) {
      if (source) *source = "profile '" + files.profile + "' of " + path;
      return c;
    }
  }
  return {};
}

}  // namespace

Result<ObjectStoreOptions> ObjectStoreOptions::FromEnvironment(const Environment& environment) {
  ObjectStoreOptions o;
  auto env = [&](const char* name) -> std::string {
    const char* v = environment ? environment(name) : nullptr;
    return v ? std::string(v) : std::string();
  };
  AwsFiles files;
  files.profile = env("AWS_PROFILE").empty() ? "default" : env("AWS_PROFILE");
  const std::string home = env("HOME");
  files.credentials = env("AWS_SHARED_CREDENTIALS_FILE");
  if (files.credentials.empty() && !home.empty()) files.credentials = home + "/.aws/credentials";
  files.config = env("AWS_CONFIG_FILE");
  if (files.config.empty() && !home.empty()) files.config = home + "/.aws/config";
  const auto profile_config = files.config.empty()
                                  ? std::map<std::string, std::string>{}
                                  : ReadAwsSection(files.config, files.profile == "default" ? "default"
                                                                                            : "profile " + files.profile);
  auto from_config = [&](const char* key) {
    auto it = profile_config.find(key);
    return it == profile_config.end() ? std::string() : it->second;
  };
  o.endpoint = env("AWS_ENDPOINT_URL");
  if (o.endpoint.empty()) o.endpoint = from_config("endpoint_url");
  if (o.endpoint.empty()) {
    return Status::InvalidArgument("no S3 endpoint: set AWS_ENDPOINT_URL (e.g. https://s3.us-east-1.amazonaws.com) "
                                   "or endpoint_url in the profile of " + files.config);
  }
  if (std::string r = env("AWS_REGION"); !r.empty()) {
    o.region = r;
  } else if (std::string d = env("AWS_DEFAULT_REGION"); !d.empty()) {
    o.region = d;
  } else if (std::string c = from_config("region"); !c.empty()) {
    o.region = c;
  }
  o.access_key = env("AWS_ACCESS_KEY_ID");
  o.secret_key = env("AWS_SECRET_ACCESS_KEY");
  o.session_token = env("AWS_SESSION_TOKEN");
  if (o.access_key.empty() || o.secret_key.empty()) {
    ObjectStoreCredentials c = ReadProfileCredentials(files, &o.credentials_source);
    if (c.access_key.empty()) {
      return Status::InvalidArgument("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or give "
                                     "profile '" + files.profile + "' aws_access_key_id and aws_secret_access_key in " +
                                     (files.credentials.empty() ? std::string("~/.aws/credentials") : files.credentials));
    }
    o.access_key = c.access_key;
    o.secret_key = c.secret_key;
    o.session_token = c.session_token;
    o.reload_credentials = [files]() -> Result<ObjectStoreCredentials> {
      ObjectStoreCredentials fresh = ReadProfileCredentials(files, nullptr);
      if (fresh.access_key.empty()) {
        return Status::FailedPrecondition("profile '" + files.profile + "' no longer has credentials in " +
                                          files.credentials);
      }
      return fresh;
    };
  }
  if (std::string k = env("CKPT_S3_MAX_LIST_KEYS"); !k.empty()) {
    char* end = nullptr;
    const unsigned long long keys = std::strtoull(k.c_str(), &end, 10);
    if (*end != '\0' || k[0] == '-' || keys < 1000 || keys > 1'000'000'000ull) {
      return Status::InvalidArgument("CKPT_S3_MAX_LIST_KEYS must be a number of keys from 1000 to 10^9, not '" + k +
                                     "'");
    }
    o.max_list_keys = keys;
  }
  if (std::string t = env("CKPT_S3_THROTTLE_WAIT"); !t.empty()) {
    char* end = nullptr;
    const long seconds = std::strtol(t.c_str(), &end, 10);
    if (*end != '\0' || seconds < 0 || seconds > 86400) {
      return Status::InvalidArgument("CKPT_S3_THROTTLE_WAIT must be a number of seconds from 0 to 86400, not '" + t +
                                     "'");
    }
    o.throttle_wait_s = static_cast<int>(seconds);
  }
  if (std::string d = env("CKPT_S3_REQUEST_DEADLINE"); !d.empty()) {
    char* end = nullptr;
    const long seconds = std::strtol(d.c_str(), &end, 10);
    if (*end != '\0' || seconds < 1 || seconds > 86400) {
      return Status::InvalidArgument("CKPT_S3_REQUEST_DEADLINE must be a number of seconds from 1 to 86400, not '" +
                                     d + "'");
    }
    o.request_deadline_s = static_cast<int>(seconds);
  }
  return o;
}

BufferPoolStats S3PartBufferStats(const Backend& backend) {
  const auto* s3 = dynamic_cast<const S3Backend*>(&backend);
  return s3 != nullptr ? s3->PartStats() : BufferPoolStats{};
}

Result<std::unique_ptr<Backend>> OpenS3Backend(const S3Location& location, const ObjectStoreOptions& options) {
  if (options.part_size < (5u << 20)) return Status::InvalidArgument("S3 part size must be at least 5 MiB");
  auto client = std::make_shared<S3Client>(location, options);
  // One cheap request, so that a wrong endpoint, bucket or key fails here
  // with a clear line rather than at the first write: a HEAD of the bucket,
  // which lists nothing (every process of a job opens the store). A HEAD
  // answer has no body to name the error: on a failure, a one-key listing
  // asks for it.
  auto head = client->Perform(MakeRequest("HEAD", client->BucketPath()));
  if (!head.ok() || head->status < 200 || head->status >= 300) {
    CKPT_RETURN_IF_ERROR(
        client->Call(MakeRequest("GET", client->BucketPath(), {{"list-type", "2"}, {"max-keys", "1"}}), "bucket")
            .status());
  }
  return std::unique_ptr<Backend>(new S3Backend(std::move(client)));
}

Status CreateS3Bucket(const S3Location& location, const ObjectStoreOptions& options) {
  S3Client client(location, options);
  Request req = MakeRequest("PUT", client.BucketPath());
  req.has_body = true;  // an empty body
  CKPT_ASSIGN_OR_RETURN(Response r, client.Perform(req));
  if (r.status >= 200 && r.status < 300) return Status::OK();
  if (XmlFirst(r.body, "Code") == "BucketAlreadyOwnedByYou") return Status::OK();
  if (XmlFirst(r.body, "Code") == "BucketAlreadyExists") {
    return Status::AlreadyExists("bucket '" + location.bucket + "' exists and belongs to someone else");
  }
  return client.ErrorOf(req, r, "bucket '" + location.bucket + "'");
}

Status DeleteS3Bucket(const S3Location& location, const ObjectStoreOptions& options) {
  S3Client client(location, options);
  Request req = MakeRequest("DELETE", client.BucketPath());
  CKPT_ASSIGN_OR_RETURN(Response r, client.Perform(req));
  if (r.status >= 200 && r.status < 300) return Status::OK();
  if (XmlFirst(r.body, "Code") == "BucketNotEmpty") {
    return Status::FailedPrecondition("bucket '" + location.bucket + "' is not empty");
  }
  return client.ErrorOf(req, r, "bucket '" + location.bucket + "'");
}

}  // namespace ckptfs
