// Element conversions used by the pack/unpack kernels, compiled identically
// for the host and for CUDA devices so both produce the same bits.
//
// Semantics (pinned by tests/kernels against core/float_convert.h):
//  - a dtype converted to itself is the identity on bits (NaN payloads kept);
//  - otherwise the value goes through double exactly and rounds once to the
//    target (round to nearest even), as core/float_convert.h defines: widening
//    keeps a NaN's payload and sets its quiet bit; narrowing to a 8/16-bit
//    format yields that format's canonical quiet NaN with the sign kept.
// float <-> double casts are spelled out for NaN because the device's cvt
// instructions return a canonical NaN where x86 keeps the payload.
//
// Internal to kernels/: no __global__ here; launchers live in kernels/cuda/.
#ifndef ACCORD_KERNELS_ELEMENT_CONVERT_H_
#define ACCORD_KERNELS_ELEMENT_CONVERT_H_

#include <cstdint>

#include "core/dtype.h"
#include "core/float_convert.h"

namespace accord::kernels {

// Storage type of one element of each dtype.
template <DType D>
struct Storage;
template <>
struct Storage<DType::kFloat8E4M3FN> {
  using type = uint8_t;
};
template <>
struct Storage<DType::kFloat8E5M2> {
  using type = uint8_t;
};
template <>
struct Storage<DType::kFloat16> {
  using type = uint16_t;
};
template <>
struct Storage<DType::kBFloat16> {
  using type = uint16_t;
};
template <>
struct Storage<DType::kFloat32> {
  using type = float;
};
template <>
struct Storage<DType::kFloat64> {
  using type = double;
};
template <DType D>
using StorageT = typename Storage<D>::type;

// float -> double, exact; a NaN keeps its payload and becomes quiet (x86's cvtss2sd).
ACCORD_HD double FloatToDouble(float f) {
#if defined(__CUDA_ARCH__)
  const uint32_t u = fp::FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    const uint64_t sign = static_cast<uint64_t>(u >> 31) << 63;
    return fp::BitsDouble(sign | 0x7ff8000000000000ull |
                          (static_cast<uint64_t>(u & 0x003fffffu) << 29));
  }
#endif
  return static_cast<double>(f);
}

// double -> float, round to nearest even; a NaN keeps the top of its payload
// and becomes quiet (x86's cvtsd2ss).
ACCORD_HD float DoubleToFloat(double d) {
#if defined(__CUDA_ARCH__)
  const uint64_t u = fp::DoubleBits(d);
  if ((u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) {
    const uint32_t sign = static_cast<uint32_t>(u >> 63) << 31;
    return fp::BitsFloat(sign | 0x7fc00000u | static_cast<uint32_t>((u >> 29) & 0x003fffffu));
  }
  return __double2float_rn(d);
#else
  return static_cast<float>(d);
#endif
}

template <DType D>
ACCORD_HD double ToDouble(StorageT<D> v) {
  if constexpr (D == DType::kFloat8E4M3FN) {
    return fp::Float8E4M3FN::ToDouble(v);
  } else if constexpr (D == DType::kFloat8E5M2) {
    return fp::Float8E5M2::ToDouble(v);
  } else if constexpr (D == DType::kFloat16) {
    return fp::Half::ToDouble(v);
  } else if constexpr (D == DType::kBFloat16) {
    return fp::BFloat16::ToDouble(v);
  } else if constexpr (D == DType::kFloat32) {
    return FloatToDouble(v);
  } else {
    return v;
  }
}

template <DType D>
ACCORD_HD StorageT<D> FromDouble(double d) {
  if constexpr (D == DType::kFloat8E4M3FN) {
    return static_cast<uint8_t>(fp::Float8E4M3FN::FromDouble(d));
  } else if constexpr (D == DType::kFloat8E5M2) {
    return static_cast<uint8_t>(fp::Float8E5M2::FromDouble(d));
  } else if constexpr (D == DType::kFloat16) {
    return static_cast<uint16_t>(fp::Half::FromDouble(d));
  } else if constexpr (D == DType::kBFloat16) {
    return static_cast<uint16_t>(fp::BFloat16::FromDouble(d));
  } else if constexpr (D == DType::kFloat32) {
    return DoubleToFloat(d);
  } else {
    return d;
  }
}

ACCORD_HD int HighestBit(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return 31 - __clz(static_cast<int>(v));
#else
  return 31 - __builtin_clz(v);
#endif
}

// bf16 -> fp32: a shift, plus the quiet bit for NaNs (branch-free, vectorizes).
ACCORD_HD uint32_t BFloat16ToFloatBits(uint16_t h) {
  const uint32_t x = static_cast<uint32_t>(h) << 16;
  return x | (((x & 0x7fffffffu) > 0x7f800000u) ? 0x00400000u : 0u);
}

// fp16 -> fp32, exact, integer-only.
ACCORD_HD uint32_t HalfToFloatBits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return sign | 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0u);
  if (e == 0) {
    if (m == 0) return sign;
    const int p = HighestBit(m);  // value = 2^(p-24) * 1.frac
    const uint32_t e32 = static_cast<uint32_t>(p - 24 + 127);
    return sign | (e32 << 23) | ((m << (23 - p)) & 0x007fffffu);
  }
  return sign | ((e + 112u) << 23) | (m << 13);
}

// fp32 -> bf16, round to nearest even; NaN -> canonical quiet NaN with sign.
ACCORD_HD uint16_t FloatBitsToBFloat16(uint32_t x) {
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>(((x >> 16) & 0x8000u) | 0x7fc0u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Converts one element from S to D (see the semantics at the top).
template <DType S, DType D>
ACCORD_HD StorageT<D> Convert(StorageT<S> v) {
  if constexpr (S == D) {
    return v;
  } else if constexpr (S == DType::kBFloat16 && D == DType::kFloat32) {
    return fp::BitsFloat(BFloat16ToFloatBits(v));
  } else if constexpr (S == DType::kFloat16 && D == DType::kFloat32) {
    return fp::BitsFloat(HalfToFloatBits(v));
  } else if constexpr (S == DType::kFloat32 && D == DType::kBFloat16) {
    return FloatBitsToBFloat16(fp::FloatBits(v));
  } else if constexpr (S == DType::kFloat32 && D == DType::kFloat64) {
    return FloatToDouble(v);
  } else if constexpr (S == DType::kFloat64 && D == DType::kFloat32) {
    return DoubleToFloat(v);
  } else {
    return FromDouble<D>(ToDouble<S>(v));
  }
}

}  // namespace accord::kernels

#endif  // ACCORD_KERNELS_ELEMENT_CONVERT_H_
