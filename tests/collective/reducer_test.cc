// GroupReducer's checks before any work: the reducer's device matches the
// collective's backend, and the backend's wire-dtype policy is applied before
// packing. A fake collective records what reached it.
#include "client/collective/reducer.h"

#include <cstring>
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
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Backend backend() const override { return backend_; }

  int calls = 0;
  bool refuse_fp8 = false;

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

}  // namespace
}  // namespace accord
