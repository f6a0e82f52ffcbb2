// The GPU backend: NCCL reduce-scatter on the caller's stream. Internal to
// client/collective; create it through CreateCollective (builds with CUDA and
// NCCL only).
#ifndef ACCORD_CLIENT_COLLECTIVE_NCCL_COLLECTIVE_H_
#define ACCORD_CLIENT_COLLECTIVE_NCCL_COLLECTIVE_H_

#include <memory>
#include <string>

#include "client/collective/collective.h"

namespace accord {

// Not thread-safe (see Collective). Uses the CUDA device current on the
// calling thread at Create time.
class NcclCollective : public Collective {
 public:
  // Rank 0 creates the NCCL unique id and publishes it under
  // "<key_prefix>/nccl_unique_id"; the others wait for it up to the timeout.
  // ncclCommInitRank then blocks until every rank has joined.
  static absl::StatusOr<std::unique_ptr<Collective>> Create(int rank, int world_size,
                                                            KeyValueStore& kv,
                                                            std::string key_prefix,
                                                            const CollectiveOptions& options);
  ~NcclCollective() override;

  // Enqueues ncclReduceScatter(sum) on `stream` (device memory); returns
  // once enqueued.
  absl::Status ReduceScatterSum(const void* in, void* out, int64_t row_numel, DType wire,
                                void* stream) override;
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

 private:
  struct Comm;
  NcclCollective(int rank, int world_size, std::unique_ptr<Comm> comm);

  const int rank_;
  const int world_size_;
  std::unique_ptr<Comm> comm_;
};

}  // namespace accord

#endif  // ACCORD_CLIENT_COLLECTIVE_NCCL_COLLECTIVE_H_
