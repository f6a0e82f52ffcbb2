// Bit-exact checks of core/float_convert.h, which the CPU and CUDA pack
// kernels share: every lossless widening the lattice claims round-trips every
// value of the narrower type; every other pair loses at least one value;
// narrowing rounds to nearest even, overflows to inf (NaN for e4m3fn) and
// handles subnormals; and fp32 -> {bf16, fp16, e4m3fn, e5m2} agrees with
// independent references (bit tricks, PyTorch c10's algorithms, F16C and the
// compiler's _Float16).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/float_convert.h"
#include "core/lattice.h"
#include "gtest/gtest.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ACCORD_TEST_HAVE_X86 1
#endif

namespace accord {
namespace {

using fp::BitsDouble;
using fp::BitsFloat;
using fp::DoubleBits;
using fp::FloatBits;

// One dtype as bit patterns <-> double, through float_convert.h only.
struct Codec {
  DType dtype;
  int width;  // bits
  double (*to_double)(uint64_t);
  uint64_t (*from_double)(double);
};

template <typename F>
double SmallToDouble(uint64_t b) {
  return F::ToDouble(static_cast<uint32_t>(b));
}
template <typename F>
uint64_t SmallFromDouble(double d) {
  return F::FromDouble(d);
}
double F32ToDouble(uint64_t b) { return static_cast<double>(BitsFloat(static_cast<uint32_t>(b))); }
uint64_t F32FromDouble(double d) { return FloatBits(fp::FloatFromDouble(d)); }
double F64ToDouble(uint64_t b) { return BitsDouble(b); }
uint64_t F64FromDouble(double d) { return DoubleBits(d); }

const Codec& CodecOf(DType d) {
  static const Codec kCodecs[] = {
      {DType::kFloat8E4M3FN, 8, SmallToDouble<fp::Float8E4M3FN>, SmallFromDouble<fp::Float8E4M3FN>},
      {DType::kFloat8E5M2, 8, SmallToDouble<fp::Float8E5M2>, SmallFromDouble<fp::Float8E5M2>},
      {DType::kFloat16, 16, SmallToDouble<fp::Half>, SmallFromDouble<fp::Half>},
      {DType::kBFloat16, 16, SmallToDouble<fp::BFloat16>, SmallFromDouble<fp::BFloat16>},
      {DType::kFloat32, 32, F32ToDouble, F32FromDouble},
      {DType::kFloat64, 64, F64ToDouble, F64FromDouble},
  };
  return kCodecs[static_cast<int>(d) - 1];
}

bool SameDouble(double a, double b) { return DoubleBits(a) == DoubleBits(b); }

// Bit patterns to try for a dtype: every pattern of the 8- and 16-bit types;
// for fp32/fp64, specials, every exponent with edge mantissas, and a fixed-seed
// random sample.
std::vector<uint64_t> Patterns(const Codec& c, size_t random_count = 1 << 18) {
  std::vector<uint64_t> out;
  if (c.width <= 16) {
    for (uint64_t b = 0; b < (uint64_t{1} << c.width); ++b) out.push_back(b);
    return out;
  }
  const int man_bits = c.width == 32 ? 23 : 52;
  const int exp_bits = c.width == 32 ? 8 : 11;
  const uint64_t man_mask = (uint64_t{1} << man_bits) - 1;
  std::vector<uint64_t> mans = {
      0, 1, 2, 3, man_mask, man_mask - 1, man_mask >> 1, (man_mask >> 1) + 1};
  for (int k = 0; k < man_bits; ++k) {
    mans.push_back(uint64_t{1} << k);
    mans.push_back((uint64_t{1} << k) - 1);
    mans.push_back(((uint64_t{1} << k) + 1) & man_mask);
  }
  for (uint64_t sign = 0; sign < 2; ++sign) {
    for (uint64_t e = 0; e < (uint64_t{1} << exp_bits); ++e) {
      for (uint64_t m : mans) {
        out.push_back((sign << (c.width - 1)) | (e << man_bits) | m);
      }
    }
  }
  std::mt19937_64 rng(0xacc0d5eedull + c.width);
  for (size_t i = 0; i < random_count; ++i) {
    uint64_t r = rng();
    if (c.width == 32) r &= 0xffffffffull;
    out.push_back(r);
  }
  return out;
}

std::string Hex(uint64_t v) { return absl::StrCat("0x", absl::Hex(v)); }

// --- Exact round trips -------------------------------------------------------

TEST(FloatConvertTest, EveryNarrowPatternRoundTripsThroughDoubleBitExact) {
  for (DType d : {DType::kFloat8E4M3FN, DType::kFloat8E5M2, DType::kFloat16, DType::kBFloat16}) {
    const Codec& c = CodecOf(d);
    SCOPED_TRACE(DTypeName(d));
    for (uint64_t b : Patterns(c)) {
      const double x = c.to_double(b);
      const uint64_t back = c.from_double(x);
      if (std::isnan(x)) {
        ASSERT_TRUE(std::isnan(c.to_double(back))) << Hex(b);
        ASSERT_EQ(std::signbit(x), std::signbit(c.to_double(back))) << Hex(b);
      } else {
        ASSERT_EQ(back, b) << Hex(b) << " = " << x;
      }
    }
  }
}

// For `from` ⊑ `to`: every value of `from` converts to `to` and back unchanged
// (NaN stays NaN with its sign, inf stays inf with its sign, -0 stays -0).
void ExpectLosslessEveryValue(DType from, DType to) {
  const Codec& a = CodecOf(from);
  const Codec& b = CodecOf(to);
  SCOPED_TRACE(absl::StrCat(DTypeName(from), " -> ", DTypeName(to)));
  int64_t checked = 0;
  for (uint64_t p : Patterns(a, 1 << 20)) {
    const double x = a.to_double(p);
    const uint64_t q = b.from_double(x);
    const double y = b.to_double(q);
    ++checked;
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(y)) << Hex(p);
      ASSERT_EQ(std::signbit(x), std::signbit(y)) << Hex(p);
      ASSERT_TRUE(std::isnan(a.to_double(a.from_double(y)))) << Hex(p);
      continue;
    }
    // Exact in `to` (bitwise in double, so -0 and the sign of inf count).
    ASSERT_TRUE(SameDouble(x, y)) << Hex(p) << " = " << x << " became " << y;
    // And back to the same pattern.
    ASSERT_EQ(a.from_double(y), p) << Hex(p);
  }
  if (a.width <= 16) {
    EXPECT_EQ(checked, int64_t{1} << a.width);
  }
}

