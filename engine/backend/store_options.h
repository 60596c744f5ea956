// Settings of an object store reached over the S3 protocol (AWS S3, Ceph
// RGW, MinIO, and the S3 interfaces of other clouds): endpoint, region,
// credentials, retries. Engine code above backend/ names stores by URL
// (store_url.h) and passes these along; only backend/ knows the protocol.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/environment.h"
#include "core/status.h"

namespace ckptfs {

struct ObjectStoreCredentials {
  std::string access_key;
  std::string secret_key;
  std::string session_token;  // optional (temporary credentials)
  bool operator==(const ObjectStoreCredentials&) const = default;
};

struct ObjectStoreOptions {
  std::string endpoint;              // "https://s3.amazonaws.com", "http://127.0.0.1:7480"
  std::string region = "us-east-1";
  std::string access_key;
  std::string secret_key;
  std::string session_token;         // optional (temporary credentials)
  // Where the credentials came from, for messages ("AWS_ACCESS_KEY_ID",
  // "profile 'p' of /home/u/.aws/credentials"); never the secret itself.
  std::string credentials_source = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY";
  // When set, called when the store answers that the credentials expired
  // (ExpiredToken, TokenRefreshRequired, RequestExpired): fresh ones are
  // used for the rest of the request and every later one. Credentials from
  // a file are read from it again this way (a tool such as aws sso or a
  // credential helper rewrites the file before they expire).
  std::function<Result<ObjectStoreCredentials>()> reload_credentials;
  uint64_t part_size = 16ull << 20;  // multipart part size, >= 5 MiB
  int max_retries = 5;               // after the first attempt; backoff 0.1 s doubling
  // A throttled request (429 Too Many Requests, 503 SlowDown) is retried
  // beyond max_retries until this many seconds after it began (within
  // request_deadline_s), its backoff growing to 5 s, with jitter: a store
  // that limits the request rate slows a restart storm down rather than
  // failing it. 0: throttling counts as any other failed attempt.
  int throttle_wait_s = 120;
  int connect_timeout_ms = 5000;
  int stall_timeout_s = 30;          // a transfer making no progress this long fails (and is retried)
  // One request, all its retries included, ends within this many seconds:
  // a server that trickles an answer cannot hold a command for hours.
  int request_deadline_s = 600;
  bool reuse_connections = true;     // keep-alive; off, every request has its own connection
  // One listing holds at most this many keys, a hundredth as many pages
  // (100 of them with no key) and 2 KiB of answer per key: a store whose
  // listing never ends is stopped with an error in bounded time and memory.
  uint64_t max_list_keys = 10'000'000;

  // As the AWS CLI finds them: AWS_ENDPOINT_URL, AWS_REGION (or
  // AWS_DEFAULT_REGION; default us-east-1), AWS_ACCESS_KEY_ID,
  // AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN from the environment; what
  // is missing there from the profile AWS_PROFILE names (default
  // "default"): credentials from its section of the shared credentials
  // file (AWS_SHARED_CREDENTIALS_FILE, default ~/.aws/credentials), else of
  // the config file (AWS_CONFIG_FILE, default ~/.aws/config, section
  // "profile NAME"), which may also give endpoint_url and region. Credentials
  // from a file are re-read when they expire (reload_credentials). The
  // endpoint is required: there is no default. CKPT_S3_REQUEST_DEADLINE
  // (seconds, default 600), CKPT_S3_MAX_LIST_KEYS (default 10^7). InvalidArgument naming what is missing or
  // malformed, never a secret. `env` looks the variables up (std::getenv
  // for the process's own environment).
  static Result<ObjectStoreOptions> FromEnvironment(const Environment& env);
};

}  // namespace ckptfs
