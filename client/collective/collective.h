// The reduce-scatter used by the data path, behind one interface so the
// client does not care whether Gloo (CPU) or NCCL (GPU) carries it.
#ifndef ACCORD_CLIENT_COLLECTIVE_COLLECTIVE_H_
#define ACCORD_CLIENT_COLLECTIVE_COLLECTIVE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/kv_store.h"
#include "core/dtype.h"

namespace accord {

// One member of a communicator of `world_size` ranks. Not thread-safe: one
// thread (the trainer's) issues the collectives, in the same order on every
// rank.
class Collective {
 public:
  virtual ~Collective() = default;
  // Sums `in` (world_size rows of row_numel elements of `wire`, row r meant
  // for rank r) over all ranks and writes this rank's row into `out`.
  // Memory is host memory for Gloo and device memory for NCCL; `stream` is a
  // cudaStream_t for NCCL (the call is then asynchronous on that stream) and
  // ignored by Gloo. `in` is not modified. Errors name the backend, ranks and
  // what to check (peers gone, timeout).
  virtual absl::Status ReduceScatterSum(const void* in, void* out, int64_t row_numel, DType wire,
                                        void* stream = nullptr) = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
};

enum class Backend { kGloo, kNccl };

// How the Gloo backend reduce-scatters (bench/collective compares them).
enum class GlooAlgorithm {
  // Ring reduce-scatter over Gloo's pairs: W-1 steps, each rank sends and
  // receives (W-1)/W of the buffer once. The default.
  kRing,
  // gloo::allreduce of the whole buffer, then keep this rank's row (what
  // PyTorch's Gloo backend does): about twice the traffic.
  kAllreduce,
};

struct CollectiveOptions {
  GlooAlgorithm gloo_algorithm = GlooAlgorithm::kRing;
  // Gloo TCP transport: bind to this interface (e.g. "eth0") or hostname;
  // both empty: the loopback address 127.0.0.1 (single-host tests).
  std::string gloo_iface;
  std::string gloo_hostname;
  // Rendezvous and per-operation timeout.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

// Creates a backend's communicator, rendezvousing through `kv` under
// `key_prefix` (unique per communicator, e.g. "<job>/<group>/gloo"). Blocks
// until every rank has joined or the timeout passes. UNIMPLEMENTED when the
// backend was not compiled in; INVALID_ARGUMENT for a bad rank/world size.
absl::StatusOr<std::unique_ptr<Collective>> CreateCollective(Backend backend, int rank,
                                                             int world_size, KeyValueStore& kv,
                                                             std::string key_prefix,
                                                             const CollectiveOptions& options = {});

}  // namespace accord

#endif  // ACCORD_CLIENT_COLLECTIVE_COLLECTIVE_H_