TEST(FloatConvertTest, EveryClaimedLosslessWideningKeepsEveryValue) {
  int pairs = 0;
  for (DType from : kAllDTypes) {
    for (DType to : kAllDTypes) {
      if (from == to || !IsLossless(from, to)) continue;
      ExpectLosslessEveryValue(from, to);
      ++pairs;
    }
  }
  // e4m3 -> fp16, bf16, fp32, fp64; e5m2 -> same 4; fp16 -> fp32, fp64;
  // bf16 -> fp32, fp64; fp32 -> fp64.
  EXPECT_EQ(pairs, 13);
}

TEST(FloatConvertTest, Fp32ToFp64KeepsSpecials) {
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::lowest(),
                            std::numeric_limits<float>::min(),
                            std::numeric_limits<float>::denorm_min(),
                            -std::numeric_limits<float>::denorm_min()};
  for (float f : specials) {
    const double d = f;
    EXPECT_EQ(FloatBits(fp::FloatFromDouble(d)), FloatBits(f)) << f;
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(fp::FloatFromDouble(nan)));
  EXPECT_TRUE(std::signbit(fp::FloatFromDouble(-nan)));
}

// A value of `from` that does not survive `from` -> `to` -> double.
std::optional<uint64_t> FindLossWitness(DType from, DType to) {
  const Codec& a = CodecOf(from);
  const Codec& b = CodecOf(to);
  for (uint64_t p : Patterns(a)) {
    const double x = a.to_double(p);
    if (std::isnan(x)) continue;
    if (!SameDouble(b.to_double(b.from_double(x)), x)) return p;
  }
  return std::nullopt;
}

