// GroupReducer's checks before any work: the reducer's device matches the
// collective's backend, and the backend's wire-dtype policy is applied before
// packing. A fake collective records what reached it.
#include "client/collective/reducer.h"

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace accord {
namespace {

class FakeCollective : public Collective {
 public:
  explicit FakeCollective(Backend backend) : backend_(backend) {}
  absl::Status ReduceScatterSum(const void* in, void* out, int64_t row_numel, DType wire,
                                void*) override {
    ++calls;
    std::memcpy(out, in, static_cast<size_t>(row_numel) * DTypeSize(wire));
    return absl::OkStatus();
  }
  absl::Status CheckWireDType(DType wire) const override {
    if (refuse_fp8 && (wire == DType::kFloat8E4M3FN || wire == DType::kFloat8E5M2)) {
      return absl::FailedPreconditionError("fake: fp8 refused");
    }
    return absl::OkStatus();
  }
  absl::StatusOr<DType> WireDTypeFor(DType wire) const override {
    if (widen_fp8_to.has_value() && CheckWireDType(wire).code() != absl::StatusCode::kOk) {
      return *widen_fp8_to;
    }
    return Collective::WireDTypeFor(wire);
  }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Backend backend() const override { return backend_; }

  int calls = 0;
  bool refuse_fp8 = false;
  std::optional<DType> widen_fp8_to;

 private:
  const Backend backend_;
};

GroupSpec Spec() { return GroupSpec{"blocks.0", {{"w", 4, 8}, {"b", 4, 4}}}; }

Decision MakeDecision(DType wire) {
  Decision d;
  d.step = 12;
  d.wire_dtype = wire;
  d.included = {true, true};
  d.layout_fingerprint = LayoutFingerprint(Spec(), 1, d.included, wire);
  return d;
}

TEST(GroupReducerTest, CpuReducerWithNcclIsRefusedBeforePacking) {
  FakeCollective nccl(Backend::kNccl);
  GroupReducer reducer(Spec(), nccl, {});
  std::vector<float> w(8, 1.0f), b(4, 2.0f);
  const GradSource sources[] = {{w.data(), DType::kFloat32}, {b.data(), DType::kFloat32}};
  absl::Status s = reducer.Reduce(MakeDecision(DType::kFloat32), sources);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("host memory (Device::kCpu)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("NCCL"), std::string::npos) << s;
  EXPECT_EQ(nccl.calls, 0);
}

TEST(GroupReducerTest, CudaReducerWithGlooIsRefusedBeforePacking) {
  FakeCollective gloo(Backend::kGloo);
  GroupReducer::Options options;
  options.device = GroupReducer::Device::kCuda;
  GroupReducer reducer(Spec(), gloo, options);
  const GradSource sources[] = {{nullptr, DType::kFloat32}, {nullptr, DType::kFloat32}};
  absl::Status s = reducer.Reduce(MakeDecision(DType::kFloat32), sources);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("device memory (Device::kCuda)"), std::string::npos) << s;
  EXPECT_EQ(gloo.calls, 0);
}

TEST(GroupReducerTest, WireDTypeRefusedByTheBackendStopsBeforePacking) {
  FakeCollective gloo(Backend::kGloo);
  gloo.refuse_fp8 = true;
  GroupReducer reducer(Spec(), gloo, {});
  std::vector<float> w(8, 1.0f), b(4, 2.0f);
  const GradSource sources[] = {{w.data(), DType::kFloat32}, {b.data(), DType::kFloat32}};
  absl::Status s = reducer.Reduce(MakeDecision(DType::kFloat8E5M2), sources);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("group \"blocks.0\" step 12"), std::string::npos) << s;
  EXPECT_EQ(gloo.calls, 0);
  // The same reducer goes on with a dtype the backend accepts.
  EXPECT_TRUE(reducer.Reduce(MakeDecision(DType::kFloat32), sources).ok());
  EXPECT_EQ(gloo.calls, 1);
}

TEST(PolicyForCollectiveTest, AnAcceptingBackendKeepsThePolicy) {
  FakeCollective gloo(Backend::kGloo);
  Policy p;
  p.reduce_dtype = DType::kFloat8E4M3FN;
  p.reduce_dtype_exact = true;
  p.empty_group_dtype = DType::kFloat8E5M2;
  absl::StatusOr<Policy> got = PolicyForCollective(p, gloo);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->reduce_dtype, DType::kFloat8E4M3FN);
  EXPECT_EQ(got->empty_group_dtype, DType::kFloat8E5M2);
  EXPECT_TRUE(got->reduce_dtype_exact);
}

TEST(PolicyForCollectiveTest, ARefusedFp8IsAnErrorNamingThePolicyField) {
  FakeCollective nccl(Backend::kNccl);
  nccl.refuse_fp8 = true;
  Policy p;
  p.reduce_dtype = DType::kFloat8E5M2;
  absl::StatusOr<Policy> got = PolicyForCollective(p, nccl);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_NE(got.status().message().find("reduce dtype"), std::string::npos) << got.status();
  p.reduce_dtype.reset();
  p.empty_group_dtype = DType::kFloat8E4M3FN;
  got = PolicyForCollective(p, nccl);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_NE(got.status().message().find("empty-group dtype"), std::string::npos) << got.status();
}

TEST(PolicyForCollectiveTest, AWideningBackendWidensEveryFp8FieldAndNothingElse) {
  FakeCollective nccl(Backend::kNccl);
  nccl.refuse_fp8 = true;
  nccl.widen_fp8_to = DType::kBFloat16;
  Policy p;
  p.reduce_dtype = DType::kFloat8E4M3FN;
  p.reduce_dtype_exact = true;
  p.empty_group_dtype = DType::kFloat8E5M2;
  absl::StatusOr<Policy> got = PolicyForCollective(p, nccl);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->reduce_dtype, DType::kBFloat16);
  EXPECT_EQ(got->empty_group_dtype, DType::kBFloat16);
  EXPECT_TRUE(got->reduce_dtype_exact);
  p.reduce_dtype = DType::kFloat16;
  p.empty_group_dtype = DType::kFloat32;
  got = PolicyForCollective(p, nccl);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->reduce_dtype, DType::kFloat16);
  EXPECT_EQ(got->empty_group_dtype, DType::kFloat32);
}

}  // namespace
}  // namespace accord
