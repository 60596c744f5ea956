#include "core/status.h"

#include <cstdio>
#include <cstdlib>

#include <cerrno>
#include <cstring>

namespace ckptfs {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kCorruption: return "Corruption";
    case StatusCode::kIOError: return "IOError";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kUnsupported: return "Unsupported";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string message) {
  if (code != StatusCode::kOk) rep_ = std::make_shared<const Rep>(Rep{code, std::move(message)});
}

Status Status::FromErrno(int err, std::string_view context) {
  std::string msg(context);
  msg += ": ";
  msg += std::strerror(err);
  switch (err) {
    case ENOENT: return NotFound(std::move(msg));
    case EEXIST: return AlreadyExists(std::move(msg));
    case ENOSPC:
    case EDQUOT:
    case ENOMEM: return ResourceExhausted(std::move(msg));
    default: return IOError(std::move(msg));
  }
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(rep_->code)) + ": " + rep_->message;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Status(rep_->code, std::string(context) + ": " + rep_->message).WithDetail(rep_->detail);
}

Status Status::WithDetail(StatusDetail detail) const {
  if (ok() || rep_->detail == detail) return *this;
  Status out;
  out.rep_ = std::make_shared<const Rep>(Rep{rep_->code, rep_->message, detail});
  return out;
}

namespace internal {
void DieOnValueOfError(const Status& status) {
  std::fprintf(stderr, "ckptfs: value() called on an error result: %s\n", status.ToString().c_str());
  std::abort();
}
}  // namespace internal

}  // namespace ckptfs