TEST(FloatConvertTest, EveryNonLosslessPairLosesSomeValue) {
  int pairs = 0;
  for (DType from : kAllDTypes) {
    for (DType to : kAllDTypes) {
      if (IsLossless(from, to)) continue;
      ++pairs;
      std::optional<uint64_t> w = FindLossWitness(from, to);
      ASSERT_TRUE(w.has_value()) << DTypeName(from) << " -> " << DTypeName(to)
                                 << " is not claimed lossless but no value was lost";
    }
  }
  EXPECT_EQ(pairs, 36 - 6 - 13);
}

// The lattice is exactly the empirical relation for sources we can enumerate.
TEST(FloatConvertTest, IsLosslessMatchesExhaustiveCheckForNarrowSources) {
  for (DType from : {DType::kFloat8E4M3FN, DType::kFloat8E5M2, DType::kFloat16, DType::kBFloat16}) {
    for (DType to : kAllDTypes) {
      const bool empirical = !FindLossWitness(from, to).has_value();
      EXPECT_EQ(IsLossless(from, to), empirical) << DTypeName(from) << " -> " << DTypeName(to);
    }
  }
}

// --- Known constants ---------------------------------------------------------

TEST(FloatConvertTest, FormatConstants) {
  using E4 = fp::Float8E4M3FN;
  using E5 = fp::Float8E5M2;
  EXPECT_EQ(E4::ToDouble(0x7e), 448.0);
  EXPECT_EQ(E4::ToDouble(0xfe), -448.0);
  EXPECT_TRUE(std::isnan(E4::ToDouble(0x7f)));
  EXPECT_TRUE(std::isnan(E4::ToDouble(0xff)));
  EXPECT_EQ(E4::ToDouble(0x78), 256.0);  // exponent all ones is finite in e4m3fn
  EXPECT_EQ(E4::ToDouble(0x01), std::ldexp(1.0, -9));
  EXPECT_EQ(E4::ToDouble(0x08), std::ldexp(1.0, -6));
  EXPECT_EQ(E4::ToDouble(0x38), 1.0);
  EXPECT_EQ(E5::ToDouble(0x7b), 57344.0);
  EXPECT_TRUE(std::isinf(E5::ToDouble(0x7c)));
  EXPECT_TRUE(std::isnan(E5::ToDouble(0x7d)));
  EXPECT_EQ(E5::ToDouble(0x01), std::ldexp(1.0, -16));
  EXPECT_EQ(E5::ToDouble(0x3c), 1.0);
  EXPECT_EQ(fp::Half::ToDouble(0x7bff), 65504.0);
  EXPECT_EQ(fp::Half::ToDouble(0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(fp::Half::ToDouble(0x3c00), 1.0);
  EXPECT_EQ(fp::BFloat16::ToDouble(0x7f7f), static_cast<double>(BitsFloat(0x7f7f0000u)));
  EXPECT_EQ(fp::BFloat16::ToDouble(0x0001), std::ldexp(1.0, -133));
  EXPECT_EQ(fp::BFloat16::ToDouble(0x3f80), 1.0);
  EXPECT_TRUE(std::signbit(fp::Half::ToDouble(0x8000)));
  EXPECT_EQ(fp::Half::ToDouble(0x8000), 0.0);
}

// Independent decode: sign * 2^(e - bias) * (1 + m / 2^M), or subnormal.
double ReferenceDecode(uint32_t b, int E, int M, bool has_inf) {
  const int bias = (1 << (E - 1)) - 1;
  const bool neg = (b >> (E + M)) & 1;
  const int e = static_cast<int>((b >> M) & ((1u << E) - 1));
  const int m = static_cast<int>(b & ((1u << M) - 1));
  double v;
  if (has_inf && e == (1 << E) - 1) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (!has_inf && e == (1 << E) - 1 && m == (1 << M) - 1) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - bias - M);
  } else {
    v = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -M), e - bias);
  }
  return neg ? -v : v;
}

