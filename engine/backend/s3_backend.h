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
// retried with exponential backoff (ObjectStoreOptions::max_retries); what is left
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
#include "backend/store_options.h"
#include "core/buffer_pool.h"
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

Result<std::unique_ptr<Backend>> OpenS3Backend(const S3Location& location, const ObjectStoreOptions& options);

// The multipart part buffers an S3 backend's object writers have been given
// (allocated, and reused from the writers before them); all zero for a
// backend that is not S3.
BufferPoolStats S3PartBufferStats(const Backend& backend);

// Creates the bucket; OK when it already exists and belongs to these
// credentials.
Status CreateS3Bucket(const S3Location& location, const ObjectStoreOptions& options);

// Deletes the bucket, which must be empty (FailedPrecondition otherwise).
Status DeleteS3Bucket(const S3Location& location, const ObjectStoreOptions& options);

}  // namespace ckptfs
