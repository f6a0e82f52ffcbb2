// The CPU backend: Gloo over TCP. Internal to client/collective; create it
// through CreateCollective.
#ifndef ACCORD_CLIENT_COLLECTIVE_GLOO_COLLECTIVE_H_
#define ACCORD_CLIENT_COLLECTIVE_GLOO_COLLECTIVE_H_

#include <memory>
#include <string>
#include <vector>

#include "client/collective/collective.h"
#include "client/collective/wire_policy.h"
#include "gloo/context.h"
#include "gloo/rendezvous/store.h"

namespace accord {

// gloo::rendezvous::Store over accord's KeyValueStore, keys under a prefix.
// Gloo's store interface cannot return errors: failures are thrown as
// gloo::IoException and caught where we call into Gloo.
class KvGlooStore : public gloo::rendezvous::Store {
 public:
  KvGlooStore(KeyValueStore& kv, std::string prefix, std::chrono::milliseconds timeout)
      : kv_(kv), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  KeyValueStore& kv_;
  const std::string prefix_;
  const std::chrono::milliseconds timeout_;
};

// Not thread-safe (see Collective).
class GlooCollective : public Collective {
 public:
  // Connects a full mesh of `world_size` ranks; blocks until all joined.
  static absl::StatusOr<std::unique_ptr<Collective>> Create(int rank, int world_size,
                                                            KeyValueStore& kv,
                                                            std::string key_prefix,
                                                            const CollectiveOptions& options);

  absl::Status ReduceScatterSum(const void* in, void* out, int64_t row_numel, DType wire,
                                void* stream) override;
  absl::Status CheckWireDType(DType wire) const override;
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Backend backend() const override { return Backend::kGloo; }

 private:
  GlooCollective(int rank, int world_size, std::shared_ptr<gloo::Context> context,
                 const CollectiveOptions& options)
      : rank_(rank), world_size_(world_size), context_(std::move(context)), options_(options) {}
  void Ring(const char* in, char* out, size_t row_bytes, size_t row_numel, DType wire);
  void Allreduce(const char* in, char* out, size_t row_bytes, size_t row_numel, DType wire);

  const int rank_;
  const int world_size_;
  std::shared_ptr<gloo::Context> context_;
  const CollectiveOptions options_;
  int64_t ops_ = 0;  // collectives issued, for messages
  // Scratch reused across calls (grown as needed).
  std::vector<char> send_;
  std::vector<char> recv_;
};

}  // namespace accord

#endif  // ACCORD_CLIENT_COLLECTIVE_GLOO_COLLECTIVE_H_