TEST(FloatConvertTest, DecodeMatchesLdexpReferenceForEveryPattern) {
  struct Fmt {
    DType d;
    int E, M;
    bool inf;
  };
  for (const Fmt& f : {Fmt{DType::kFloat8E4M3FN, 4, 3, false}, Fmt{DType::kFloat8E5M2, 5, 2, true},
                       Fmt{DType::kFloat16, 5, 10, true}, Fmt{DType::kBFloat16, 8, 7, true}}) {
    const Codec& c = CodecOf(f.d);
    for (uint64_t b : Patterns(c)) {
      const double got = c.to_double(b);
      const double want = ReferenceDecode(static_cast<uint32_t>(b), f.E, f.M, f.inf);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << DTypeName(f.d) << " " << Hex(b);
        ASSERT_EQ(std::signbit(got), std::signbit(want)) << DTypeName(f.d) << " " << Hex(b);
      } else {
        ASSERT_TRUE(SameDouble(got, want)) << DTypeName(f.d) << " " << Hex(b) << " " << got;
      }
    }
  }
}

// --- Rounding ----------------------------------------------------------------

// For every pair of adjacent finite values a < b of the format: the midpoint
// goes to the one with the even pattern, anything strictly inside goes to the
// nearer one. Both signs.
TEST(FloatConvertTest, NarrowingRoundsToNearestEvenAtEveryMidpoint) {
  for (DType d : {DType::kFloat8E4M3FN, DType::kFloat8E5M2, DType::kFloat16, DType::kBFloat16}) {
    const Codec& c = CodecOf(d);
    SCOPED_TRACE(DTypeName(d));
    const uint64_t sign = uint64_t{1} << (c.width - 1);
    int midpoints = 0;
    for (uint64_t p = 0; p + 1 < sign; ++p) {
      const double a = c.to_double(p);
      const double b = c.to_double(p + 1);
      if (!std::isfinite(a) || !std::isfinite(b)) continue;
      ASSERT_LT(a, b) << Hex(p);
      const double m = (a + b) / 2;  // exact: both have few significant bits
      ASSERT_EQ(m - a, b - m);
      const uint64_t even = (p & 1) == 0 ? p : p + 1;
      ASSERT_EQ(c.from_double(m), even) << "midpoint of " << Hex(p) << " and " << Hex(p + 1);
      ASSERT_EQ(c.from_double(std::nextafter(m, a)), p) << Hex(p);
      ASSERT_EQ(c.from_double(std::nextafter(m, b)), p + 1) << Hex(p);
      ASSERT_EQ(c.from_double(-m), sign | even) << Hex(p);
      ASSERT_EQ(c.from_double(-std::nextafter(m, a)), sign | p) << Hex(p);
      ASSERT_EQ(c.from_double(-std::nextafter(m, b)), sign | (p + 1)) << Hex(p);
      ++midpoints;
    }
    EXPECT_GT(midpoints, 100);
  }
}

