#include "demo/model.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/float_convert.h"

namespace accord::demo {
namespace {

enum GroupIndex : size_t { kEmbed = 0, kMoe = 1, kVision = 2, kHead = 3 };
constexpr int kExperts = 8;

uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Rounds a double to `dtype` and back (what a rank holding that dtype sees),
// and writes the element's bytes.
double StoreAs(DType dtype, double v, char* out) {
  switch (dtype) {
    case DType::kFloat32: {
      const float f = fp::FloatFromDouble(v);
      std::memcpy(out, &f, 4);
      return f;
    }
    case DType::kBFloat16: {
      const uint16_t b = static_cast<uint16_t>(fp::BFloat16::FromDouble(v));
      std::memcpy(out, &b, 2);
      return fp::BFloat16::ToDouble(b);
    }
    case DType::kFloat16: {
      const uint16_t h = static_cast<uint16_t>(fp::Half::FromDouble(v));
      std::memcpy(out, &h, 2);
      return fp::Half::ToDouble(h);
    }
    case DType::kFloat64:
      std::memcpy(out, &v, 8);
      return v;
    case DType::kFloat8E4M3FN: {
      const uint8_t e = static_cast<uint8_t>(fp::Float8E4M3FN::FromDouble(v));
      *out = static_cast<char>(e);
      return fp::Float8E4M3FN::ToDouble(e);
    }
    case DType::kFloat8E5M2: {
      const uint8_t e = static_cast<uint8_t>(fp::Float8E5M2::FromDouble(v));
      *out = static_cast<char>(e);
      return fp::Float8E5M2::ToDouble(e);
    }
  }
  return v;
}

ParamSpec Param(std::string name, int64_t dim0, int64_t inner) {
  return ParamSpec{std::move(name), dim0, dim0 * inner};
}

}  // namespace

double Hash01(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e) {
  uint64_t h = Mix(a + 0x9e3779b97f4a7c15ull);
  h = Mix(h ^ b);
  h = Mix(h ^ c);
  h = Mix(h ^ d);
  h = Mix(h ^ e);
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

DemoModel::DemoModel(int world_size, uint64_t seed) : world_size_(world_size), seed_(seed) {
  DemoGroup embed;
  embed.spec.group_id = "embed";
  embed.spec.params = {Param("embed.weight", 64, 16)};
  embed.policy.reduce_dtype = DType::kFloat32;
  DemoGroup moe;
  moe.spec.group_id = "moe";
  moe.spec.params.push_back(Param("moe.router.weight", kExperts, 16));
  for (int e = 0; e < kExperts; ++e) {
    moe.spec.params.push_back(Param(absl::StrCat("moe.expert", e, ".w1"), 32, 16));
    moe.spec.params.push_back(Param(absl::StrCat("moe.expert", e, ".w2"), 16, 32));
  }
  DemoGroup vision;
  vision.spec.group_id = "vision";
  vision.spec.params = {Param("vision.patch", 48, 12), Param("vision.proj", 16, 48),
                        Param("vision.norm", 13, 1)};
  DemoGroup head;
  head.spec.group_id = "head";
  head.spec.params = {Param("head.weight", 10, 16), Param("head.late_bias", 10, 1),
                      Param("head.unused_adapter", 16, 16)};
  groups_ = {embed, moe, vision, head};
}

DType DemoModel::ComputeDType(size_t g, size_t p) const {
  if (g == kMoe && p > 0) return DType::kBFloat16;  // experts compute in bf16
  if (g == kVision) return DType::kBFloat16;
  if (g == kHead && p == 1) return DType::kBFloat16;
  return DType::kFloat32;
}

int DemoModel::FirstMicrobatch(size_t g, size_t p, int rank, int64_t step) const {
  switch (g) {
    case kEmbed:
      return 0;
    case kMoe: {
      if (p == 0) return 0;
      const int expert = static_cast<int>((p - 1) / 2);
      if (expert == kExperts - 1) return (rank == 0 && step % 2 == 0) ? 0 : -1;
      // Tokens reach an expert on a rank with probability 0.6 per microbatch.
      for (int m = 0; m < 2; ++m) {
        if (Hash01(seed_, 1, rank, step * 2 + m, expert) < 0.6) return m;
      }
      return -1;
    }
    case kVision: {
      // Images ride only in the synced microbatch, so the tower's gradients
      // arrive in their compute dtype, never accumulated.
      if (step % 5 == 4) return -1;  // a text-only step on every rank
      return Hash01(seed_, 2, rank, step, 0) < 0.5 ? 1 : -1;
    }
    case kHead:
      if (p == 0) return 0;
      if (p == 1) return 1;  // first gradient on the synced microbatch
      return -1;             // unused_adapter: never
  }
  return -1;
}

double DemoModel::Target(size_t g, size_t p, int64_t i) const {
  return 2.0 * Hash01(seed_, 3, g, p, static_cast<uint64_t>(i)) - 1.0;
}

double DemoModel::Noise(size_t g, size_t p, int rank, int64_t step, int64_t i) const {
  return 0.1 * (Hash01(seed_, 4 + g * 131 + p, rank, step, static_cast<uint64_t>(i)) - 0.5);
}

std::vector<float> DemoModel::InitialWeights(size_t g, size_t p) const {
  const int64_t n = groups_[g].spec.params[p].numel;
  std::vector<float> w(n);
  for (int64_t i = 0; i < n; ++i) w[i] = static_cast<float>(Hash01(seed_, 5, g, p, i) - 0.5);
  return w;
}

double DemoModel::Loss(size_t g, size_t p, const std::vector<float>& weights) const {
  if (weights.empty()) return 0;
  double sum = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const double d = weights[i] - Target(g, p, static_cast<int64_t>(i));
    sum += 0.5 * d * d;
  }
  return sum / static_cast<double>(weights.size());
}

DType DemoModel::GradDType(size_t g, size_t p, int rank, int first_microbatch) const {
  // Accumulated over both microbatches: fp32 accumulation; only the synced
  // microbatch: the compute dtype as produced by backward. Rank 3 runs its
  // vision norm in fp16 (fp16 next to bf16 elsewhere: the wire must be fp32).
  if (first_microbatch == 0) return DType::kFloat32;
  if (g == kVision && p == 2 && rank == 3) return DType::kFloat16;
  return ComputeDType(g, p);
}

LocalGrad DemoModel::Gradient(size_t g, size_t p, int rank, int64_t step,
                              const std::vector<float>& weights) const {
  LocalGrad out;
  const int first = FirstMicrobatch(g, p, rank, step);
  if (first < 0) return out;
  const DType dtype = GradDType(g, p, rank, first);
  out.dtype = dtype;
  const int64_t n = groups_[g].spec.params[p].numel;
  out.bytes.resize(static_cast<size_t>(n) * DTypeSize(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const double grad = weights[i] - Target(g, p, i) - Noise(g, p, rank, step, i);
    StoreAs(dtype, grad, out.bytes.data() + i * DTypeSize(dtype));
  }
  return out;
}

std::vector<double> DemoModel::ReferenceSum(size_t g, size_t p, int64_t step,
                                            const std::vector<float>& weights,
                                            std::vector<double>* abs_sum) const {
  const int64_t n = groups_[g].spec.params[p].numel;
  std::vector<double> sum(n, 0.0);
  abs_sum->assign(n, 0.0);
  char scratch[8];
  for (int r = 0; r < world_size_; ++r) {
    const int first = FirstMicrobatch(g, p, r, step);
    if (first < 0) continue;
    const DType dtype = GradDType(g, p, r, first);
    for (int64_t i = 0; i < n; ++i) {
      const double v =
          StoreAs(dtype, weights[i] - Target(g, p, i) - Noise(g, p, r, step, i), scratch);
      sum[i] += v;
      (*abs_sum)[i] += v < 0 ? -v : v;
    }
  }
  return sum;
}

}  // namespace accord::demo
