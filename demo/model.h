// The demo's synthetic model: groups and usage patterns that break sharded
// jobs today, with gradients that every rank can recompute for every other
// rank (so each rank checks its reduced shard against an independent float64
// reference).
//
//   embed    always used, fp32 accumulation
//   moe      a router (fp32) and 8 experts (bf16 gradients); an expert gets a
//            gradient only on ranks whose tokens were routed to it; expert 7
//            gets tokens on rank 0 only, and only on even steps
//   vision   a tower used only by ranks whose batch has images (bf16; rank 3
//            runs its norm in fp16, so such steps need fp32 on the wire);
//            every 5th step no rank has images
//   head     weight (fp32 accumulation over both microbatches), late_bias
//            (first gets a gradient on the synced microbatch: bf16 next to
//            fp32 accumulations) and unused_adapter (no rank ever uses it)
//
// Loss per parameter element: 0.5 * (w - target - noise(rank, step))^2, so
// the gradient on a rank is w - target - noise and plain SGD on the reduced
// gradients makes the loss fall.
#ifndef ACCORD_DEMO_MODEL_H_
#define ACCORD_DEMO_MODEL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/decide.h"
#include "core/group.h"

namespace accord::demo {

struct DemoGroup {
  GroupSpec spec;
  Policy policy;
};

// A rank's local gradient for one parameter at one step: absent, or values
// held in `dtype` (stored as raw bytes of that dtype).
struct LocalGrad {
  std::optional<DType> dtype;
  std::vector<char> bytes;
};

class DemoModel {
 public:
  DemoModel(int world_size, uint64_t seed);

  const std::vector<DemoGroup>& groups() const { return groups_; }
  int world_size() const { return world_size_; }

  // Whether `rank` uses parameter `p` of group `g` at `step`, and in which
  // microbatch it first gets a gradient (0 or 1), or -1 when unused.
  int FirstMicrobatch(size_t g, size_t p, int rank, int64_t step) const;

  // The gradient `rank` holds for (g, p) at `step` given the current full
  // weights of that parameter (fp32), after accumulation over the
  // microbatches: fp32 when accumulated over both microbatches, else the
  // parameter's compute dtype.
  LocalGrad Gradient(size_t g, size_t p, int rank, int64_t step,
                     const std::vector<float>& weights) const;

  // The float64 sum over all ranks of their gradients for (g, p), each first
  // rounded to its own dtype (what the ranks actually hold).
  // `abs_sum` receives the sum of absolute values (for rounding bounds).
  std::vector<double> ReferenceSum(size_t g, size_t p, int64_t step,
                                   const std::vector<float>& weights,
                                   std::vector<double>* abs_sum) const;

  // Initial weights and the regression targets (deterministic).
  std::vector<float> InitialWeights(size_t g, size_t p) const;
  // Mean of 0.5 * (w - target)^2 over the parameter's elements.
  double Loss(size_t g, size_t p, const std::vector<float>& weights) const;

 private:
  double Target(size_t g, size_t p, int64_t i) const;
  double Noise(size_t g, size_t p, int rank, int64_t step, int64_t i) const;
  DType ComputeDType(size_t g, size_t p) const;
  DType GradDType(size_t g, size_t p, int rank, int first_microbatch) const;

  int world_size_;
  uint64_t seed_;
  std::vector<DemoGroup> groups_;
};

// Splitmix-style deterministic hash of several integers into [0, 1).
double Hash01(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e);

}  // namespace accord::demo

#endif  // ACCORD_DEMO_MODEL_H_