TEST(FloatConvertTest, ExplicitHalfwayCases) {
  // fp16: 1 + 2^-11 is halfway between 1 (0x3c00, even) and 1 + 2^-10.
  EXPECT_EQ(fp::Half::FromDouble(1.0 + std::ldexp(1.0, -11)), 0x3c00u);
  // 1 + 3 * 2^-11 is halfway between 0x3c01 (odd) and 0x3c02 (even).
  EXPECT_EQ(fp::Half::FromDouble(1.0 + 3 * std::ldexp(1.0, -11)), 0x3c02u);
  EXPECT_EQ(fp::Half::FromDouble(1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40)), 0x3c01u);
  // bf16: 1 + 2^-8 halfway between 0x3f80 and 0x3f81 -> 0x3f80.
  EXPECT_EQ(fp::BFloat16::FromDouble(1.0 + std::ldexp(1.0, -8)), 0x3f80u);
  EXPECT_EQ(fp::BFloat16::FromDouble(1.0 + 3 * std::ldexp(1.0, -8)), 0x3f82u);
  // e4m3fn: 1.0625 halfway between 1.0 (0x38) and 1.125 (0x39) -> 0x38.
  EXPECT_EQ(fp::Float8E4M3FN::FromDouble(1.0625), 0x38u);
  EXPECT_EQ(fp::Float8E4M3FN::FromDouble(1.1875), 0x3au);
  // e5m2: 1.125 halfway between 1.0 (0x3c) and 1.25 (0x3d) -> 0x3c.
  EXPECT_EQ(fp::Float8E5M2::FromDouble(1.125), 0x3cu);
  EXPECT_EQ(fp::Float8E5M2::FromDouble(1.375), 0x3eu);
  // fp32 (the C++ cast): 1 + 2^-24 -> 1; 1 + 3 * 2^-24 -> 1 + 2^-22.
  EXPECT_EQ(fp::FloatFromDouble(1.0 + std::ldexp(1.0, -24)), 1.0f);
  EXPECT_EQ(fp::FloatFromDouble(1.0 + 3 * std::ldexp(1.0, -24)),
            static_cast<float>(1.0 + std::ldexp(1.0, -22)));
  // Rounding up carries into the exponent: largest value below 2 rounds to 2.
  EXPECT_EQ(fp::Half::FromDouble(2.0 - std::ldexp(1.0, -12)), 0x4000u);
  // Rounding up from the largest subnormal gives the smallest normal.
  EXPECT_EQ(fp::Half::FromDouble(std::ldexp(1.0, -14) - std::ldexp(1.0, -26)), 0x0400u);
  EXPECT_EQ(fp::Float8E4M3FN::FromDouble(std::ldexp(1.0, -6) - std::ldexp(1.0, -11)), 0x08u);
}

TEST(FloatConvertTest, OverflowGoesToInfOrNanForE4M3FN) {
  const double inf = std::numeric_limits<double>::infinity();
  const double big = std::numeric_limits<double>::max();
  struct Case {
    DType d;
    double max, ulp;
    uint64_t max_bits, inf_bits;
  };
  for (const Case& k : {Case{DType::kFloat8E5M2, 57344.0, 8192.0, 0x7b, 0x7c},
                        Case{DType::kFloat16, 65504.0, 32.0, 0x7bff, 0x7c00},
                        Case{DType::kBFloat16, static_cast<double>(BitsFloat(0x7f7f0000u)),
                             std::ldexp(1.0, 127 - 7), 0x7f7f, 0x7f80}}) {
    const Codec& c = CodecOf(k.d);
    const uint64_t sign = uint64_t{1} << (c.width - 1);
    SCOPED_TRACE(DTypeName(k.d));
    EXPECT_EQ(c.from_double(k.max), k.max_bits);
    EXPECT_EQ(c.from_double(std::nextafter(k.max + k.ulp / 2, 0.0)), k.max_bits);
    EXPECT_EQ(c.from_double(k.max + k.ulp / 2), k.inf_bits);  // tie goes to "even" inf
    EXPECT_EQ(c.from_double(k.max + k.ulp), k.inf_bits);
    EXPECT_EQ(c.from_double(big), k.inf_bits);
    EXPECT_EQ(c.from_double(-big), sign | k.inf_bits);
    EXPECT_EQ(c.from_double(inf), k.inf_bits);
    EXPECT_EQ(c.from_double(-inf), sign | k.inf_bits);
  }
  using E4 = fp::Float8E4M3FN;
  EXPECT_EQ(E4::FromDouble(448.0), 0x7eu);
  EXPECT_EQ(E4::FromDouble(464.0), 0x7eu);  // halfway to 480 (not a value): to even 448
  EXPECT_EQ(E4::FromDouble(std::nextafter(464.0, 0.0)), 0x7eu);
  EXPECT_EQ(E4::FromDouble(std::nextafter(464.0, inf)), 0x7fu);  // NaN
  EXPECT_EQ(E4::FromDouble(480.0), 0x7fu);
  EXPECT_EQ(E4::FromDouble(1e6), 0x7fu);
  EXPECT_EQ(E4::FromDouble(-1e6), 0xffu);
  EXPECT_EQ(E4::FromDouble(big), 0x7fu);
  EXPECT_EQ(E4::FromDouble(inf), 0x7fu);
  EXPECT_EQ(E4::FromDouble(-inf), 0xffu);
  EXPECT_EQ(E4::FromDouble(-464.0), 0xfeu);
  EXPECT_EQ(fp::FloatFromDouble(big), std::numeric_limits<float>::infinity());
}

