// The NCCL backend's bootstrap, bounded waits and aborts, against a fake
// NCCL and CUDA runtime linked in place of the real ones
// (tests/collective/fake_nccl.h): runs without a GPU.
#include "client/collective/nccl_collective.h"

#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/collective/fake_nccl.h"

namespace accord {
namespace {

using testing::Fake;

// Get never waits: a missing key is DEADLINE_EXCEEDED at once.
class MapKvStore : public KeyValueStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override {
    values_[key] = value;
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               std::chrono::milliseconds) override {
    std::vector<std::string> out;
    for (const std::string& k : keys) {
      auto it = values_.find(k);
      if (it == values_.end()) return absl::DeadlineExceededError(absl::StrCat("missing ", k));
      out.push_back(it->second);
    }
    return out;
  }
  std::map<std::string, std::string> values_;
};

class NcclCollectiveTest : public ::testing::Test {
 protected:
  void SetUp() override { testing::ResetFake(); }

  CollectiveOptions Options() {
    CollectiveOptions o;
    o.incarnation = "run-7";
    o.timeout = std::chrono::milliseconds(50);
    return o;
  }
  absl::StatusOr<std::unique_ptr<Collective>> Make(int rank = 0, int world = 2) {
    return NcclCollective::Create(rank, world, kv_, "job/g0/nccl", options_);
  }

  MapKvStore kv_;
  CollectiveOptions options_ = Options();
  char in_[64] = {};
  char out_[32] = {};
};

TEST_F(NcclCollectiveTest, CreatesTheCommunicatorNonBlockingAndPublishesTheIdUnderTheIncarnation) {
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(Fake().last_blocking, 0);
  EXPECT_EQ(kv_.values_.count("job/g0/nccl/run-7/nccl_unique_id"), 1u);
  EXPECT_EQ((*c)->backend(), Backend::kNccl);
}

TEST_F(NcclCollectiveTest, RequiresAnIncarnation) {
  options_.incarnation.clear();
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("incarnation"), std::string::npos) << c.status();
  EXPECT_EQ(Fake().init_calls, 0);
}

TEST_F(NcclCollectiveTest, RankZeroRefusesToOverwriteAPublishedId) {
  kv_.values_["job/g0/nccl/run-7/nccl_unique_id"] = "stale";
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kAlreadyExists) << c.status();
  EXPECT_EQ(kv_.values_["job/g0/nccl/run-7/nccl_unique_id"], "stale");
  EXPECT_EQ(Fake().init_calls, 0);
}

TEST_F(NcclCollectiveTest, OtherRanksReadOnlyTheirIncarnationsId) {
  // A previous run's id under another incarnation is not read.
  kv_.values_["job/g0/nccl/run-6/nccl_unique_id"] = std::string(NCCL_UNIQUE_ID_BYTES, 'x');
  absl::StatusOr<std::unique_ptr<Collective>> c = Make(/*rank=*/1);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  EXPECT_NE(c.status().message().find("rank 0's unique id"), std::string::npos) << c.status();
  kv_.values_["job/g0/nccl/run-7/nccl_unique_id"] = std::string(NCCL_UNIQUE_ID_BYTES, 'y');
  EXPECT_TRUE(Make(/*rank=*/1).ok());
}

TEST_F(NcclCollectiveTest, InitThatNeverCompletesIsAbortedAtTheDeadline) {
  Fake().init_polls = -1;
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  EXPECT_NE(c.status().message().find("creating the communicator"), std::string::npos)
      << c.status();
  EXPECT_EQ(Fake().aborts, 1);
  EXPECT_EQ(Fake().destroys, 0);
}

TEST_F(NcclCollectiveTest, InitAsyncErrorIsAbortedAndNamesNcclsMessage) {
  Fake().init_final = ncclRemoteError;
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
  EXPECT_NE(c.status().message().find("peer 3 closed the connection"), std::string::npos)
      << c.status();
  EXPECT_EQ(Fake().aborts, 1);
}

TEST_F(NcclCollectiveTest, InitImmediateErrorIsReported) {
  Fake().init_result = ncclInvalidArgument;
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInternal) << c.status();
  EXPECT_NE(c.status().message().find("ncclCommInitRankConfig"), std::string::npos);
  EXPECT_EQ(Fake().aborts, 1);
}

TEST_F(NcclCollectiveTest, NoDeviceIsAPreciseError) {
  Fake().has_device = false;
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(c.status().message().find("cudaErrorNoDevice"), std::string::npos) << c.status();
}

