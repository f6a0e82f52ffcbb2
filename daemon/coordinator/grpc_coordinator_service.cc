#include "daemon/coordinator/grpc_coordinator_service.h"

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/wire.h"

namespace accord::daemon {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// One sidecar stream. Reads feed Coordinator::HandleMessage; the coordinator
// sends through NodeSink::Send, which queues and writes one message at a time.
class NodeSessionReactor final
    : public grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage>,
      public NodeSink {
 public:
  NodeSessionReactor(CoordinatorGrpcService* service, bool refuse)
      : service_(service), coordinator_(service->coordinator_) {
    if (refuse) {
      finished_ = true;
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down"));
      return;
    }
    id_ = coordinator_->OpenSession(this);
    StartRead(&in_);
  }

  void Send(std::shared_ptr<const v1::CoordinatorMessage> message) override {
    accord::MutexLock l(&mu_);
    if (finished_ || write_failed_) return;
    queue_.push_back(std::move(message));
    if (!writing_) {
      writing_ = true;
      StartWrite(queue_.front().get());
    }
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      coordinator_->CloseSession(id_);
      accord::MutexLock l(&mu_);
      read_closed_ = true;
      MaybeFinishLocked(grpc::Status::OK);
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
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    accord::MutexLock l(&mu_);
    queue_.pop_front();
    if (!ok) {
      write_failed_ = true;
      queue_.clear();
    }
    if (!queue_.empty()) {
      StartWrite(queue_.front().get());
      return;
    }
    writing_ = false;
    MaybeFinishLocked(finish_status_);
  }

  // A refused hello: the error message, then the stream ends with `status`.
  // The session is closed at once (it never joined a job); no further reads.
  void Deny(const std::string& job_id, const absl::Status& status) {
    coordinator_->CloseSession(id_);
    auto reply = std::make_shared<v1::CoordinatorMessage>();
    *reply->mutable_error() = wire::MakeError(v1::PERMISSION_DENIED, status);
    reply->mutable_error()->set_job_id(job_id);
    accord::MutexLock l(&mu_);
    finishing_ = true;
    finish_status_ = ToGrpcStatus(status);
    if (!write_failed_) {
      queue_.push_back(std::move(reply));
      if (!writing_) {
        writing_ = true;
        StartWrite(queue_.front().get());
      }
    }
    MaybeFinishLocked(finish_status_);
  }

  // Shutdown: finish after the queued replies.
  void FinishSoon() {
    accord::MutexLock l(&mu_);
    finishing_ = true;
    finish_status_ = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                  "the coordinator is shutting down; reconnect to its replacement");
    MaybeFinishLocked(finish_status_);
  }

  void OnDone() override {
    service_->Remove(this);
    delete this;
  }

 private:
  void MaybeFinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_ || !(read_closed_ || finishing_)) return;
    finished_ = true;
    Finish(status);
  }

  CoordinatorGrpcService* const service_;
  Coordinator* const coordinator_;
  Coordinator::SessionId id_ = 0;
  v1::NodeMessage in_;
  accord::Mutex mu_;
  std::deque<std::shared_ptr<const v1::CoordinatorMessage>> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool read_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage>* CoordinatorGrpcService::Session(
    grpc::CallbackServerContext* context) {
  accord::MutexLock l(&mu_);
  auto* r = new NodeSessionReactor(this, shutting_down_);
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
  reactor->Finish(ToGrpcStatus(kv_->Set(request->job_id(), request->key(), request->value())));
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
  std::vector<std::string> keys(request->keys().begin(), request->keys().end());
  kv_->Get(request->job_id(), std::move(keys), absl::Milliseconds(request->timeout_ms()),
           [reactor, response](absl::StatusOr<std::vector<std::string>> values) {
             if (values.ok()) {
               for (std::string& v : *values) response->add_values(std::move(v));
             }
             reactor->Finish(ToGrpcStatus(values.status()));
           });
  return reactor;
}

}  // namespace accord::daemon
