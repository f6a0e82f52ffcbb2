// The reduce-scatter used by the data path, behind one interface so the
// client does not care whether Gloo (CPU) or NCCL (GPU) carries it.
#ifndef ACCORD_CLIENT_COLLECTIVE_COLLECTIVE_H_
#define ACCORD_CLIENT_COLLECTIVE_COLLECTIVE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/collective/wire_policy.h"
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
  // cudaStream_t for NCCL (ordered on that stream; the call returns once the
  // reduce-scatter has completed on it, or at once while the stream is being
  // captured into a CUDA graph) and ignored by Gloo. `in` is not modified.
  // Bounded by CollectiveOptions::timeout. Errors name the backend, ranks and
  // what to check: DEADLINE_EXCEEDED (timeout; the communicator is then
  // aborted), UNAVAILABLE (a peer failed), FAILED_PRECONDITION (a wire dtype
  // this backend refuses, see CheckWireDType, or a communicator aborted by an
  // earlier error).
  virtual absl::Status ReduceScatterSum(const void* in, void* out, int64_t row_numel, DType wire,
                                        void* stream = nullptr) = 0;
  // OK when ReduceScatterSum reduces `wire` with accord's sum semantics
  // (docs/GPU.md, "fp8"); FAILED_PRECONDITION saying why and what to use
  // instead otherwise. Cheap: callers check before packing.
  virtual absl::Status CheckWireDType(DType wire) const = 0;
  // The wire dtype a job whose policy would decide `wire` must decide
  // instead for this communicator (ResolveWireDType): `wire` when
  // CheckWireDType accepts it, the widened dtype for a refused fp8 one with
  // CollectiveOptions::nccl_widen_fp8_to, or CheckWireDType's error.
  virtual absl::StatusOr<DType> WireDTypeFor(DType wire) const {
    if (absl::Status s = CheckWireDType(wire); !s.ok()) return s;
    return wire;
  }
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Backend backend() const = 0;
};

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
  // Rendezvous and per-operation timeout: bounds the key-value wait plus the
  // communicator's creation, and each reduce-scatter until it has completed.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  // Scopes the rendezvous keys to one run of the job: keys live under
  // "<key_prefix>/<incarnation>/". Every rank of a run passes the same value
  // and a restarted job a new one (e.g. the launcher's run id, or a nonce
  // the launcher hands to every rank), so that no rank reads a previous
  // run's bootstrap data. Required by NCCL (whose unique id is written
  // once); optional for Gloo (empty: keys directly under key_prefix).
  std::string incarnation;
  // NCCL only: allow fp8 wire dtypes although NCCL's fp8 sum saturates
  // (e4m3 to +-448, e5m2 to +-57344, an inf becomes finite) where accord's
  // sum gives inf/NaN (docs/GPU.md, "fp8"). Off: fp8 is refused.
  bool nccl_allow_saturating_fp8 = false;
  // NCCL only: an fp8 wire dtype NCCL refuses is widened to this dtype
  // (kBFloat16 or kFloat16) instead: Collective::WireDTypeFor says so, and
  // the job's policy must carry the widened dtype (PolicyForCollective in
  // client/collective/reducer.h), since every rank reduces the decision's.
  std::optional<DType> nccl_widen_fp8_to;
  // The wire dtypes this communicator's decisions can carry (the job
  // policy's reduce dtype and empty-group dtype). NCCL's Create resolves
  // each (ResolveWireDType) before any rendezvous and fails with
  // FAILED_PRECONDITION naming the dtype, the device's compute capability
  // and the NCCL version for one it refuses. Empty: nothing is checked at
  // Create, and ReduceScatterSum still refuses such a dtype. (Gloo reduces
  // every dtype.)
  std::vector<DType> wire_dtypes;
};

// Creates a backend's communicator, rendezvousing through `kv` under
// `key_prefix` (unique per communicator, e.g. "<job>/<group>/gloo") and
// options.incarnation. Blocks until every rank has joined or the timeout
// passes (DEADLINE_EXCEEDED; never longer). UNIMPLEMENTED when the backend was
// not compiled in; INVALID_ARGUMENT for a bad rank/world size or, for NCCL, an
// empty incarnation or a widening dtype other than bf16/fp16;
// FAILED_PRECONDITION for a refused dtype of options.wire_dtypes; ALREADY_EXISTS when NCCL's unique
// id of this incarnation was already published.
absl::StatusOr<std::unique_ptr<Collective>> CreateCollective(Backend backend, int rank,
                                                             int world_size, KeyValueStore& kv,
                                                             std::string key_prefix,
                                                             const CollectiveOptions& options = {});

}  // namespace accord

#endif  // ACCORD_CLIENT_COLLECTIVE_COLLECTIVE_H_
