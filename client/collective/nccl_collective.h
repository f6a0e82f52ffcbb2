// The GPU backend: NCCL reduce-scatter on the caller's stream, with every
// wait bounded (docs/GPU.md, "NCCL never hangs"). Internal to
// client/collective; create it through CreateCollective (builds with CUDA and
// NCCL only).
#ifndef ACCORD_CLIENT_COLLECTIVE_NCCL_COLLECTIVE_H_
#define ACCORD_CLIENT_COLLECTIVE_NCCL_COLLECTIVE_H_

#include <chrono>
#include <memory>
#include <string>

#include "client/collective/collective.h"
#include "client/collective/wire_policy.h"

namespace accord {

// Not thread-safe (see Collective). Uses the CUDA device current on the
// calling thread at Create time.
//
// States: kReady -> (an error or a timeout; the communicator is aborted with
// ncclCommAbort) -> kAborted, terminal: every later call returns
// FAILED_PRECONDITION with the first error. The destructor finalizes and
// destroys a kReady communicator within the timeout, and aborts it otherwise.
class NcclCollective : public Collective {
 public:
  // First reads the device's compute capability and ncclGetVersion() and
  // refuses (FAILED_PRECONDITION) any of options.wire_dtypes this device and
  // NCCL cannot reduce with accord's semantics (ResolveWireDType).
  // Rank 0 creates the NCCL unique id and publishes it, once, under
  // "<key_prefix>/<options.incarnation>/nccl_unique_id"; the others wait for
  // it. The communicator is created non-blocking (ncclConfig_t::blocking = 0)
  // and polled with ncclCommGetAsyncError; one deadline (options.timeout)
  // covers the key wait and the creation, after which it is aborted.
  static absl::StatusOr<std::unique_ptr<Collective>> Create(int rank, int world_size,
                                                            KeyValueStore& kv,
                                                            std::string key_prefix,
                                                            const CollectiveOptions& options);
  ~NcclCollective() override;

  // Enqueues ncclReduceScatter(sum) on `stream` (device memory) and polls
  // the stream (an event) and ncclCommGetAsyncError until it has completed,
  // failed or timed out; aborts the communicator on failure or timeout.
  absl::Status ReduceScatterSum(const void* in, void* out, int64_t row_numel, DType wire,
                                void* stream) override;
  absl::Status CheckWireDType(DType wire) const override;
  absl::StatusOr<DType> WireDTypeFor(DType wire) const override;
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Backend backend() const override { return Backend::kNccl; }

 private:
  struct Comm;
  NcclCollective(int rank, int world_size, std::unique_ptr<Comm> comm, NcclRuntimeInfo info,
                 const CollectiveOptions& options);
  // Aborts the communicator, records `error` as the reason, returns it.
  absl::Status Abort(absl::Status error);

  enum class State { kReady, kAborted };

  const int rank_;
  const int world_size_;
  std::unique_ptr<Comm> comm_;
  const NcclRuntimeInfo info_;
  const CollectiveOptions options_;
  State state_ = State::kReady;
  absl::Status abort_reason_;
  int64_t ops_ = 0;  // reduce-scatters issued, for messages
};

}  // namespace accord

#endif  // ACCORD_CLIENT_COLLECTIVE_NCCL_COLLECTIVE_H_