TEST(FloatConvertTest, NanStaysNanWithSign) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double snan = BitsDouble(0x7ff0000000000001ull);
  for (DType d : {DType::kFloat8E4M3FN, DType::kFloat8E5M2, DType::kFloat16, DType::kBFloat16}) {
    const Codec& c = CodecOf(d);
    for (double x : {nan, -nan, snan, -snan}) {
      const double y = c.to_double(c.from_double(x));
      EXPECT_TRUE(std::isnan(y)) << DTypeName(d);
      EXPECT_EQ(std::signbit(y), std::signbit(x)) << DTypeName(d);
    }
  }
}

TEST(FloatConvertTest, SubnormalsAndZeros) {
  for (DType d : {DType::kFloat8E4M3FN, DType::kFloat8E5M2, DType::kFloat16, DType::kBFloat16}) {
    const Codec& c = CodecOf(d);
    const uint64_t sign = uint64_t{1} << (c.width - 1);
    SCOPED_TRACE(DTypeName(d));
    const double s = c.to_double(1);  // smallest subnormal
    EXPECT_GT(s, 0.0);
    EXPECT_EQ(c.from_double(s), 1u);
    EXPECT_EQ(c.from_double(s / 2), 0u);  // tie to even zero
    EXPECT_EQ(c.from_double(-s / 2), sign);
    EXPECT_EQ(c.from_double(std::nextafter(s / 2, 1.0)), 1u);
    EXPECT_EQ(c.from_double(s * 1.5), 2u);  // tie between 1 and 2 -> 2
    EXPECT_EQ(c.from_double(s / 4), 0u);
    EXPECT_EQ(c.from_double(0.0), 0u);
    EXPECT_EQ(c.from_double(-0.0), sign);
    EXPECT_EQ(c.from_double(std::numeric_limits<double>::denorm_min()), 0u);
    EXPECT_EQ(c.from_double(-std::numeric_limits<double>::denorm_min()), sign);
    EXPECT_EQ(c.from_double(std::numeric_limits<double>::min()), 0u);
    EXPECT_EQ(c.from_double(1e-300), 0u);
  }
  EXPECT_EQ(FloatBits(fp::FloatFromDouble(-0.0)), 0x80000000u);
}

// --- Independent references for fp32 -> narrow -----------------------------

