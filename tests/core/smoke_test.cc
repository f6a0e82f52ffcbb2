#include "core/decide.h"
#include "gtest/gtest.h"
namespace accord {
TEST(Smoke, Fp16JoinBf16IsFp32) { EXPECT_EQ(Join({DType::kFloat16, DType::kBFloat16}), DType::kFloat32); }
}
