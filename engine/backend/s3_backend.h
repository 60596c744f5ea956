// Objects in an S3-compatible object store (AWS S3, Ceph RGW, MinIO),
// through libcurl and its built-in AWS Signature V4.
//
// A location is `s3://BUCKET/PREFIX`: every object key of the Backend
// interface lives under PREFIX/ in BUCKET (path-style requests, so any
// endpoint works). Honours backend.h's contracts:
//   - Put is one PUT (atomic on every S3 store). ObjectWriter streams a
//     multipart upload: a part is uploaded as soon as it fills, the object
//     appears only with CompleteMultipartUpload, and Abort (or a failed
//     part) aborts the upload on the server. A writer that never reaches
//     the server (small objects) ends in a single PUT.
//   - ReadRange is one ranged GET that must return exactly the bytes asked.
//   - List follows ListObjectsV2 pagination; keys come back sorted.
//   - Delete of a missing key is NotFound (a HEAD first: S3's DELETE
//     succeeds on missing keys).
// It assumes the store's strong read-after-write consistency for PUT, LIST
// and DELETE, which AWS S3 and Ceph RGW provide.
//
// Errors: 5xx answers, 429/408, timeouts, refused and reset connections are
// retried with exponential backoff (S3Options::max_retries); what is left
// becomes IOError naming the endpoint. 4xx answers are not retried: a
// missing bucket is NotFound, refused credentials or access are
// FailedPrecondition, each with one line saying what to check.
//
// Thread safety: all methods may be called concurrently (one curl handle
// per request, reused through a pool).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "backend/backend.h"
#include "core/environment.h"
#include "core/status.h"

namespace ckptfs {

struct S3Location {
  std::string bucket;
  std::string prefix;  // without leading or trailing '/'; may be empty
  std::string ToString() const;  // "s3://bucket/prefix"
};

// True for "s3://...".
bool IsS3Url(std::string_view url);
// Parses "s3://BUCKET[/PREFIX]". InvalidArgument for a bucket name S3 would
// refuse or a prefix that is not a valid object key.
Result<S3Location> ParseS3Url(std::string_view url);

struct S3Credentials {
  std::string access_key;
  std::string secret_key;
  std::string session_token;  // optional (temporary credentials)
  bool operator==(const S3Credentials&) const = default;
};

struct S3Options {
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
  std::function<Result<S3Credentials>()> reload_credentials;
  uint64_t part_size = 16ull << 20;  // multipart part size, >= 5 MiB
  int max_retries = 5;               // after the first attempt; backoff 0.1 s doubling
  int connect_timeout_ms = 5000;
  int stall_timeout_s = 30;          // a transfer making no progress this long fails (and is retried)
  // One request, all its retries included, ends within this many seconds:
  // a server that trickles an answer cannot hold a command for hours.
  int request_deadline_s = 600;
  bool reuse_connections = true;     // keep-alive; off, every request has its own connection

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
  // (seconds, default 600). InvalidArgument naming what is missing or
  // malformed, never a secret. `env` looks the variables up (std::getenv
  // for the process's own environment).
  static Result<S3Options> FromEnvironment(const Environment& env);
};

Result<std::unique_ptr<Backend>> OpenS3Backend(const S3Location& location, const S3Options& options);

// Creates the bucket; OK when it already exists and belongs to these
// credentials.
Status CreateS3Bucket(const S3Location& location, const S3Options& options);

}  // namespace ckptfs
