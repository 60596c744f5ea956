// Status and Result<T>: the one error type of the engine.
//
// A Status is OK or carries a code and a message meant for a person. Errors
// from the OS (errno), LMDB, zstd and the filesystem are converted into a
// Status where they enter the engine; only tools/ turns one into an exit code
// and fuse/ into an errno.
//
// Thread safety: Status and Result are values; distinct objects may be used
// from distinct threads without synchronisation.
#pragma once

#include <cassert>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace ckptfs {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // the caller's input is malformed or inconsistent
  kNotFound,         // a named thing (checkpoint, tensor, object) does not exist
  kAlreadyExists,    // a name is taken
  kCorruption,       // stored bytes fail a check (hash, magic, length)
  kIOError,          // the OS refused an operation; message carries errno text
  kFailedPrecondition,  // the repository is in a state that forbids the call
  kUnsupported,      // valid but not handled by this build (e.g. newer format)
  kResourceExhausted,   // out of space or memory
  kInternal,         // a bug: an invariant of ckptfs itself does not hold
};

const char* StatusCodeName(StatusCode code);

// What a caller may branch on beyond the code: the message is for people,
// and no decision is taken on its text. Kept by WithContext.
enum class StatusDetail {
  kNone = 0,
  kCatalogOpenInProcess,  // FailedPrecondition: this process has the catalog open
                          // (through another, maybe closing, Repository handle)
  kCatalogMapFull,        // ResourceExhausted: LMDB's map is full (grow it, retry)
  kBucketMissing,         // NotFound: the object store's bucket does not exist
  kCollective,            // any code: a collective's ranks agreed on this failure
                          // (another rank's, or the group's transport), as every
                          // rank of the group reports it (ckpt/collective.h)
};

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
  static Status Corruption(std::string m) { return {StatusCode::kCorruption, std::move(m)}; }
  static Status IOError(std::string m) { return {StatusCode::kIOError, std::move(m)}; }
  static Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
  static Status Unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status ResourceExhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  // Converts an errno value; ENOSPC/EDQUOT become kResourceExhausted, ENOENT kNotFound.
  static Status FromErrno(int err, std::string_view context);

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  const std::string& message() const;
  // "NotFound: checkpoint 'x' does not exist"
  std::string ToString() const;
  // Returns a copy whose message is prefixed with "context: ".
  Status WithContext(std::string_view context) const;
  // The detail (kNone for OK and for most errors), and a copy with one.
  StatusDetail detail() const { return rep_ ? rep_->detail : StatusDetail::kNone; }
  Status WithDetail(StatusDetail detail) const;

  bool IsNotFound() const { return code() == StatusCode::kNotFound; }
  bool IsAlreadyExists() const { return code() == StatusCode::kAlreadyExists; }
  bool IsCorruption() const { return code() == StatusCode::kCorruption; }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
    StatusDetail detail = StatusDetail::kNone;
  };
  std::shared_ptr<const Rep> rep_;  // null means OK: copying OK is free
};

namespace internal {
// Prints "value() called on an error result: <status>" and aborts.
[[noreturn]] void DieOnValueOfError(const Status& status);
}  // namespace internal

// Holds a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    assert(!status_.ok() && "Result constructed from OK status");
    if (status_.ok()) status_ = Status::Internal("Result built from OK status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  // The value; calling these on an error is a bug, which stops the process
  // with the error's message in every build (never undefined behaviour).
  T& value() & { CheckOk(); return *value_; }
  const T& value() const& { CheckOk(); return *value_; }
  T&& value() && { CheckOk(); return std::move(*value_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  void CheckOk() const {
    if (!ok()) [[unlikely]] internal::DieOnValueOfError(status_);
  }
  Status status_;
  std::optional<T> value_;
};

namespace internal {
inline const Status& GetStatus(const Status& s) { return s; }
template <typename T>
const Status& GetStatus(const Result<T>& r) { return r.status(); }
}  // namespace internal

}  // namespace ckptfs

#define CKPT_CONCAT_INNER(a, b) a##b
#define CKPT_CONCAT(a, b) CKPT_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function if it is not OK.
// (Prefixed: a library linked into a training process must not collide with
// absl's or anyone else's macros.)
#define CKPT_RETURN_IF_ERROR(expr)                                    \
  do {                                                                \
    const ::ckptfs::Status _st = ::ckptfs::internal::GetStatus(expr); \
    if (!_st.ok()) return _st;                                        \
  } while (0)

// `lhs = value of rexpr`, or returns its Status from the enclosing function.
#define CKPT_ASSIGN_OR_RETURN(lhs, rexpr) \
  CKPT_ASSIGN_OR_RETURN_IMPL(CKPT_CONCAT(_result_, __LINE__), lhs, rexpr)
#define CKPT_ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                               \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
