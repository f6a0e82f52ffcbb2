// Element-wise sums in a wire dtype for the CPU collective: Gloo has no bf16
// or fp8 sum. Each add computes the exact sum of the two operands' values and
// rounds once (nearest even) to the wire dtype, so results are deterministic
// and independent of the machine.
#ifndef ACCORD_CLIENT_COLLECTIVE_SUM_REDUCE_H_
#define ACCORD_CLIENT_COLLECTIVE_SUM_REDUCE_H_

#include <cstddef>

#include "core/dtype.h"

namespace accord {

// out[i] = round(a[i] + b[i]) for n elements of `wire`; out may alias a or b.
void SumInto(DType wire, void* out, const void* a, const void* b, size_t n);

}  // namespace accord

#endif  // ACCORD_CLIENT_COLLECTIVE_SUM_REDUCE_H_
