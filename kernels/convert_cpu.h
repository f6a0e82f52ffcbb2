// Host conversion of a contiguous run of elements between any two dtypes,
// with fast paths (memcpy for equal dtypes, F16C for fp16 -> fp32 when the CPU
// has it), and a streaming variant for outputs larger than the caches.
// Internal to kernels/; results match kernels/element_convert.h.
#ifndef ACCORD_KERNELS_CONVERT_CPU_H_
#define ACCORD_KERNELS_CONVERT_CPU_H_

#include <cstdint>

#include "core/dtype.h"

namespace accord::kernels {

// Converts n elements of `from` at `src` into `to` at `dst`. The ranges must
// not overlap.
void ConvertRun(DType from, DType to, const void* src, void* dst, int64_t n);

// ConvertRun with non-temporal (streaming) stores: the destination's cache
// lines are written without being read first, which saves a third of the
// memory traffic of a widening pack too large for the caches. Streaming
// kernels (x86-64): equal dtypes, bf16 -> fp32, fp16 -> fp32 (with F16C);
// other pairs, and destinations not aligned to their element, use
// ConvertRun. Same bits as ConvertRun. Call StreamFence() before another
// thread reads `dst`.
void ConvertRunStreaming(DType from, DType to, const void* src, void* dst, int64_t n);

// Zeroes `bytes` bytes at `dst` with streaming stores (see above).
void ZeroStreaming(void* dst, int64_t bytes);

// Orders this thread's streaming stores before its later stores (sfence):
// after it, a thread that synchronises with this one sees them.
void StreamFence();

// True when fp16 -> fp32 uses the F16C instructions on this machine.
bool HaveF16C();

}  // namespace accord::kernels

#endif  // ACCORD_KERNELS_CONVERT_CPU_H_
