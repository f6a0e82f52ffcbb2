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

}  // namespace
}  // namespace accord
