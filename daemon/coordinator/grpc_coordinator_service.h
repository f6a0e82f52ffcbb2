// gRPC adapters for the coordinator: they only convert between gRPC and the
// logic classes (Coordinator, KvStore). Callback API: no thread per stream,
// and a waiting key-value Get holds no thread.
#ifndef ACCORD_DAEMON_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_
#define ACCORD_DAEMON_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "accord/v1/accord.grpc.pb.h"
#include "core/sync.h"
#include "daemon/common/auth_tokens.h"
#include "daemon/common/node_session.h"
#include "daemon/common/serialized_once.h"
#include "daemon/common/write_queue_limits.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/kv_store.h"

namespace accord::daemon {

grpc::Status ToGrpcStatus(const absl::Status& s);

class NodeSessionReactor;

// CoordinatorService.Session: one reactor per sidecar stream. With `tokens`
// (not owned; null: no tokens configured) every NodeHello must carry its
// job's token; otherwise the stream gets a PERMISSION_DENIED error message
// and ends with that status, and the Coordinator never sees the hello.
class CoordinatorGrpcService final : public v1::CoordinatorService::WithRawCallbackMethod_Session<
                                         v1::CoordinatorService::Service> {
 public:
  // `queue_limits`: the watermarks of each stream's write queue
  // (write_queue_limits.h).
  // `coordinator`: the Coordinator, or a relay (anything that serves node
  // sessions; daemon/common/node_session.h).
  explicit CoordinatorGrpcService(NodeSessionHandler* coordinator,
                                  const JobTokens* tokens = nullptr,
                                  WriteQueueLimits queue_limits = {})
      : coordinator_(coordinator), tokens_(tokens), queue_limits_(queue_limits) {}
  // Raw (wire bytes both ways), so a broadcast is serialized once for every
  // stream; each read is parsed as a NodeMessage.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Session(
      grpc::CallbackServerContext* context) override;
  // Serializations and reuses of outgoing messages so far (tests, metrics).
  int64_t serializations() { return serialized_.serializations(); }
  int64_t serialization_reuses() { return serialized_.hits(); }
  // Ends every open session (UNAVAILABLE) once its queued replies are
  // written; for shutdown. New sessions are refused afterwards.
  void FinishAll();

 private:
  friend class NodeSessionReactor;
  void Remove(NodeSessionReactor* r);

  NodeSessionHandler* const coordinator_;
  const JobTokens* const tokens_;
  const WriteQueueLimits queue_limits_;
  accord::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<NodeSessionReactor*> live_ ABSL_GUARDED_BY(mu_);
  SerializedOnce<v1::CoordinatorMessage> serialized_;
};

// KeyValueService over a KvStore; `Get` waits without holding a thread.
// With `tokens` every request must carry its job's token (PERMISSION_DENIED
// otherwise), so no job can read or write another job's keys. With `runs`
// each request is placed in its run (Coordinator::RunForKeyValue) and keys
// are kept per run; without, every request of a job shares one scope.
class KeyValueGrpcService final : public v1::KeyValueService::CallbackService {
 public:
  explicit KeyValueGrpcService(KvStore* kv, const JobTokens* tokens = nullptr,
                               Coordinator* runs = nullptr)
      : kv_(kv), tokens_(tokens), runs_(runs) {}
  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* context,
                                const v1::KeyValueSetRequest* request,
                                v1::KeyValueSetResponse* response) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context,
                                const v1::KeyValueGetRequest* request,
                                v1::KeyValueGetResponse* response) override;

 private:
  template <typename Request>
  absl::StatusOr<std::string> RunOf(const Request& request);

  KvStore* const kv_;
  const JobTokens* const tokens_;
  Coordinator* const runs_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_
