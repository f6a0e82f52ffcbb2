#include "tests/kernels/reference.h"

#include <cstring>

#include "core/float_convert.h"

namespace accord::testing {

uint64_t LoadBits(DType d, const void* p, int64_t i) {
  const size_t s = DTypeSize(d);
  uint64_t v = 0;
  std::memcpy(&v, static_cast<const char*>(p) + i * s, s);  // little endian
  return v;
}

void StoreBits(DType d, void* p, int64_t i, uint64_t bits) {
  const size_t s = DTypeSize(d);
  std::memcpy(static_cast<char*>(p) + i * s, &bits, s);
}

uint64_t RefConvert(DType from, DType to, uint64_t bits) {
  if (from == to) return bits;
  double v = 0;
  switch (from) {
    case DType::kFloat8E4M3FN:
      v = fp::Float8E4M3FN::ToDouble(static_cast<uint32_t>(bits));
      break;
    case DType::kFloat8E5M2:
      v = fp::Float8E5M2::ToDouble(static_cast<uint32_t>(bits));
      break;
    case DType::kFloat16:
      v = fp::Half::ToDouble(static_cast<uint32_t>(bits));
      break;
    case DType::kBFloat16:
      v = fp::BFloat16::ToDouble(static_cast<uint32_t>(bits));
      break;
    case DType::kFloat32:
      v = static_cast<double>(fp::BitsFloat(static_cast<uint32_t>(bits)));
      break;
    case DType::kFloat64:
      v = fp::BitsDouble(bits);
      break;
  }
  switch (to) {
    case DType::kFloat8E4M3FN:
      return fp::Float8E4M3FN::FromDouble(v);
    case DType::kFloat8E5M2:
      return fp::Float8E5M2::FromDouble(v);
    case DType::kFloat16:
      return fp::Half::FromDouble(v);
    case DType::kBFloat16:
      return fp::BFloat16::FromDouble(v);
    case DType::kFloat32:
      return fp::FloatBits(fp::FloatFromDouble(v));
    case DType::kFloat64:
      return fp::DoubleBits(v);
  }
  return 0;
}

std::vector<uint8_t> RefPack(const GroupSpec& spec, const Layout& layout,
                             const std::vector<GradSource>& sources) {
  const DType wire = layout.wire_dtype;
  std::vector<uint8_t> out(static_cast<size_t>(layout.total_bytes()), 0xAB);
  for (int r = 0; r < layout.world_size; ++r) {
    for (size_t i = 0; i < spec.params.size(); ++i) {
      const ParamLayout& pl = layout.params[i];
      if (!pl.included) continue;
      for (int64_t j = 0; j < pl.chunk_numel; ++j) {
        const int64_t s = r * pl.chunk_numel + j;
        uint64_t bits = 0;
        if (sources[i].data != nullptr && s < spec.params[i].numel) {
          bits = RefConvert(sources[i].dtype, wire, LoadBits(sources[i].dtype, sources[i].data, s));
        }
        StoreBits(wire, out.data(), layout.ChunkOffset(i, r) + j, bits);
      }
    }
  }
  return out;
}

std::vector<uint8_t> RandomBits(DType d, int64_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> out(static_cast<size_t>(n) * DTypeSize(d));
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  // Specials at the front: +-0, +-inf, quiet and signalling NaNs, tiny values.
  const uint64_t specials[][6] = {
      {0x00, 0x00, 0x0000, 0x0000, 0x00000000u, 0x0ull},
      {0x80, 0x80, 0x8000, 0x8000, 0x80000000u, 0x8000000000000000ull},
      {0x7f, 0x7c, 0x7c00, 0x7f80, 0x7f800000u, 0x7ff0000000000000ull},
      {0xff, 0xfc, 0xfc00, 0xff80, 0xff800000u, 0xfff0000000000000ull},
      {0x7f, 0x7e, 0x7e00, 0x7fc0, 0x7fc00000u, 0x7ff8000000000000ull},
      {0xff, 0x7d, 0x7c01, 0x7f81, 0x7f800001u, 0x7ff0000000000001ull},
      {0x01, 0x01, 0x0001, 0x0001, 0x00000001u, 0x0000000000000001ull},
      {0x7e, 0x7b, 0x7bff, 0x7f7f, 0x7f7fffffu, 0x7fefffffffffffffull},
  };
  const int col = static_cast<int>(d) - 1;
  for (int64_t k = 0; k < n && k < 8; ++k) StoreBits(d, out.data(), k, specials[k][col]);
  return out;
}

}  // namespace accord::testing
