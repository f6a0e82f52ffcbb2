// Host conversion of a contiguous run of elements between any two dtypes,
// with fast paths (memcpy for equal dtypes, F16C for fp16 -> fp32 when the CPU
// has it). Internal to kernels/; results match kernels/element_convert.h.
#ifndef ACCORD_KERNELS_CONVERT_CPU_H_
#define ACCORD_KERNELS_CONVERT_CPU_H_

#include <cstdint>

#include "core/dtype.h"

namespace accord::kernels {

// Converts n elements of `from` at `src` into `to` at `dst`. The ranges must
// not overlap.
void ConvertRun(DType from, DType to, const void* src, void* dst, int64_t n);

// True when fp16 -> fp32 uses the F16C instructions on this machine.
bool HaveF16C();

}  // namespace accord::kernels

#endif  // ACCORD_KERNELS_CONVERT_CPU_H_
