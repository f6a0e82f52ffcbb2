#include "client/grpc_kv_store.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "accord/v1/accord.grpc.pb.h"
#include "core/members.h"
#include "grpcpp/client_context.h"
#include "proto/wire.h"

namespace accord {
namespace {

// `verdict`: the error is the job's verdict (wire::kJobVerdictMetadataKey),
// reported in the words every rank of the run gets; any other error is this
// call's, said with the call and the sidecar it went to.
absl::Status FromGrpc(const grpc::Status& s, bool verdict, absl::string_view what,
                      absl::string_view target) {
  if (s.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(s.error_code());
  if (verdict) return absl::Status(code, s.error_message());
  return absl::Status(code, absl::StrCat(what, " via ", target, ": ", s.error_message()));
}

// A call refused for the lost coordinator (wire::kLostAboveMetadataKey) is
// marked a verdict too, by the daemon that refuses it.
bool IsJobVerdict(const grpc::ClientContext& ctx) {
  return ctx.GetServerTrailingMetadata().count(wire::kJobVerdictMetadataKey) != 0;
}

class GrpcKeyValueStore : public KeyValueStore {
 public:
  GrpcKeyValueStore(std::shared_ptr<grpc::Channel> channel, std::string target, std::string job_id,
                    std::string token, int rank, int world_size,
                    std::function<absl::Status()> session_over)
      : stub_(v1::KeyValueService::NewStub(channel)),
        target_(std::move(target)),
        job_id_(std::move(job_id)),
        token_(std::move(token)),
        rank_(rank),
        world_size_(world_size),
        session_over_(std::move(session_over)) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    v1::KeyValueSetRequest req;
    req.set_job_id(job_id_);
    req.set_key(key);
    req.set_value(value);
    req.set_token(token_);
    req.set_rank(rank_);
    v1::KeyValueSetResponse resp;
    bool verdict = false;
    const grpc::Status s = Retried(kCallBound, &verdict, [&](grpc::ClientContext& ctx) {
      return stub_->Set(&ctx, req, &resp);
    });
    if (absl::Status over = SidecarGone(s, verdict); !over.ok()) return over;
    return FromGrpc(s, verdict,
                    absl::StrCat("key-value Set(\"", key, "\") for job \"", job_id_, "\""),
                    target_);
  }

  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               std::chrono::milliseconds timeout) override {
    return Send(keys, timeout, nullptr);
  }

  absl::StatusOr<std::vector<std::string>> GetAmong(const std::vector<std::string>& keys,
                                                    std::chrono::milliseconds timeout,
                                                    const std::vector<int>& expected) override {
    absl::StatusOr<std::shared_ptr<const MemberSet>> set = MembersOf(expected, world_size_);
    if (!set.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "key-value Get for job \"", job_id_, "\": expected ranks: ", set.status().message()));
    }
    return Send(keys, timeout, set->get());
  }

 private:
  // One Get; `expected` null: every rank of the job.
  absl::StatusOr<std::vector<std::string>> Send(const std::vector<std::string>& keys,
                                                std::chrono::milliseconds timeout,
                                                const MemberSet* expected) {
    v1::KeyValueGetRequest req;
    if (expected != nullptr) *req.mutable_expected() = wire::MembersToProto(*expected);
    req.set_job_id(job_id_);
    for (const std::string& k : keys) req.add_keys(k);
    req.set_timeout_ms(timeout.count());
    req.set_token(token_);
    req.set_rank(rank_);
    v1::KeyValueGetResponse resp;
    bool verdict = false;
    // The server enforces `timeout`; the call's bound only bounds a lost server.
    const absl::Duration bound = absl::FromChrono(timeout) + kCallBound;
    grpc::Status s = Retried(
        bound, &verdict, [&](grpc::ClientContext& ctx) { return stub_->Get(&ctx, req, &resp); });
    if (absl::Status over = SidecarGone(s, verdict); !over.ok()) return over;
    if (!s.ok()) {
      return FromGrpc(s, verdict, absl::StrCat("key-value Get for job \"", job_id_, "\""), target_);
    }
    if (static_cast<size_t>(resp.values_size()) != keys.size()) {
      return absl::InternalError(
          absl::StrCat("key-value Get via ", target_, ": asked for ", keys.size(), " keys, got ",
                       resp.values_size(), " values; check the sidecar and coordinator versions"));
    }
    return std::vector<std::string>(resp.values().begin(), resp.values().end());
  }

  // The session's words when `s` is an unreachable sidecar the session has
  // given up on; OK otherwise.
  absl::Status SidecarGone(const grpc::Status& s, bool verdict) const {
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE || verdict) return absl::OkStatus();
    return session_over_();
  }

  // How long a call may wait for a sidecar that does not answer, beyond the
  // wait the call asks the server for.
  static constexpr absl::Duration kCallBound = absl::Seconds(30);

  // Runs `call` (on a fresh context each time, every attempt within `bound`
  // of the first) again while it finds the sidecar unreachable and the
  // session still counts on the sidecar, with backoff. Sets `*verdict` when
  // the answer is the job's verdict.
  template <typename Call>
  grpc::Status Retried(absl::Duration bound, bool* verdict, Call call) {
    const absl::Time give_up = absl::Now() + bound;
    absl::Duration backoff = absl::Milliseconds(50);
    while (true) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(give_up));
      grpc::Status s = call(ctx);
      *verdict = IsJobVerdict(ctx);
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE || *verdict ||
          absl::Now() + backoff >= give_up || !session_over_().ok()) {
        return s;  // an answer (the node above the sidecar is lost), or the sidecar is gone
      }
      absl::SleepFor(backoff);  // a retry's backoff, not a synchronisation
      backoff = std::min(backoff * 2, absl::Seconds(1));
    }
  }

  std::unique_ptr<v1::KeyValueService::Stub> stub_;
  const std::string target_;
  const std::string job_id_;
  const std::string token_;
  const int rank_;
  const int world_size_;
  const std::function<absl::Status()> session_over_;
};

}  // namespace

std::unique_ptr<KeyValueStore> MakeGrpcKeyValueStore(std::shared_ptr<grpc::Channel> channel,
                                                     std::string target, std::string job_id,
                                                     std::string token, int rank, int world_size,
                                                     std::function<absl::Status()> session_over) {
  return std::make_unique<GrpcKeyValueStore>(std::move(channel), std::move(target),
                                             std::move(job_id), std::move(token), rank, world_size,
                                             std::move(session_over));
}

}  // namespace accord
