// A naive, per-element reference for pack/unpack, written straight from
// core/float_convert.h and the layout definition in core/group.h.
#ifndef ACCORD_TESTS_KERNELS_REFERENCE_H_
#define ACCORD_TESTS_KERNELS_REFERENCE_H_

#include <cstdint>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/group.h"
#include "kernels/pack.h"

namespace accord::testing {

// Element `i` of a buffer of `d` as raw bits, and the reverse.
uint64_t LoadBits(DType d, const void* p, int64_t i);
void StoreBits(DType d, void* p, int64_t i, uint64_t bits);

// One element converted the reference way: identity on bits for equal
// dtypes, else exact to double and one rounding step.
uint64_t RefConvert(DType from, DType to, uint64_t bits);

// The whole packed buffer, element by element.
std::vector<uint8_t> RefPack(const GroupSpec& spec, const Layout& layout,
                             const std::vector<GradSource>& sources);

// Random bit patterns of `d` (every pattern possible: NaNs, infs, -0,
// subnormals), with some specials mixed in.
std::vector<uint8_t> RandomBits(DType d, int64_t n, std::mt19937_64& rng);

}  // namespace accord::testing

#endif  // ACCORD_TESTS_KERNELS_REFERENCE_H_
