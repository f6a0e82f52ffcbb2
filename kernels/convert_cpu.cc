#include "kernels/convert_cpu.h"

#include <array>
#include <cstring>
#include <utility>

#include "kernels/element_convert.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define ACCORD_X86 1
#endif

namespace accord::kernels {
namespace {

using RunFn = void (*)(const void*, void*, int64_t);

template <DType S, DType D>
void Run(const void* src, void* dst, int64_t n) {
  if constexpr (S == D) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(StorageT<S>));
  } else {
    const StorageT<S>* __restrict s = static_cast<const StorageT<S>*>(src);
    StorageT<D>* __restrict d = static_cast<StorageT<D>*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = Convert<S, D>(s[i]);
  }
}

#if defined(ACCORD_X86)
// vcvtph2ps is exact and quiets NaNs keeping the payload, which is what
// HalfToFloatBits does (the exhaustive fp16 test pins it).
__attribute__((target("avx,f16c"))) void HalfToFloatF16C(const void* src, void* dst, int64_t n) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  float* d = static_cast<float*>(dst);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) d[i] = fp::BitsFloat(HalfToFloatBits(s[i]));
}
#endif

bool DetectF16C() {
#if defined(ACCORD_X86)
  // CPUID leaf 1, ECX: bit 27 OSXSAVE, bit 28 AVX, bit 29 F16C; then XCR0
  // must show the OS saves XMM and YMM state. (Clang 14's
  // __builtin_cpu_supports does not know "f16c".)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  const unsigned need = (1u << 27) | (1u << 28) | (1u << 29);
  if ((ecx & need) != need) return false;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  return (xcr0_lo & 0x6u) == 0x6u;
#else
  return false;
#endif
}

template <DType S, size_t... J>
constexpr auto RowFor(std::index_sequence<J...>) {
  return std::array<RunFn, kNumDTypes>{&Run<S, kAllDTypes[J]>...};
}

template <size_t... I>
constexpr auto MakeTable(std::index_sequence<I...>) {
  return std::array<std::array<RunFn, kNumDTypes>, kNumDTypes>{
      RowFor<kAllDTypes[I]>(std::make_index_sequence<kNumDTypes>())...};
}

constexpr auto kTable = MakeTable(std::make_index_sequence<kNumDTypes>());

}  // namespace

bool HaveF16C() {
  static const bool have = DetectF16C();
  return have;
}

void ConvertRun(DType from, DType to, const void* src, void* dst, int64_t n) {
  if (n <= 0) return;
#if defined(ACCORD_X86)
  if (from == DType::kFloat16 && to == DType::kFloat32 && HaveF16C()) {
    HalfToFloatF16C(src, dst, n);
    return;
  }
#endif
  // DType values are 1..6 in kAllDTypes order.
  kTable[static_cast<int>(from) - 1][static_cast<int>(to) - 1](src, dst, n);
}

}  // namespace accord::kernels
