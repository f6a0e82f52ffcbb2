#include "demo/model.h"

#include "core/float_convert.h"
#include "gtest/gtest.h"

namespace accord::demo {
namespace {

size_t GroupIndex(const DemoModel& m, const std::string& id) {
  for (size_t g = 0; g < m.groups().size(); ++g) {
    if (m.groups()[g].spec.group_id == id) return g;
  }
  ADD_FAILURE() << "no group " << id;
  return 0;
}

double ElementAsDouble(const LocalGrad& grad, int64_t i) {
  switch (*grad.dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, grad.bytes.data() + 4 * i, 4);
      return f;
    }
    case DType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, grad.bytes.data() + 2 * i, 2);
      return fp::BFloat16::ToDouble(b);
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, grad.bytes.data() + 2 * i, 2);
      return fp::Half::ToDouble(h);
    }
    default:
      ADD_FAILURE() << "unexpected dtype";
      return 0;
  }
}

TEST(DemoModel, ReferenceSumEqualsTheSumOfEveryRanksGradient) {
  const DemoModel m(8, 7);
  for (size_t g = 0; g < m.groups().size(); ++g) {
    for (size_t p = 0; p < m.groups()[g].spec.params.size(); ++p) {
      const auto w = m.InitialWeights(g, p);
      std::vector<double> abs_sum;
      const auto ref = m.ReferenceSum(g, p, 3, w, &abs_sum);
      std::vector<double> sum(ref.size(), 0.0);
      for (int r = 0; r < 8; ++r) {
        const LocalGrad grad = m.Gradient(g, p, r, 3, w);
        if (!grad.dtype) continue;
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += ElementAsDouble(grad, i);
      }
      for (size_t i = 0; i < sum.size(); ++i) {
        ASSERT_EQ(sum[i], ref[i]) << m.groups()[g].spec.params[p].name << "[" << i << "]";
        ASSERT_GE(abs_sum[i], std::abs(ref[i]));
      }
    }
  }
}

TEST(DemoModel, HasThePatternsThatBreakJobs) {
  const DemoModel m(8, 7);
  const size_t head = GroupIndex(m, "head");
  const size_t vision = GroupIndex(m, "vision");
  const size_t moe = GroupIndex(m, "moe");
  bool vision_partly_used = false;
  bool expert_skipped_somewhere = false;
  for (int64_t step = 0; step < 20; ++step) {
    int vision_users = 0;
    for (int r = 0; r < 8; ++r) {
      EXPECT_EQ(m.FirstMicrobatch(head, 2, r, step), -1) << "unused_adapter is never used";
      EXPECT_EQ(m.FirstMicrobatch(head, 1, r, step), 1) << "late_bias: synced microbatch only";
      const LocalGrad late = m.Gradient(head, 1, r, step, m.InitialWeights(head, 1));
      EXPECT_EQ(late.dtype, DType::kBFloat16);
      const LocalGrad w = m.Gradient(head, 0, r, step, m.InitialWeights(head, 0));
      EXPECT_EQ(w.dtype, DType::kFloat32);
      vision_users += m.FirstMicrobatch(vision, 0, r, step) >= 0 ? 1 : 0;
      if (m.FirstMicrobatch(moe, 1, r, step) < 0) expert_skipped_somewhere = true;
    }
    if (step % 5 == 4) {
      EXPECT_EQ(vision_users, 0) << "text-only step " << step;
    }
    if (vision_users > 0 && vision_users < 8) vision_partly_used = true;
    // Expert 7 (params 15, 16): rank 0 on even steps only.
    for (int r = 0; r < 8; ++r) {
      EXPECT_EQ(m.FirstMicrobatch(moe, 15, r, step) >= 0, r == 0 && step % 2 == 0);
    }
  }
  EXPECT_TRUE(vision_partly_used);
  EXPECT_TRUE(expert_skipped_somewhere);
}

TEST(DemoModel, SgdOnTheMeanGradientLowersTheLoss) {
  const DemoModel m(4, 1);
  auto w = m.InitialWeights(0, 0);
  const double before = m.Loss(0, 0, w);
  for (int64_t step = 0; step < 5; ++step) {
    std::vector<double> abs_sum;
    const auto sum = m.ReferenceSum(0, 0, step, w, &abs_sum);
    for (size_t i = 0; i < w.size(); ++i) w[i] -= static_cast<float>(0.5 * sum[i] / 4);
  }
  EXPECT_LT(m.Loss(0, 0, w), before * 0.1);
}

}  // namespace
}  // namespace accord::demo
