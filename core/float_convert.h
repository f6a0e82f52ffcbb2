// Scalar conversions between accord's dtypes, bit for bit the same on the host
// and on a CUDA device. Widening is exact; narrowing rounds to nearest even,
// keeps NaN as NaN and inf as inf (float8_e4m3fn has no inf: inf and values
// past its range become NaN, as PyTorch's float8_e4m3fn conversion does).
//
// Every conversion goes through double: each accord dtype widens to double
// exactly, and the narrowing step rounds once, so there is no double rounding.
#ifndef ACCORD_CORE_FLOAT_CONVERT_H_
#define ACCORD_CORE_FLOAT_CONVERT_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ACCORD_HD __host__ __device__ __forceinline__
#else
#define ACCORD_HD inline
#endif

namespace accord::fp {

ACCORD_HD uint64_t DoubleBits(double d) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
#endif
}
ACCORD_HD double BitsDouble(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
#endif
}
ACCORD_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__float_as_uint(f));
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
ACCORD_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// A small IEEE-like binary format: `E` exponent bits, `M` mantissa bits, with
// or without inf. Formats without inf (e4m3fn) use all-ones exponent and
// mantissa as NaN and give the rest of the top binade to finite values.
template <int E, int M, bool kHasInf>
struct SmallFloat {
  static constexpr int kBias = (1 << (E - 1)) - 1;
  static constexpr uint32_t kExpMask = (1u << E) - 1;
  static constexpr uint32_t kManMask = (1u << M) - 1;
  static constexpr uint32_t kSignBit = 1u << (E + M);

  // Exact: every value of the format is a double.
  ACCORD_HD static double ToDouble(uint32_t bits) {
    const uint32_t sign = bits & kSignBit;
    const uint32_t exp = (bits >> M) & kExpMask;
    const uint32_t man = bits & kManMask;
    uint64_t out_sign = sign ? (1ull << 63) : 0;
    if (kHasInf && exp == kExpMask) {
      if (man == 0) return BitsDouble(out_sign | (0x7ffull << 52));
      return BitsDouble(out_sign | (0x7ffull << 52) | (1ull << 51) |
                        (static_cast<uint64_t>(man) << (52 - M)));
    }
    if (!kHasInf && exp == kExpMask && man == kManMask) {
      return BitsDouble(out_sign | (0x7ffull << 52) | (1ull << 51));
    }
    if (exp == 0) {
      if (man == 0) return BitsDouble(out_sign);
      // Subnormal: man * 2^(1 - bias - M), exact in double.
      double v = static_cast<double>(man);
      int e = 1 - kBias - M;
      // Scale by powers of two exactly.
      uint64_t scale_bits = static_cast<uint64_t>(1023 + e) << 52;
      v *= BitsDouble(scale_bits);
      return sign ? -v : v;
    }
    uint64_t dexp = static_cast<uint64_t>(static_cast<int>(exp) - kBias + 1023);
    return BitsDouble(out_sign | (dexp << 52) | (static_cast<uint64_t>(man) << (52 - M)));
  }

  // Round to nearest even from double; NaN stays NaN (quiet), inf stays inf
  // (or NaN without inf), overflow goes to inf (NaN without inf).
  ACCORD_HD static uint32_t FromDouble(double d) {
    const uint64_t u = DoubleBits(d);
    const uint32_t sign = (u >> 63) ? kSignBit : 0;
    const int dexp = static_cast<int>((u >> 52) & 0x7ff);
    const uint64_t dman = u & ((1ull << 52) - 1);
    const uint32_t nan_bits =
        kHasInf ? (kExpMask << M) | (1u << (M - 1)) : (kExpMask << M) | kManMask;
    const uint32_t inf_bits = kHasInf ? (kExpMask << M) : nan_bits;
    if (dexp == 0x7ff) {
      if (dman != 0) return sign | nan_bits;
      return sign | inf_bits;
    }
    if (dexp == 0 && dman == 0) return sign;
    // Value = 1.dman * 2^(dexp-1023) (double subnormals are far below every
    // small format's range and round to zero below).
    int e = dexp - 1023;
    // Target exponent field for a normal number.
    int te = e + kBias;
    // Number of mantissa bits to drop from the 52-bit double mantissa (plus
    // the implicit bit for subnormal results).
    uint64_t full = dman | (1ull << 52);  // 53-bit significand
    int shift;
    uint32_t exp_field;
    if (te >= 1) {
      shift = 52 - M;
      exp_field = static_cast<uint32_t>(te);
    } else {
      // Subnormal result: value = full * 2^(e-52); target unit 2^(1-bias-M).
      shift = 52 - M + (1 - te);
      exp_field = 0;
      if (shift > 62) return sign;  // far below half the smallest subnormal
    }
    uint64_t kept = full >> shift;
    uint64_t rem = full & ((1ull << shift) - 1);
    uint64_t half = 1ull << (shift - 1);
    if (rem > half || (rem == half && (kept & 1))) kept += 1;
    uint32_t result;
    if (exp_field == 0) {
      // kept is the subnormal mantissa; a carry into bit M makes it the
      // smallest normal, which the bit layout encodes naturally.
      result = static_cast<uint32_t>(kept);
    } else {
      // kept includes the implicit bit at position M; a carry may move it to M+1.
      if (kept >> (M + 1)) {
        kept >>= 1;
        exp_field += 1;
      }
      result = (exp_field << M) | (static_cast<uint32_t>(kept) & kManMask);
    }
    // Overflow checks.
    const uint32_t exp_out = (result >> M) & kExpMask;
    if (kHasInf) {
      if (exp_out == kExpMask || (result >> M) > kExpMask) return sign | inf_bits;
    } else {
      if ((result >> M) > kExpMask || (exp_out == kExpMask && (result & kManMask) == kManMask)) {
        return sign | nan_bits;
      }
    }
    return sign | result;
  }
};

using Float8E4M3FN = SmallFloat<4, 3, false>;
using Float8E5M2 = SmallFloat<5, 2, true>;
using Half = SmallFloat<5, 10, true>;
using BFloat16 = SmallFloat<8, 7, true>;

// float32 from double, rounding to nearest even (the C++ cast does exactly
// this under the default rounding mode, on the host and on the device). For
// NaN inputs only NaN-ness is portable: the device drops the payload, so
// kernels/element_convert.h spells NaN out explicitly where bits must match.
ACCORD_HD float FloatFromDouble(double d) { return static_cast<float>(d); }

}  // namespace accord::fp

#endif  // ACCORD_CORE_FLOAT_CONVERT_H_
