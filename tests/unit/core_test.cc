// Status, dtypes, random ids and chunk ids.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <set>

#include "core/chunk_id.h"
#include "core/dtype.h"
#include "core/random.h"
#include "core/status.h"

namespace ckptfs {
namespace {

TEST(Status, OkIsCheapAndErrorsCarryCodeAndMessage) {
  Status ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.ToString(), "OK");
  Status e = Status::NotFound("no checkpoint named 'x'");
  EXPECT_TRUE(e.IsNotFound());
  EXPECT_EQ(e.ToString(), "NotFound: no checkpoint named 'x'");
  EXPECT_EQ(e.WithContext("ls").message(), "ls: no checkpoint named 'x'");
  EXPECT_TRUE(Status::OK().WithContext("ignored").ok());
}

TEST(Status, ErrnoMapsToCodes) {
  EXPECT_EQ(Status::FromErrno(ENOSPC, "writing").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Status::FromErrno(EDQUOT, "writing").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Status::FromErrno(ENOENT, "opening").code(), StatusCode::kNotFound);
  EXPECT_EQ(Status::FromErrno(EEXIST, "creating").code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(Status::FromErrno(EIO, "reading").code(), StatusCode::kIOError);
  EXPECT_NE(Status::FromErrno(ENOSPC, "writing x").message().find("No space left on device"), std::string::npos);
}

TEST(Result, HoldsValueOrError) {
  Result<int> v = 3;
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 3);
  Result<int> e = Status::Corruption("bad");
  EXPECT_TRUE(e.status().IsCorruption());
}

TEST(DType, EverySafetensorsDTypeRoundTrips) {
  const char* names[] = {"BOOL", "U8",  "I8",  "U16", "I16", "U32",    "I32",    "U64",
                         "I64",  "F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"};
  const uint32_t sizes[] = {1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8, 1, 1};
  for (int i = 0; i < kDTypeCount; ++i) {
    auto dt = ParseDType(names[i]);
    ASSERT_TRUE(dt.has_value()) << names[i];
    EXPECT_EQ(DTypeName(*dt), names[i]);
    EXPECT_EQ(DTypeSize(*dt), sizes[i]) << names[i];
    EXPECT_EQ(DTypeFromCode(i), dt);
  }
  EXPECT_FALSE(ParseDType("F8").has_value());
  EXPECT_FALSE(ParseDType("bf16").has_value());
  EXPECT_FALSE(DTypeFromCode(kDTypeCount).has_value());
  EXPECT_EQ(NumpyDescr(DType::kBF16), "<u2");  // bits kept in a same-width unsigned type
  EXPECT_EQ(NumpyDescr(DType::kF8E4M3), "|u1");
}

TEST(ChunkHasher, PiecesHashLikeTheirConcatenation) {
  std::vector<std::byte> data(700 << 10);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
  const ChunkId whole = ChunkId::Of(data);
  ChunkHasher h;
  for (size_t piece : {size_t{1}, size_t{4096}, size_t{256 << 10}, data.size()}) {
    h.Reset();
    for (size_t at = 0; at < data.size(); at += piece) {
      h.Update(std::span(data).subspan(at, std::min(piece, data.size() - at)));
    }
    EXPECT_EQ(h.Finish(), whole) << piece;
  }
  h.Reset();
  EXPECT_EQ(h.Finish(), ChunkId::Of({}));
  data[data.size() - 1] ^= std::byte{1};
  h.Reset();
  h.Update(data);
  EXPECT_NE(h.Finish(), whole);
}

TEST(RandomHex, DistinctAndForkSafe) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    std::string id = RandomHex(24);
    ASSERT_EQ(id.size(), 24u);
    ASSERT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos);
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 1000u);
  // The generator was used before fork: the child must not repeat the parent.
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    std::string id = RandomHex(24);
    ssize_t w = ::write(pipefd[1], id.data(), id.size());
    _exit(w == 24 ? 0 : 1);
  }
  std::string parent = RandomHex(24);
  char buf[24];
  ASSERT_EQ(::read(pipefd[0], buf, sizeof buf), 24);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  EXPECT_NE(std::string(buf, 24), parent);
}

}  // namespace
}  // namespace ckptfs