// bf16 round-to-nearest-even by the well-known integer trick.
uint32_t RefBf16FromFloat(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// PyTorch c10::detail::fp8e4m3fn_from_fp32_value.
uint32_t RefE4M3FNFromFloat(float f) {
  constexpr uint32_t kFp8Max = UINT32_C(1087) << 20;  // 480.0f
  constexpr uint32_t kDenormMask = UINT32_C(141) << 23;
  uint32_t f_bits = FloatBits(f);
  const uint32_t sign = f_bits & 0x80000000u;
  f_bits ^= sign;
  uint32_t result;
  if (f_bits >= kFp8Max) {
    result = 0x7f;
  } else if (f_bits < (UINT32_C(121) << 23)) {
    const float g = BitsFloat(f_bits) + BitsFloat(kDenormMask);
    result = (FloatBits(g) - kDenormMask) & 0xff;
  } else {
    const uint32_t mant_odd = (f_bits >> 20) & 1;
    f_bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffff;
    f_bits += mant_odd;
    result = (f_bits >> 20) & 0xff;
  }
  return result | (sign >> 24);
}

// PyTorch c10::detail::fp8e5m2_from_fp32_value.
uint32_t RefE5M2FromFloat(float f) {
  constexpr uint32_t kFp32Inf = UINT32_C(255) << 23;
  constexpr uint32_t kFp8Max = UINT32_C(143) << 23;  // 65536.0f
  constexpr uint32_t kDenormMask = UINT32_C(134) << 23;
  uint32_t f_bits = FloatBits(f);
  const uint32_t sign = f_bits & 0x80000000u;
  f_bits ^= sign;
  uint32_t result;
  if (f_bits >= kFp8Max) {
    result = f_bits > kFp32Inf ? 0x7f : 0x7c;
  } else if (f_bits < (UINT32_C(113) << 23)) {
    const float g = BitsFloat(f_bits) + BitsFloat(kDenormMask);
    result = (FloatBits(g) - kDenormMask) & 0xff;
  } else {
    const uint32_t mant_odd = (f_bits >> 21) & 1;
    f_bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffff;
    f_bits += mant_odd;
    result = (f_bits >> 21) & 0xff;
  }
  return result | (sign >> 24);
}

#if defined(__FLT16_MAX__)
// The compiler's _Float16 (libgcc's soft-float conversion on x86-64).
uint32_t RefHalfFromFloatCompiler(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, sizeof u);
  return u;
}
#endif

#if defined(ACCORD_TEST_HAVE_X86)
__attribute__((target("f16c"))) uint32_t RefHalfFromFloatF16C(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float RefFloatFromHalfF16C(uint16_t h) { return _cvtsh_ss(h); }
bool HaveF16C() { return __builtin_cpu_supports("f16c"); }
#endif

// Floats that exercise every rounding position of every narrow format: all
// exponents with single-bit and edge mantissas (Patterns), plus every bf16
// pattern with tie-relevant low halves, plus a fixed-seed random sample.
std::vector<uint32_t> RoundingProbeFloats() {
  std::vector<uint32_t> out;
  for (uint64_t p : Patterns(CodecOf(DType::kFloat32), 1 << 21)) {
    out.push_back(static_cast<uint32_t>(p));
  }
  const uint32_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000,
                           0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000, 0x3000};
  for (uint32_t hi = 0; hi < 0x10000; ++hi) {
    for (uint32_t lo : lows) out.push_back((hi << 16) | lo);
  }
  return out;
}

// Compares one converter with a reference over the probe floats; NaN results
// only need to be NaN of the same sign (payloads differ between libraries).
template <typename Got, typename Ref>
void ExpectMatchesReference(DType d, Got got_fn, Ref ref_fn, absl::string_view ref_name) {
  const Codec& c = CodecOf(d);
  SCOPED_TRACE(absl::StrCat(DTypeName(d), " vs ", ref_name));
  int64_t mismatches = 0;
  for (uint32_t u : RoundingProbeFloats()) {
    const float f = BitsFloat(u);
    const uint64_t got = got_fn(f);
    const uint64_t want = ref_fn(f);
    if (std::isnan(c.to_double(want))) {
      if (!std::isnan(c.to_double(got)) ||
          std::signbit(c.to_double(got)) != std::signbit(c.to_double(want))) {
        ++mismatches;
      }
    } else if (got != want) {
      ++mismatches;
    }
    if (mismatches > 0) {
      ADD_FAILURE() << "float " << Hex(u) << " (" << f << "): got " << Hex(got) << ", reference "
                    << Hex(want);
      return;
    }
  }
}

