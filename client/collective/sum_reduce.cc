#include "client/collective/sum_reduce.h"

#include "kernels/element_convert.h"

namespace accord {
namespace {

// A sum of two p-bit values computed in a format of at least 2p+2 bits and
// then rounded to p bits is correctly rounded (no double-rounding error):
// float (24 bits) suffices for fp16 (11) and bf16 (8); double for fp8 and
// anything else.
template <DType D>
void SumLoop(void* out, const void* a, const void* b, size_t n) {
  using T = kernels::StorageT<D>;
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) {
    if constexpr (D == DType::kFloat32 || D == DType::kFloat64) {
      o[i] = x[i] + y[i];
    } else if constexpr (D == DType::kBFloat16) {
      const float s = fp::BitsFloat(kernels::BFloat16ToFloatBits(x[i])) +
                      fp::BitsFloat(kernels::BFloat16ToFloatBits(y[i]));
      o[i] = kernels::FloatBitsToBFloat16(fp::FloatBits(s));
    } else if constexpr (D == DType::kFloat16) {
      const float s = fp::BitsFloat(kernels::HalfToFloatBits(x[i])) +
                      fp::BitsFloat(kernels::HalfToFloatBits(y[i]));
      o[i] = kernels::FromDouble<D>(static_cast<double>(s));
    } else {
      o[i] = kernels::FromDouble<D>(kernels::ToDouble<D>(x[i]) + kernels::ToDouble<D>(y[i]));
    }
  }
}

}  // namespace

void SumInto(DType wire, void* out, const void* a, const void* b, size_t n) {
  switch (wire) {
    case DType::kFloat8E4M3FN:
      return SumLoop<DType::kFloat8E4M3FN>(out, a, b, n);
    case DType::kFloat8E5M2:
      return SumLoop<DType::kFloat8E5M2>(out, a, b, n);
    case DType::kFloat16:
      return SumLoop<DType::kFloat16>(out, a, b, n);
    case DType::kBFloat16:
      return SumLoop<DType::kBFloat16>(out, a, b, n);
    case DType::kFloat32:
      return SumLoop<DType::kFloat32>(out, a, b, n);
    case DType::kFloat64:
      return SumLoop<DType::kFloat64>(out, a, b, n);
  }
}

}  // namespace accord
