#include "kernels/convert_cpu.h"

#include <algorithm>
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

#if defined(ACCORD_X86)
// Streaming stores need 16-byte aligned destinations (32 for AVX): the
// kernels below convert a scalar head up to that boundary, stream whole
// vectors, and convert a scalar tail.
constexpr uintptr_t kVec = 16;

int64_t ElementsToAlignment(const void* dst, size_t element_size, uintptr_t alignment) {
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(dst) & (alignment - 1);
  return misaligned == 0 ? 0 : static_cast<int64_t>((alignment - misaligned) / element_size);
}

void CopyStreaming(const void* src, void* dst, int64_t bytes) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  int64_t i = std::min<int64_t>(ElementsToAlignment(d, 1, kVec), bytes);
  std::memcpy(d, s, static_cast<size_t>(i));
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
  std::memcpy(d + i, s + i, static_cast<size_t>(bytes - i));
}

// BFloat16ToFloatBits on four lanes: x = h << 16, plus the quiet bit when
// |x| > inf (a signed compare is exact: both sides are below 2^31).
__m128i BFloat16ToFloatBits4(__m128i x) {
  const __m128i abs = _mm_and_si128(x, _mm_set1_epi32(0x7fffffff));
  const __m128i nan = _mm_cmpgt_epi32(abs, _mm_set1_epi32(0x7f800000));
  return _mm_or_si128(x, _mm_and_si128(nan, _mm_set1_epi32(0x00400000)));
}

void BFloat16ToFloatStreaming(const void* src, void* dst, int64_t n) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  float* d = static_cast<float*>(dst);
  int64_t i = std::min<int64_t>(ElementsToAlignment(d, sizeof(float), kVec), n);
  Run<DType::kBFloat16, DType::kFloat32>(s, d, i);
  const __m128i zero = _mm_setzero_si128();
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     BFloat16ToFloatBits4(_mm_unpacklo_epi16(zero, h)));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 4),
                     BFloat16ToFloatBits4(_mm_unpackhi_epi16(zero, h)));
  }
  Run<DType::kBFloat16, DType::kFloat32>(s + i, d + i, n - i);
}

__attribute__((target("avx,f16c"))) void HalfToFloatF16CStreaming(const void* src, void* dst,
                                                                  int64_t n) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  float* d = static_cast<float*>(dst);
  int64_t i = std::min<int64_t>(ElementsToAlignment(d, sizeof(float), 2 * kVec), n);
  Run<DType::kFloat16, DType::kFloat32>(s, d, i);
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_stream_ps(d + i, _mm256_cvtph_ps(h));
  }
  Run<DType::kFloat16, DType::kFloat32>(s + i, d + i, n - i);
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

void ConvertRunStreaming(DType from, DType to, const void* src, void* dst, int64_t n) {
#if defined(ACCORD_X86)
  const bool element_aligned = reinterpret_cast<uintptr_t>(dst) % DTypeSize(to) == 0;
  if (n > 0 && element_aligned) {
    if (from == to) {
      CopyStreaming(src, dst, n * static_cast<int64_t>(DTypeSize(to)));
      return;
    }
    if (from == DType::kBFloat16 && to == DType::kFloat32) {
      BFloat16ToFloatStreaming(src, dst, n);
      return;
    }
    if (from == DType::kFloat16 && to == DType::kFloat32 && HaveF16C()) {
      HalfToFloatF16CStreaming(src, dst, n);
      return;
    }
  }
#endif
  ConvertRun(from, to, src, dst, n);
}

void ZeroStreaming(void* dst, int64_t bytes) {
  if (bytes <= 0) return;
#if defined(ACCORD_X86)
  char* d = static_cast<char*>(dst);
  int64_t i = std::min<int64_t>(ElementsToAlignment(d, 1, kVec), bytes);
  std::memset(d, 0, static_cast<size_t>(i));
  const __m128i zero = _mm_setzero_si128();
  for (; i + 16 <= bytes; i += 16) _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), zero);
  std::memset(d + i, 0, static_cast<size_t>(bytes - i));
#else
  std::memset(dst, 0, static_cast<size_t>(bytes));
#endif
}

void StreamFence() {
#if defined(ACCORD_X86)
  _mm_sfence();
#endif
}

}  // namespace accord::kernels