TEST_F(NcclCollectiveTest, ReduceScatterWaitsForTheStreamAndSucceeds) {
  Fake().op_enqueue_polls = 3;  // enqueued in the background first
  Fake().event_polls = 5;
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->ReduceScatterSum(in_, out_, 8, DType::kFloat32, nullptr).ok());
  EXPECT_EQ(Fake().reduce_scatters, 1);
  EXPECT_EQ(Fake().event_records, 1);
  c->reset();
  EXPECT_EQ(Fake().finalizes, 1);
  EXPECT_EQ(Fake().destroys, 1);
  EXPECT_EQ(Fake().aborts, 0);
}

TEST_F(NcclCollectiveTest, ReduceScatterThatNeverCompletesAbortsThenRefusesFurtherCalls) {
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  Fake().event_polls = -1;  // a dead peer: the kernel never finishes
  absl::Status s = (*c)->ReduceScatterSum(in_, out_, 8, DType::kBFloat16, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("reduce-scatter #0 on rank 0 of 2"), std::string::npos) << s;
  EXPECT_EQ(Fake().aborts, 1);
  absl::Status again = (*c)->ReduceScatterSum(in_, out_, 8, DType::kBFloat16, nullptr);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_NE(again.message().find("aborted"), std::string::npos) << again;
  EXPECT_EQ(Fake().reduce_scatters, 1);
  c->reset();
  EXPECT_EQ(Fake().destroys, 0);  // aborted, never destroyed (which could hang)
  EXPECT_EQ(Fake().aborts, 1);
}

TEST_F(NcclCollectiveTest, ReduceScatterAsyncErrorAbortsWithThePeersMessage) {
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  Fake().event_polls = -1;
  Fake().op_async = ncclRemoteError;
  absl::Status s = (*c)->ReduceScatterSum(in_, out_, 8, DType::kFloat32, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("peer 3"), std::string::npos) << s;
  EXPECT_EQ(Fake().aborts, 1);
}

TEST_F(NcclCollectiveTest, ReduceScatterEnqueueErrorAborts) {
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  Fake().rs_result = ncclSystemError;
  absl::Status s = (*c)->ReduceScatterSum(in_, out_, 8, DType::kFloat32, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(Fake().aborts, 1);
}

TEST_F(NcclCollectiveTest, UnderStreamCaptureOnlyTheEnqueueIsAwaited) {
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  Fake().capturing = true;
  Fake().event_polls = -1;
  EXPECT_TRUE((*c)->ReduceScatterSum(in_, out_, 8, DType::kFloat32, nullptr).ok());
  EXPECT_EQ(Fake().event_records, 0);
}

TEST_F(NcclCollectiveTest, DestructorAbortsWhenFinalizeDoesNotComplete) {
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  Fake().finalize_polls = -1;
  c->reset();
  EXPECT_EQ(Fake().finalizes, 1);
  EXPECT_EQ(Fake().destroys, 0);
  EXPECT_EQ(Fake().aborts, 1);
}

TEST_F(NcclCollectiveTest, Fp8IsRefusedBeforeAnyWorkBelowSm90) {
  Fake().cc_major = 8;
  options_.nccl_allow_saturating_fp8 = true;
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  for (DType d : {DType::kFloat8E4M3FN, DType::kFloat8E5M2}) {
    absl::Status s = (*c)->ReduceScatterSum(in_, out_, 8, d, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("sm_80"), std::string::npos) << s;
  }
  EXPECT_EQ(Fake().reduce_scatters, 0);
  EXPECT_TRUE((*c)->CheckWireDType(DType::kBFloat16).ok());
}

TEST_F(NcclCollectiveTest, Fp8OnSm90NeedsTheSaturationOptIn) {
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  absl::Status s = (*c)->ReduceScatterSum(in_, out_, 8, DType::kFloat8E5M2, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("saturates"), std::string::npos) << s;
  EXPECT_EQ(Fake().reduce_scatters, 0);

  testing::ResetFake();
  options_.incarnation = "run-8";
  options_.nccl_allow_saturating_fp8 = true;
  absl::StatusOr<std::unique_ptr<Collective>> opted = Make();
  ASSERT_TRUE(opted.ok()) << opted.status();
  EXPECT_TRUE((*opted)->ReduceScatterSum(in_, out_, 8, DType::kFloat8E5M2, nullptr).ok());
  EXPECT_EQ(Fake().reduce_scatters, 1);
}

TEST_F(NcclCollectiveTest, Fp8IsRefusedWhenTheLoadedNcclIsOlderThan224) {
  Fake().version = 22304;
  options_.nccl_allow_saturating_fp8 = true;
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  absl::Status s = (*c)->CheckWireDType(DType::kFloat8E4M3FN);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("NCCL 2.23.4"), std::string::npos) << s;
}

