#include "daemon/coordinator/grpc_coordinator_service.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/common/queued_stream_reactor.h"
#include "proto/wire.h"

namespace accord::daemon {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// One sidecar stream. Reads feed Coordinator::HandleMessage; the coordinator
// sends through NodeSink::Send, which queues and writes one message at a time.
// The stream is raw (wire bytes both ways): a broadcast is serialized once for
// every stream (SerializedOnce), not once per stream.
class NodeSessionReactor final : public QueuedStreamReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                                 public NodeSink {
 public:
  NodeSessionReactor(CoordinatorGrpcService* service, bool refuse, const std::string& peer)
      : service_(service), coordinator_(service->coordinator_) {
    SetWriteQueueLimits(service->queue_limits_, absl::StrCat("the sidecar at ", peer));
    if (refuse) {
      FinishNow(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down"));
      return;
    }
    id_ = coordinator_->OpenSession(this);
    StartRead(&raw_in_);
  }

  // Replies queued while the stream is being ended (shutdown) still go out.
  void Send(std::shared_ptr<const v1::CoordinatorMessage> message) override {
    std::shared_ptr<const grpc::ByteBuffer> bytes = service_->serialized_.Get(message);
    if (bytes != nullptr) Enqueue(std::move(bytes), /*after_end=*/true);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      coordinator_->CloseSession(id_);
      ReadEnded();
      return;
    }
    in_.Clear();
    if (!grpc::SerializationTraits<v1::NodeMessage>::Deserialize(&raw_in_, &in_).ok()) {
      // Not a NodeMessage: nothing on this stream can be trusted any more.
      coordinator_->CloseSession(id_);
      EndAfterWrites(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                  "the stream carried a message that is not an "
                                  "accord.v1.NodeMessage; check the sender's accord version"));
      return;
    }
    if (in_.has_hello() && service_->tokens_ != nullptr) {
      absl::Status allowed = service_->tokens_->CheckJob(
          in_.hello().job_id(), in_.hello().token(),
          absl::StrCat("NodeHello from node \"", in_.hello().node_id(), "\""));
      if (!allowed.ok()) {
        Deny(in_.hello().job_id(), allowed);
        return;
      }
    }
    coordinator_->HandleMessage(id_, in_);
    StartRead(&raw_in_);
  }

  // A refused hello: the error message, then the stream ends with `status`.
  // The session is closed at once (it never joined a job); no further reads.
  void Deny(const std::string& job_id, const absl::Status& status) {
    coordinator_->CloseSession(id_);
    auto reply = std::make_shared<v1::CoordinatorMessage>();
    *reply->mutable_error() = wire::MakeError(v1::PERMISSION_DENIED, status);
    reply->mutable_error()->set_job_id(job_id);
    Send(std::move(reply));
    EndAfterWrites(ToGrpcStatus(status));
  }

  // Shutdown: finish after the queued replies.
  void FinishSoon() {
    EndAfterWrites(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                "the coordinator is shutting down; reconnect to its replacement"));
  }

  void OnDone() override {
    service_->Remove(this);
    delete this;
  }

 private:
  CoordinatorGrpcService* const service_;
  NodeSessionHandler* const coordinator_;
  NodeSessionHandler::SessionId id_ = 0;
  grpc::ByteBuffer raw_in_;
  v1::NodeMessage in_;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* CoordinatorGrpcService::Session(
    grpc::CallbackServerContext* context) {
  accord::MutexLock l(&mu_);
  auto* r = new NodeSessionReactor(this, shutting_down_, context->peer());
  live_.insert(r);
  return r;
}

void CoordinatorGrpcService::Remove(NodeSessionReactor* r) {
  accord::MutexLock l(&mu_);
  live_.erase(r);
}

void CoordinatorGrpcService::FinishAll() {
  accord::MutexLock l(&mu_);
  shutting_down_ = true;
  for (NodeSessionReactor* r : live_) r->FinishSoon();
}

namespace {

// Ends a key-value call, marking a job verdict for the forwarders and the
// client (wire::kJobVerdictMetadataKey).
void FinishKeyValue(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                    const absl::Status& s) {
  if (IsJobVerdict(s)) context->AddTrailingMetadata(wire::kJobVerdictMetadataKey, "1");
  reactor->Finish(ToGrpcStatus(s));
}

}  // namespace

template <typename Request>
absl::StatusOr<std::string> KeyValueGrpcService::RunOf(const Request& request) {
  if (runs_ == nullptr || request.job_id().empty()) return std::string();
  Coordinator::KeyValueOrigin origin;
  origin.run_id = request.run_id();
  origin.node_id = request.node_id();
  origin.node_epoch = request.node_epoch();
  return runs_->RunForKeyValue(request.job_id(), origin);
}

grpc::ServerUnaryReactor* KeyValueGrpcService::Set(grpc::CallbackServerContext* context,
                                                   const v1::KeyValueSetRequest* request,
                                                   v1::KeyValueSetResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (tokens_ != nullptr) {
    absl::Status allowed =
        tokens_->CheckJob(request->job_id(), request->token(),
                          absl::StrCat("key-value Set of \"", request->key(), "\""));
    if (!allowed.ok()) {
      reactor->Finish(ToGrpcStatus(allowed));
      return reactor;
    }
  }
  absl::StatusOr<std::string> run = RunOf(*request);
  if (!run.ok()) {
    // The run this call belongs to ended or failed: the run's own words.
    FinishKeyValue(context, reactor, AsJobVerdict(run.status()));
    return reactor;
  }
  FinishKeyValue(context, reactor,
                 kv_->Set(request->job_id(), *run, request->key(), request->value(),
                          request->has_rank() ? request->rank() : KvStore::kUnknownRank));
  return reactor;
}

grpc::ServerUnaryReactor* KeyValueGrpcService::Get(grpc::CallbackServerContext* context,
                                                   const v1::KeyValueGetRequest* request,
                                                   v1::KeyValueGetResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (tokens_ != nullptr) {
    absl::Status allowed =
        tokens_->CheckJob(request->job_id(), request->token(),
                          absl::StrCat("key-value Get of ", request->keys_size(), " keys"));
    if (!allowed.ok()) {
      reactor->Finish(ToGrpcStatus(allowed));
      return reactor;
    }
  }
  if (request->timeout_ms() < 0) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "negative timeout_ms"));
    return reactor;
  }
  absl::StatusOr<std::string> run = RunOf(*request);
  if (!run.ok()) {
    // The run this call belongs to ended or failed: the run's own words.
    FinishKeyValue(context, reactor, AsJobVerdict(run.status()));
    return reactor;
  }
  std::vector<std::string> keys(request->keys().begin(), request->keys().end());
  kv_->Get(
      request->job_id(), *run, std::move(keys), absl::Milliseconds(request->timeout_ms()),
      [context, reactor, response](absl::StatusOr<std::vector<std::string>> values) {
        if (values.ok()) {
          for (std::string& v : *values) response->add_values(std::move(v));
        }
        FinishKeyValue(context, reactor, values.status());
      },
      request->has_rank() ? request->rank() : KvStore::kUnknownRank,
      request->has_expected() ? std::optional(wire::MembersFormFromProto(request->expected()))
                              : std::nullopt);
  return reactor;
}

}  // namespace accord::daemon
