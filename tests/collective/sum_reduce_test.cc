// SumInto rounds the exact sum once to the wire dtype.
#include "client/collective/sum_reduce.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/element_convert.h"

namespace accord {
namespace {

template <DType D>
void CheckRandomPairs() {
  using T = kernels::StorageT<D>;
  std::mt19937_64 rng(static_cast<int>(D));
  const size_t n = 100000;
  std::vector<T> a(n), b(n), out(n);
  for (size_t i = 0; i < n; ++i) {
    // Random finite values of the dtype (via double, so NaN bit patterns
    // don't make the comparison meaningless).
    const double x = std::ldexp(static_cast<double>(rng() % 2001) - 1000.0, int(rng() % 16) - 12);
    const double y = std::ldexp(static_cast<double>(rng() % 2001) - 1000.0, int(rng() % 16) - 12);
    a[i] = kernels::FromDouble<D>(x);
    b[i] = kernels::FromDouble<D>(y);
  }
  SumInto(D, out.data(), a.data(), b.data(), n);
  for (size_t i = 0; i < n; ++i) {
    const T want = kernels::FromDouble<D>(kernels::ToDouble<D>(a[i]) + kernels::ToDouble<D>(b[i]));
    ASSERT_EQ(std::memcmp(&out[i], &want, sizeof(T)), 0)
        << DTypeName(D) << " " << kernels::ToDouble<D>(a[i]) << " + " << kernels::ToDouble<D>(b[i]);
  }
  // In place.
  SumInto(D, a.data(), a.data(), b.data(), n);
  EXPECT_EQ(std::memcmp(a.data(), out.data(), n * sizeof(T)), 0);
}

TEST(SumIntoTest, EveryWireDTypeRoundsTheExactSumOnce) {
  CheckRandomPairs<DType::kFloat8E4M3FN>();
  CheckRandomPairs<DType::kFloat8E5M2>();
  CheckRandomPairs<DType::kFloat16>();
  CheckRandomPairs<DType::kBFloat16>();
  CheckRandomPairs<DType::kFloat32>();
  CheckRandomPairs<DType::kFloat64>();
}

// accord's fp8 sum (docs/GPU.md, "fp8"): an overflow or an inf is never
// turned into a finite value, so a loss scaler sees it. (NCCL saturates
// instead, which is why the NCCL backend refuses fp8 unless told otherwise.)
uint8_t SumFp8(DType d, uint8_t a, uint8_t b) {
  uint8_t out = 0;
  SumInto(d, &out, &a, &b, 1);
  return out;
}

TEST(SumIntoFp8SemanticsTest, E5M2InfStaysInf) {
  constexpr uint8_t kInf = 0x7c, kNegInf = 0xfc, kOne = 0x3c, kMax = 0x7b;  // max = 57344
  EXPECT_EQ(kernels::ToDouble<DType::kFloat8E5M2>(kMax), 57344.0);
  EXPECT_EQ(SumFp8(DType::kFloat8E5M2, kInf, kOne), kInf);
  EXPECT_EQ(SumFp8(DType::kFloat8E5M2, kNegInf, kMax), kNegInf);
  EXPECT_EQ(SumFp8(DType::kFloat8E5M2, kInf, kInf), kInf);
}

TEST(SumIntoFp8SemanticsTest, E5M2OverflowIsInfNotSaturation) {
  constexpr uint8_t kMax = 0x7b, kNegMax = 0xfb;
  EXPECT_EQ(SumFp8(DType::kFloat8E5M2, kMax, kMax), 0x7c);        // +inf, not 57344
  EXPECT_EQ(SumFp8(DType::kFloat8E5M2, kNegMax, kNegMax), 0xfc);  // -inf
  EXPECT_EQ(SumFp8(DType::kFloat8E5M2, kMax, kNegMax), 0x00);     // exact zero
}

TEST(SumIntoFp8SemanticsTest, E5M2InfMinusInfIsNaN) {
  const uint8_t s = SumFp8(DType::kFloat8E5M2, 0x7c, 0xfc);
  EXPECT_TRUE(std::isnan(kernels::ToDouble<DType::kFloat8E5M2>(s))) << int(s);
}

TEST(SumIntoFp8SemanticsTest, E4M3FNOverflowIsNaNNotSaturation) {
  constexpr uint8_t kMax = 0x7e, kNegMax = 0xfe;  // +-448; e4m3fn has no inf
  EXPECT_EQ(kernels::ToDouble<DType::kFloat8E4M3FN>(kMax), 448.0);
  EXPECT_TRUE(std::isnan(
      kernels::ToDouble<DType::kFloat8E4M3FN>(SumFp8(DType::kFloat8E4M3FN, kMax, kMax))));
  EXPECT_TRUE(std::isnan(
      kernels::ToDouble<DType::kFloat8E4M3FN>(SumFp8(DType::kFloat8E4M3FN, kNegMax, kNegMax))));
  // In range: exact.
  EXPECT_EQ(kernels::ToDouble<DType::kFloat8E4M3FN>(SumFp8(DType::kFloat8E4M3FN, kMax, kNegMax)),
            0.0);
}

TEST(SumIntoFp8SemanticsTest, NaNPropagates) {
  EXPECT_TRUE(std::isnan(kernels::ToDouble<DType::kFloat8E4M3FN>(
      SumFp8(DType::kFloat8E4M3FN, 0x7f, 0x38))));  // NaN + 1
  EXPECT_TRUE(std::isnan(
      kernels::ToDouble<DType::kFloat8E5M2>(SumFp8(DType::kFloat8E5M2, 0x7e, 0x3c))));  // NaN + 1
}

}  // namespace
}  // namespace accord
