// The S3 backend beyond the shared conformance suite: multipart uploads,
// URLs, and the one-line errors for bad credentials, a missing bucket and an
// unreachable endpoint. Needs the S3 server that the AWS_* variables name
// (tools/s3-server.sh); skips, saying so, without one.
#include "backend/s3_backend.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <cstdlib>
#include <thread>

#include "core/random.h"
#include "fault_proxy.h"
#include "test_backends.h"
#include "test_util.h"

namespace ckptfs {
namespace {

using testing::RandomBytes;

TEST(S3Url, BucketAndPrefixAreParsedAndChecked) {
  auto loc = ParseS3Url("s3://my-bucket/team/run-7/");
  ASSERT_OK(loc);
  EXPECT_EQ(loc->bucket, "my-bucket");
  EXPECT_EQ(loc->prefix, "team/run-7");
  EXPECT_EQ(loc->ToString(), "s3://my-bucket/team/run-7");
  auto bare = ParseS3Url("s3://bucket");
  ASSERT_OK(bare);
  EXPECT_EQ(bare->prefix, "");
  for (const char* bad : {"s3://", "s3://ab", "s3://Upper/x", "s3://bucket/a//b", "s3://bucket/.hidden", "/local/path",
                          "s3://-bucket/x"}) {
    EXPECT_EQ(ParseS3Url(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_TRUE(IsS3Url("s3://b/p"));
  EXPECT_FALSE(IsS3Url("/data/s3://x"));
}

class S3Backend : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    auto o = testing::S3TestOptions(&why);
    CKPTFS_SKIP_UNLESS(o, why);
    options_ = *o;
    options_.part_size = 5 << 20;  // the smallest S3 allows: several parts per test object
    location_ = {"ckptfs-test", "s3-backend-" + RandomHex(8)};
    ASSERT_OK(CreateS3Bucket(location_, options_));
    auto b = OpenS3Backend(location_, options_);
    ASSERT_OK(b);
    backend_ = std::move(b).value();
  }
  ObjectStoreOptions options_;
  S3Location location_;
  std::unique_ptr<Backend> backend_;
};

TEST_F(S3Backend, LargeObjectsStreamAsMultipartUploadsAndAppearOnlyWhenComplete) {
  auto data = RandomBytes((12 << 20) + 12345, 1);
  auto w = backend_->Create("packs/big");
  ASSERT_OK(w);
  // Odd pieces: parts fill across Append calls.
  size_t off = 0, piece = 777777;
  while (off < data.size()) {
    const size_t n = std::min(piece, data.size() - off);
    ASSERT_OK((*w)->Append({data.data() + off, n}));
    off += n;
    piece = piece * 3 % 4000000 + 1;
    if (off > (6 << 20)) {
      // At least one part is on the server by now, and still nothing is visible.
      EXPECT_TRUE(backend_->Size("packs/big").status().IsNotFound());
      EXPECT_TRUE(backend_->List("packs/")->empty());
    }
  }
  ASSERT_OK((*w)->Commit());
  auto size = backend_->Size("packs/big");
  ASSERT_OK(size);
  EXPECT_EQ(*size, data.size());
  // Ranged reads across part boundaries.
  for (uint64_t start : {uint64_t{0}, uint64_t{(5 << 20) - 3}, uint64_t{(10 << 20) + 1}, uint64_t{data.size() - 10}}) {
    std::vector<std::byte> out(10);
    ASSERT_OK(backend_->ReadRange("packs/big", start, out));
    EXPECT_TRUE(std::equal(out.begin(), out.end(), data.begin() + start)) << start;
  }
  auto all = backend_->ReadAll("packs/big");
  ASSERT_OK(all);
  EXPECT_TRUE(std::equal(all->begin(), all->end(), reinterpret_cast<const char*>(data.data())));
  std::vector<std::byte> past(6);
  EXPECT_FALSE(backend_->ReadRange("packs/big", data.size() - 5, past).ok());
}

TEST_F(S3Backend, AnAbortedMultipartUploadLeavesNothingBehind) {
  auto data = RandomBytes(11 << 20, 2);
  {
    auto w = backend_->Create("packs/aborted");
    ASSERT_OK(w);
    ASSERT_OK((*w)->Append(data));  // two parts uploaded
    (*w)->Abort();
  }
  {
    auto w = backend_->Create("packs/dropped");
    ASSERT_OK(w);
    ASSERT_OK((*w)->Append(data));
  }  // destroyed without Commit: aborted
  EXPECT_TRUE(backend_->List("")->empty());
  EXPECT_TRUE(backend_->Size("packs/aborted").status().IsNotFound());
  // Nothing is left for RemoveIncomplete either (it would abort what is).
  ASSERT_OK(backend_->RemoveIncomplete());
}

TEST_F(S3Backend, WritersReuseTheirPartBuffersAndInterleavedWritersStayApart) {
  // Two writers at once, appending in turns: each object holds its own
  // bytes, whichever buffer each writer got.
  auto a = RandomBytes((7 << 20) + 11, 3), b = RandomBytes((6 << 20) + 5, 4);
  {
    auto wa = backend_->Create("packs/a");
    auto wb = backend_->Create("packs/b");
    ASSERT_OK(wa);
    ASSERT_OK(wb);
    const size_t step = 1 << 20;
    for (size_t off = 0; off < std::max(a.size(), b.size()); off += step) {
      if (off < a.size()) ASSERT_OK((*wa)->Append({a.data() + off, std::min(step, a.size() - off)}));
      if (off < b.size()) ASSERT_OK((*wb)->Append({b.data() + off, std::min(step, b.size() - off)}));
    }
    ASSERT_OK((*wb)->Commit());
    ASSERT_OK((*wa)->Commit());
  }
  auto got_a = backend_->ReadAll("packs/a");
  auto got_b = backend_->ReadAll("packs/b");
  ASSERT_OK(got_a);
  ASSERT_OK(got_b);
  ASSERT_EQ(got_a->size(), a.size());
  ASSERT_EQ(got_b->size(), b.size());
  EXPECT_EQ(std::memcmp(got_a->data(), a.data(), a.size()), 0);
  EXPECT_EQ(std::memcmp(got_b->data(), b.data(), b.size()), 0);
  // Writers one after another write into the buffers the first ones used
  // (touched pages, no fresh mapping per object): two buffers for the two
  // writers above, none for the three objects of 4 parts below.
  auto data = RandomBytes(20 << 20, 5);
  for (int i = 0; i < 3; ++i) {
    auto w = backend_->Create("packs/reuse-" + std::to_string(i));
    ASSERT_OK(w);
    ASSERT_OK((*w)->Append(data));
    ASSERT_OK((*w)->Commit());
  }
  const BufferPoolStats parts = S3PartBufferStats(*backend_);
  EXPECT_EQ(parts.allocations, 2u);
  EXPECT_EQ(parts.reuses, 3u);
  EXPECT_EQ(parts.idle_buffers, 2u);
  auto size = backend_->Size("packs/reuse-2");
  ASSERT_OK(size);
  EXPECT_EQ(*size, data.size());
}

TEST_F(S3Backend, BadCredentialsAMissingBucketAndAnUnreachableEndpointEachGiveOneClearError) {
  ObjectStoreOptions wrong = options_;
  wrong.secret_key = "not-the-secret";
  auto creds = OpenS3Backend(location_, wrong);
  EXPECT_EQ(creds.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(creds.status().message().find("AWS_SECRET_ACCESS_KEY"), std::string::npos) << creds.status().message();
  EXPECT_EQ(creds.status().message().find('\n'), std::string::npos);

  auto missing = OpenS3Backend({"ckptfs-no-such-bucket", ""}, options_);
  EXPECT_TRUE(missing.status().IsNotFound());
  EXPECT_NE(missing.status().message().find("'ckptfs-no-such-bucket' does not exist"), std::string::npos)
      << missing.status().message();

  ObjectStoreOptions nowhere = options_;
  nowhere.endpoint = "http://127.0.0.1:9";  // discard port: nothing listens
  nowhere.max_retries = 2;
  const auto t0 = std::chrono::steady_clock::now();
  auto unreachable = OpenS3Backend(location_, nowhere);
  EXPECT_EQ(unreachable.status().code(), StatusCode::kIOError);
  EXPECT_NE(unreachable.status().message().find("127.0.0.1:9"), std::string::npos) << unreachable.status().message();
  EXPECT_NE(unreachable.status().message().find("3 attempts"), std::string::npos) << unreachable.status().message();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

// Commits look for objects that are not there yet (the manifest, a rank's
// object) on every rank: telling a missing object from a missing bucket
// must not cost a listing, which stores throttle first.
TEST_F(S3Backend, AMissingObjectIsToldFromAMissingBucketWithoutAListing) {
  const RequestCounts before = backend_->Requests();
  auto missing = backend_->Size("manifests/none.manifest");
  EXPECT_TRUE(missing.status().IsNotFound()) << missing.status().ToString();
  EXPECT_NE(missing.status().message().find("manifests/none.manifest"), std::string::npos)
      << missing.status().message();
  const RequestCounts sent = backend_->Requests() - before;
  EXPECT_EQ(sent.list, 0u);
  EXPECT_EQ(sent.head, 2u);  // the object's, then the bucket's

  // A bucket deleted under an open backend: the error names the bucket.
  const S3Location gone{"ckptfs-gone-" + RandomHex(8), ""};
  ASSERT_OK(CreateS3Bucket(gone, options_));
  auto b = OpenS3Backend(gone, options_);
  ASSERT_OK(b);
  ASSERT_OK(DeleteS3Bucket(gone, options_));
  auto size = (*b)->Size("manifests/none.manifest");
  EXPECT_TRUE(size.status().IsNotFound()) << size.status().ToString();
  EXPECT_NE(size.status().message().find("bucket '" + gone.bucket + "' does not exist"), std::string::npos)
      << size.status().message();
  // Only an empty bucket is deleted.
  ASSERT_OK(backend_->Put("x", testing::AsBytes("x")));
  EXPECT_EQ(DeleteS3Bucket({location_.bucket, ""}, options_).code(), StatusCode::kFailedPrecondition);
}

TEST_F(S3Backend, ListingFollowsPagination) {
  // More keys than one ListObjectsV2 page (1000).
  std::vector<std::string> keys;
  for (int i = 0; i < 1100; ++i) keys.push_back("m/" + std::to_string(100000 + i));
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < keys.size(); i += 8) ASSERT_OK(backend_->Put(keys[i], testing::AsBytes("x")));
    });
  }
  for (auto& th : threads) th.join();
  auto listed = backend_->List("m/");
  ASSERT_OK(listed);
  EXPECT_EQ(*listed, keys);
}

// The S3 server behind a proxy that breaks every third request in turn:
// a 503, a reset, an answer cut short, silence past the stall timeout.
TEST_F(S3Backend, TransientFaultsAreRetriedUntilEveryOperationSucceeds) {
  using Fault = testing::FaultProxy::Fault;
  const Fault kinds[] = {Fault::kServiceUnavailable, Fault::kResetBeforeAnswer, Fault::kCutAnswer, Fault::kSilence};
  const int upstream = std::stoi(options_.endpoint.substr(options_.endpoint.rfind(':') + 1));
  testing::FaultProxy proxy(upstream, [&](int n) { return n % 3 == 1 ? kinds[(n / 3) % 4] : Fault::kNone; });
  ObjectStoreOptions faulty = options_;
  faulty.endpoint = "http://127.0.0.1:" + std::to_string(proxy.port());
  faulty.reuse_connections = false;  // one request per connection: the plan picks requests
  faulty.stall_timeout_s = 1;
  faulty.max_retries = 6;
  auto opened = OpenS3Backend(location_, faulty);
  ASSERT_OK(opened);
  Backend& b = **opened;

  auto small = RandomBytes(100000, 3);
  ASSERT_OK(b.Put("obj/small", small));
  auto big = RandomBytes((11 << 20) + 7, 4);
  auto w = b.Create("obj/big");
  ASSERT_OK(w);
  ASSERT_OK((*w)->Append(big));
  ASSERT_OK((*w)->Commit());
  std::vector<std::byte> part(1 << 20);
  ASSERT_OK(b.ReadRange("obj/big", 5 << 20, part));
  EXPECT_TRUE(std::equal(part.begin(), part.end(), big.begin() + (5 << 20)));
  auto all = b.ReadAll("obj/small");
  ASSERT_OK(all);
  EXPECT_EQ(all->size(), small.size());
  EXPECT_TRUE(std::equal(all->begin(), all->end(), reinterpret_cast<const char*>(small.data())));
  auto listed = b.List("obj/");
  ASSERT_OK(listed);
  EXPECT_EQ(*listed, (std::vector<std::string>{"obj/big", "obj/small"}));
  ASSERT_OK(b.Delete("obj/small"));
  EXPECT_TRUE(backend_->Size("obj/small").status().IsNotFound());
  // Checked without the proxy: the big object is whole.
  auto size = backend_->Size("obj/big");
  ASSERT_OK(size);
  EXPECT_EQ(*size, big.size());
  EXPECT_GE(proxy.faults(), 4) << "the plan should have broken requests of each kind";
}

TEST_F(S3Backend, AnUploadThatKeepsFailingFailsCleanlyAndLeavesNoObject) {
  using Fault = testing::FaultProxy::Fault;
  const int upstream = std::stoi(options_.endpoint.substr(options_.endpoint.rfind(':') + 1));
  // The first requests get through (the bucket check, the upload's start
  // and first part); from then on the server answers 503 forever.
  testing::FaultProxy proxy(upstream, [](int n) { return n < 3 ? Fault::kNone : Fault::kServiceUnavailable; });
  ObjectStoreOptions faulty = options_;
  faulty.endpoint = "http://127.0.0.1:" + std::to_string(proxy.port());
  faulty.reuse_connections = false;
  faulty.max_retries = 2;
  faulty.throttle_wait_s = 0;  // 503 forever
  auto opened = OpenS3Backend(location_, faulty);
  ASSERT_OK(opened);
  auto w = (*opened)->Create("obj/doomed");
  ASSERT_OK(w);
  auto data = RandomBytes(12 << 20, 5);
  Status st = (*w)->Append(data);
  if (st.ok()) st = (*w)->Commit();
  EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
  EXPECT_NE(st.message().find("3 attempts"), std::string::npos) << st.message();
  // Seen directly: no object, and the upload the writer could not abort
  // through the failing proxy is removed by RemoveIncomplete.
  EXPECT_TRUE(backend_->Size("obj/doomed").status().IsNotFound());
  EXPECT_TRUE(backend_->List("")->empty());
  ASSERT_OK(backend_->RemoveIncomplete());
}

// A store that throttles (429, 503 SlowDown) slows a request down rather
// than failing it: the request is retried past max_retries, with backoff
// and jitter, until throttle_wait_s has passed; then it fails, saying so.
TEST_F(S3Backend, AThrottledRequestWaitsPastMaxRetriesForTheThrottleWait) {
  using Fault = testing::FaultProxy::Fault;
  const int upstream = std::stoi(options_.endpoint.substr(options_.endpoint.rfind(':') + 1));
  ASSERT_OK(backend_->Put("obj/x", std::as_bytes(std::span("payload", 7))));
  for (const Fault mode : {Fault::kTooManyRequests, Fault::kServiceUnavailable}) {
    std::atomic<int> throttle_from{1 << 30}, throttle_until{1 << 30};
    testing::FaultProxy proxy(upstream, [&](int n) {
      return n >= throttle_from && n < throttle_until ? mode : Fault::kNone;
    });
    ObjectStoreOptions throttled = options_;
    throttled.endpoint = "http://127.0.0.1:" + std::to_string(proxy.port());
    throttled.reuse_connections = false;
    throttled.max_retries = 1;
    throttled.throttle_wait_s = 60;
    auto opened = OpenS3Backend(location_, throttled);
    ASSERT_OK(opened);
    // 4 throttled answers in a row, past max_retries: the read still succeeds.
    throttle_from = proxy.connections();
    throttle_until = throttle_from + 4;
    std::vector<std::byte> got(7);
    ASSERT_OK((*opened)->ReadRange("obj/x", 0, got));
    EXPECT_EQ(std::memcmp(got.data(), "payload", 7), 0);
    EXPECT_EQ(proxy.faults(), 4);
    // Throttled for good: it fails once the throttle wait is over, and says so.
    throttled.throttle_wait_s = 1;
    auto impatient = OpenS3Backend(location_, throttled);
    ASSERT_OK(impatient);
    throttle_from = proxy.connections();
    throttle_until = 1 << 30;
    const auto t0 = std::chrono::steady_clock::now();
    Status st = (*impatient)->ReadRange("obj/x", 0, got);
    EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
    EXPECT_FALSE(st.IsNotFound());
    EXPECT_NE(st.message().find("CKPT_S3_THROTTLE_WAIT"), std::string::npos) << st.message();
    EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  }
}

}  // namespace
}  // namespace ckptfs
