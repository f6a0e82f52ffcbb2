#include "client/grpc_kv_store.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "accord/v1/accord.grpc.pb.h"
#include "grpcpp/client_context.h"

namespace accord {
namespace {

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what, absl::string_view target) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, " via ", target, ": ", s.error_message()));
}

class GrpcKeyValueStore : public KeyValueStore {
 public:
  GrpcKeyValueStore(std::shared_ptr<grpc::Channel> channel, std::string target, std::string job_id,
                    std::string token, int rank)
      : stub_(v1::KeyValueService::NewStub(channel)),
        target_(std::move(target)),
        job_id_(std::move(job_id)),
        token_(std::move(token)),
        rank_(rank) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    v1::KeyValueSetRequest req;
    req.set_job_id(job_id_);
    req.set_key(key);
    req.set_value(value);
    req.set_token(token_);
    req.set_rank(rank_);
    v1::KeyValueSetResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return FromGrpc(stub_->Set(&ctx, req, &resp),
                    absl::StrCat("key-value Set(\"", key, "\") for job \"", job_id_, "\""),
                    target_);
  }

  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               std::chrono::milliseconds timeout) override {
    v1::KeyValueGetRequest req;
    req.set_job_id(job_id_);
    for (const std::string& k : keys) req.add_keys(k);
    req.set_timeout_ms(timeout.count());
    req.set_token(token_);
    req.set_rank(rank_);
    v1::KeyValueGetResponse resp;
    grpc::ClientContext ctx;
    // The server enforces `timeout`; the RPC deadline only bounds a lost server.
    ctx.set_deadline(std::chrono::system_clock::now() + timeout + std::chrono::seconds(30));
    grpc::Status s = stub_->Get(&ctx, req, &resp);
    if (!s.ok()) {
      return FromGrpc(s, absl::StrCat("key-value Get for job \"", job_id_, "\""), target_);
    }
    if (static_cast<size_t>(resp.values_size()) != keys.size()) {
      return absl::InternalError(
          absl::StrCat("key-value Get via ", target_, ": asked for ", keys.size(), " keys, got ",
                       resp.values_size(), " values; check the sidecar and coordinator versions"));
    }
    return std::vector<std::string>(resp.values().begin(), resp.values().end());
  }

 private:
  std::unique_ptr<v1::KeyValueService::Stub> stub_;
  const std::string target_;
  const std::string job_id_;
  const std::string token_;
  const int rank_;
};

}  // namespace

std::unique_ptr<KeyValueStore> MakeGrpcKeyValueStore(std::shared_ptr<grpc::Channel> channel,
                                                     std::string target, std::string job_id,
                                                     std::string token, int rank) {
  return std::make_unique<GrpcKeyValueStore>(std::move(channel), std::move(target),
                                             std::move(job_id), std::move(token), rank);
}

}  // namespace accord