TEST(FloatConvertReferenceTest, Bf16FromFloatMatchesIntegerTrick) {
  ExpectMatchesReference(
      DType::kBFloat16, [](float f) { return fp::BFloat16::FromDouble(f); }, RefBf16FromFloat,
      "add-0x7fff+lsb");
}

TEST(FloatConvertReferenceTest, E4M3FNFromFloatMatchesPyTorch) {
  ExpectMatchesReference(
      DType::kFloat8E4M3FN, [](float f) { return fp::Float8E4M3FN::FromDouble(f); },
      RefE4M3FNFromFloat, "c10 fp8e4m3fn_from_fp32_value");
}

TEST(FloatConvertReferenceTest, E5M2FromFloatMatchesPyTorch) {
  ExpectMatchesReference(
      DType::kFloat8E5M2, [](float f) { return fp::Float8E5M2::FromDouble(f); }, RefE5M2FromFloat,
      "c10 fp8e5m2_from_fp32_value");
}

#if defined(__FLT16_MAX__)
TEST(FloatConvertReferenceTest, HalfFromFloatMatchesCompilerFloat16) {
  ExpectMatchesReference(
      DType::kFloat16, [](float f) { return fp::Half::FromDouble(f); }, RefHalfFromFloatCompiler,
      "_Float16");
}
#endif

#if defined(ACCORD_TEST_HAVE_X86)
TEST(FloatConvertReferenceTest, HalfFromFloatMatchesF16C) {
  if (!HaveF16C()) GTEST_SKIP() << "CPU has no F16C";
  ExpectMatchesReference(
      DType::kFloat16, [](float f) { return fp::Half::FromDouble(f); }, RefHalfFromFloatF16C,
      "F16C vcvtps2ph");
}

TEST(FloatConvertReferenceTest, HalfToFloatMatchesF16CForEveryPattern) {
  if (!HaveF16C()) GTEST_SKIP() << "CPU has no F16C";
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const double got = fp::Half::ToDouble(h);
    const float want = RefFloatFromHalfF16C(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << Hex(h);
    } else {
      ASSERT_TRUE(SameDouble(got, static_cast<double>(want))) << Hex(h);
    }
  }
}
#endif

TEST(FloatConvertReferenceTest, Bf16ToFloatIsShiftForEveryPattern) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const double got = fp::BFloat16::ToDouble(b);
    const float want = BitsFloat(b << 16);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << Hex(b);
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << Hex(b);
    } else {
      ASSERT_TRUE(SameDouble(got, static_cast<double>(want))) << Hex(b);
    }
  }
}

// e5m2 is the top byte of an fp16.
TEST(FloatConvertReferenceTest, E5M2IsTopByteOfHalf) {
  for (uint32_t b = 0; b < 0x100; ++b) {
    const double got = fp::Float8E5M2::ToDouble(b);
    const double want = fp::Half::ToDouble(b << 8);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << Hex(b);
    } else {
      ASSERT_TRUE(SameDouble(got, want)) << Hex(b);
    }
  }
}

// Narrowing from a double that is not exactly a float must round once, from
// the double (not double -> float -> narrow, which could round twice).
TEST(FloatConvertTest, NarrowingFromDoubleRoundsOnce) {
  // Just above the fp16 midpoint 1 + 2^-11 by less than a float ulp: the float
  // path would land on the midpoint and round down to 1.0.
  const double x = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -30);
  EXPECT_EQ(static_cast<double>(static_cast<float>(x)), 1.0 + std::ldexp(1.0, -11));
  EXPECT_EQ(fp::Half::FromDouble(x), 0x3c01u);
  const double y = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);
  EXPECT_EQ(fp::BFloat16::FromDouble(y), 0x3f81u);
}

}  // namespace
}  // namespace accord