TEST_F(NcclCollectiveTest, Fp8WireDTypeIsRefusedAtCreateBelowSm90BeforeTheRendezvous) {
  Fake().cc_major = 8;
  options_.nccl_allow_saturating_fp8 = true;
  options_.wire_dtypes = {DType::kBFloat16, DType::kFloat8E4M3FN};
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  const std::string m(c.status().message());
  EXPECT_NE(m.find(std::string(DTypeName(DType::kFloat8E4M3FN))), std::string::npos) << m;
  EXPECT_NE(m.find("sm_80"), std::string::npos) << m;
  EXPECT_NE(m.find("NCCL 2.28.9"), std::string::npos) << m;
  EXPECT_NE(m.find("wire_dtypes"), std::string::npos) << m;
  EXPECT_EQ(Fake().init_calls, 0);
  EXPECT_TRUE(kv_.values_.empty());  // no unique id published
}

TEST_F(NcclCollectiveTest, Fp8WireDTypeIsRefusedAtCreateWhenTheLoadedNcclIsOlderThan224) {
  Fake().version = 22304;
  options_.nccl_allow_saturating_fp8 = true;
  options_.wire_dtypes = {DType::kFloat8E5M2};
  absl::StatusOr<std::unique_ptr<Collective>> c = Make(1);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_NE(c.status().message().find("NCCL 2.23.4"), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("sm_90"), std::string::npos) << c.status();
  EXPECT_EQ(Fake().init_calls, 0);
}

TEST_F(NcclCollectiveTest, Fp8WireDTypeOnSm90IsRefusedAtCreateWithoutTheOptInAndAcceptedWithIt) {
  options_.wire_dtypes = {DType::kFloat8E4M3FN};
  absl::StatusOr<std::unique_ptr<Collective>> refused = Make();
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("saturates"), std::string::npos) << refused.status();
  EXPECT_EQ(Fake().init_calls, 0);

  options_.nccl_allow_saturating_fp8 = true;
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(Fake().init_calls, 1);
  absl::StatusOr<DType> wire = (*c)->WireDTypeFor(DType::kFloat8E4M3FN);
  ASSERT_TRUE(wire.ok()) << wire.status();
  EXPECT_EQ(*wire, DType::kFloat8E4M3FN);
}

TEST_F(NcclCollectiveTest, NonFp8WireDTypesAreAcceptedAtCreateOnAnyDevice) {
  Fake().cc_major = 7;
  Fake().version = 21805;
  options_.wire_dtypes = {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64};
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
}

TEST_F(NcclCollectiveTest, RefusedFp8IsWidenedWhenAskedAndTheWidenedDTypeIsWhatIsReduced) {
  Fake().cc_major = 8;
  options_.nccl_widen_fp8_to = DType::kFloat16;
  options_.wire_dtypes = {DType::kFloat8E4M3FN, DType::kFloat8E5M2};
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  ASSERT_TRUE(c.ok()) << c.status();
  for (DType d : {DType::kFloat8E4M3FN, DType::kFloat8E5M2}) {
    absl::StatusOr<DType> wire = (*c)->WireDTypeFor(d);
    ASSERT_TRUE(wire.ok()) << wire.status();
    EXPECT_EQ(*wire, DType::kFloat16) << DTypeName(d);
    // The decision must carry the widened dtype: fp8 itself is still refused.
    EXPECT_EQ((*c)->ReduceScatterSum(in_, out_, 8, d, nullptr).code(),
              absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(Fake().reduce_scatters, 0);
  EXPECT_TRUE((*c)->ReduceScatterSum(in_, out_, 8, DType::kFloat16, nullptr).ok());
}

TEST_F(NcclCollectiveTest, WideningToFp32IsInvalidAtCreate) {
  Fake().cc_major = 8;
  options_.nccl_widen_fp8_to = DType::kFloat32;
  options_.wire_dtypes = {DType::kFloat8E4M3FN};
  absl::StatusOr<std::unique_ptr<Collective>> c = Make();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_EQ(Fake().init_calls, 0);
}

}  // namespace
}  // namespace accord
