#include "daemon/sidecar/grpc_sidecar.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "daemon/common/auth_tokens.h"
#include "daemon/common/backoff.h"
#include "daemon/common/queued_stream_reactor.h"

namespace accord::daemon {
namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// What to check next for a failed coordinator stream.
std::string UpstreamHint(const grpc::Status& status) {
  const std::string& m = status.error_message();
  if (absl::StrContains(m, "CERTIFICATE_VERIFY_FAILED") || absl::StrContains(m, "certificate") ||
      absl::StrContains(m, "Handshake") || absl::StrContains(m, "handshake") ||
      absl::StrContains(m, "SSL") || absl::StrContains(m, "ssl")) {
    return ". TLS handshake with the coordinator failed: check that --tls_ca holds the CA that "
           "signed the coordinator's certificate, that the certificate's SANs cover the host in "
           "--coordinator, and that --tls_cert/--tls_key are given (signed by the coordinator's "
           "--tls_ca) when it requires client certificates";
  }
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      return ". Check --coordinator, that the coordinator runs, and that both sides agree on TLS "
             "(a TLS coordinator needs --tls_ca here; a plaintext one needs no --tls_* flags)";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return ". A message exceeded a size limit: raise --max_message_bytes on the coordinator "
             "and the sidecar";
    case grpc::StatusCode::PERMISSION_DENIED:
      return ". Check the job token (--token_file / ACCORD_TOKEN) against the coordinator's "
             "--tokens_file";
    default:
      return "";
  }
}

}  // namespace

class RankSessionReactor final : public QueuedStreamReactor<v1::RankMessage, v1::RankReply>,
                                 public RankSink {
 public:
  RankSessionReactor(RankGrpcService* service, bool refuse, const std::string& peer)
      : service_(service), sidecar_(service->sidecar_) {
    SetWriteQueueLimits(service->queue_limits_, absl::StrCat("the rank process at ", peer));
    if (refuse) {
      FinishNow(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the sidecar is shutting down"));
      return;
    }
    id_ = sidecar_->OpenRank(this);
    StartRead(&in_);
  }

  // Nothing is written after Close: the error reply queued before it is the
  // last message the rank sees.
  void Send(std::shared_ptr<const v1::RankReply> reply) override {
    Enqueue(std::move(reply), /*after_end=*/false);
  }

  void Close(const absl::Status& status) override { EndAfterWrites(ToGrpc(status)); }

  void FinishSoon() { Close(absl::UnavailableError("the sidecar is shutting down")); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      sidecar_->CloseRank(id_);
      ReadEnded();
      return;
    }
    sidecar_->HandleRankMessage(id_, in_);
    if (EndRequested()) {
      // The sidecar closed this rank (its error reply is queued): stop
      // reading; the stream ends once the reply is written.
      sidecar_->CloseRank(id_);
      ReadEnded();
      return;
    }
    StartRead(&in_);
  }

  void OnDone() override {
    service_->Remove(this);
    delete this;
  }

 private:
  RankGrpcService* const service_;
  RankSessionHandler* const sidecar_;
  RankSessionHandler::SessionId id_ = 0;
  v1::RankMessage in_;
};

grpc::ServerBidiReactor<v1::RankMessage, v1::RankReply>* RankGrpcService::Session(
    grpc::CallbackServerContext* context) {
  accord::MutexLock l(&mu_);
  auto* r = new RankSessionReactor(this, shutting_down_, context->peer());
  live_.insert(r);
  return r;
}

void RankGrpcService::Remove(RankSessionReactor* r) {
  accord::MutexLock l(&mu_);
  live_.erase(r);
}

void RankGrpcService::FinishAll() {
  accord::MutexLock l(&mu_);
  shutting_down_ = true;
  for (RankSessionReactor* r : live_) r->FinishSoon();
}

grpc::Status KeyValueForwarder::CheckToken(const std::string& job_id,
                                           const std::string& token) const {
  if (token_.empty() || token.empty() || TokensEqual(token, token_)) return grpc::Status::OK;
  ACCORD_LOG(WARNING) << "permission denied: job " << job_id
                      << ": key-value request with a token that is not this sidecar's";
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat("job ", job_id,
                                   ": key-value request carries a token that is not the one this "
                                   "sidecar holds; check ACCORD_TOKEN of the rank"));
}

namespace {

// How long an ending upstream call (GrpcUpstream::Reconnect) waits, once
// half-closed, for the coordinator to finish it before it is cancelled.
constexpr absl::Duration kEndBound = absl::Seconds(1);

// One key-value call forwarded upstream. Sent again while the coordinator is
// unreachable (restarting, or the link to it cut), until the call's deadline:
// wait_for_ready holds each attempt until the channel is up, and a call cut
// mid-way (UNAVAILABLE) is sent again. Both calls are idempotent (a key is
// write-once per run), so resending one the coordinator may have seen is
// safe. docs/RELIABILITY.md, "Chaos". While the node above does not answer,
// an attempt waits at most until it counts as lost (UpstreamHealth), and the
// call then ends with the loss's words, as the job's ranks were told.
//
// That ending carries the trailing metadata wire::kLostAboveMetadataKey, so a forwarder
// one tier below (a sidecar behind a relay) takes it as the answer it is
// and passes it on at once, instead of reading UNAVAILABLE as its own node
// above not answering and sending the call again until its deadline. The
// loss's words, and an upstream error marked wire::kJobVerdictMetadataKey,
// go down marked as the job's verdict, which the client reports unprefixed.
template <typename Request, typename Response>
struct ForwardedCall {
  Request request;
  Response* response = nullptr;
  grpc::CallbackServerContext* server_context = nullptr;
  grpc::ServerUnaryReactor* reactor = nullptr;
  absl::Time deadline;
  absl::Time wait_until = absl::InfinitePast();  // a Get's own wait ends here
  std::shared_ptr<grpc::ClientContext> context;  // shared with Calls::live
  std::shared_ptr<KeyValueForwarder::Calls> calls;
};

// Nothing above answers while the channel is not up (restarting, killed,
// cut), even before the node's stream, which retries after its backoff, says
// so: an attempt that starts then, and waits for the channel, must end when
// the node above counts as lost, not at the call's own deadline (else a Get
// that starts just after the coordinator is gone for good waits past the loss
// limit the job's other ranks end at). Any answer from above clears it.
void NoteUnansweredIfChannelDown(KeyValueForwarder::Calls& calls, absl::Time now) {
  if (calls.health != nullptr && calls.channel != nullptr &&
      calls.channel->GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_READY) {
    calls.health->NoteUnanswered(now);
  }
}

template <typename Request, typename Response, typename Start>
void Forward(std::shared_ptr<ForwardedCall<Request, Response>> c, Start start) {
  KeyValueForwarder::Calls& calls = *c->calls;
  const absl::Time now = absl::Now();
  NoteUnansweredIfChannelDown(calls, now);
  const absl::Time lost_at =
      calls.health != nullptr ? calls.health->LostAt() : absl::InfiniteFuture();
  if (now >= lost_at) {
    c->server_context->AddTrailingMetadata(wire::kLostAboveMetadataKey, "1");
    c->server_context->AddTrailingMetadata(wire::kJobVerdictMetadataKey, "1");
    c->reactor->Finish(
        grpc::Status(grpc::StatusCode::UNAVAILABLE,
                     UpstreamHealth::LostMessage(c->request.job_id(), calls.health->limit())));
    return;
  }
  const absl::Time attempt_deadline = std::min(c->deadline, lost_at);
  c->context = std::make_shared<grpc::ClientContext>();
  c->context->set_deadline(absl::ToChronoTime(attempt_deadline));
  c->context->set_wait_for_ready(true);
  if constexpr (std::is_same_v<Request, v1::KeyValueGetRequest>) {
    c->request.set_timeout_ms(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(c->wait_until - absl::Now())));
  }
  {
    accord::MutexLock l(&calls.mu);
    if (calls.stopping) {
      c->reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the sidecar is stopping"));
      return;
    }
    calls.live.insert(c->context);
  }
  start(c->context.get(), &c->request, c->response, [c, start, attempt_deadline](grpc::Status s) {
    KeyValueForwarder::Calls& calls = *c->calls;
    bool stopping;
    {
      accord::MutexLock l(&calls.mu);
      calls.live.erase(c->context);
      stopping = calls.stopping;
    }
    const absl::Time now = absl::Now();
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE &&
        c->context->GetServerTrailingMetadata().count(wire::kLostAboveMetadataKey) != 0) {
      // The node above answered: the coordinator above it is lost.
      if (calls.health != nullptr) calls.health->NoteAnswered();
      c->server_context->AddTrailingMetadata(wire::kLostAboveMetadataKey, "1");
      c->server_context->AddTrailingMetadata(wire::kJobVerdictMetadataKey, "1");
      c->reactor->Finish(s);
      return;
    }
    const bool unanswered = s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                            (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                             now >= attempt_deadline && attempt_deadline < c->deadline);
    if (calls.health != nullptr) {
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
        calls.health->NoteUnanswered(now);
      } else if (!unanswered && s.error_code() != grpc::StatusCode::CANCELLED) {
        calls.health->NoteAnswered();
      }
    }
    if (stopping) {
      c->reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the sidecar is stopping"));
      return;
    }
    if (unanswered && now < c->deadline) {
      c->response->Clear();
      Forward(c, start);  // or ends it with the loss's words
      return;
    }
    if constexpr (std::is_same_v<Request, v1::KeyValueSetRequest>) {
      if (s.ok()) calls.ledger.Note(c->request);  // to set again at a restarted coordinator
    }
    if (c->context->GetServerTrailingMetadata().count(wire::kJobVerdictMetadataKey) != 0) {
      c->server_context->AddTrailingMetadata(wire::kJobVerdictMetadataKey, "1");
    }
    c->reactor->Finish(s);
  });
}

}  // namespace

KeyValueForwarder::KeyValueForwarder(std::shared_ptr<grpc::Channel> coordinator,
                                     std::string only_job, std::string token, absl::Duration slack)
    : channel_(std::move(coordinator)),
      stub_(v1::KeyValueService::NewStub(channel_)),
      only_job_(std::move(only_job)),
      token_(std::move(token)),
      slack_(slack) {
  calls_->channel = channel_;
}

KeyValueForwarder::~KeyValueForwarder() {
  Stop();
  if (watcher_.joinable()) watcher_.join();
}

void KeyValueForwarder::SetJobs(SidecarJobs* jobs) {
  jobs_ = jobs;
  SetRunOf([jobs](const std::string& job_id) -> std::optional<std::string> {
    Sidecar::RunStamp run = jobs->CurrentRun(job_id);
    if (run.job_id != job_id) return std::nullopt;
    return std::move(run.run_id);
  });
}

bool KeyValueForwarder::Live(const std::string& job_id, const std::string& run_id) const {
  if (run_of_ == nullptr) return true;
  const std::optional<std::string> run = run_of_(job_id);
  return run.has_value() && (run_id.empty() || run->empty() || *run == run_id);
}

// The channel is the one the node's stream uses, so a coordinator that
// restarted (or a link that was cut) shows as the channel leaving READY;
// when it is READY again the kept Sets go up again, wait_for_ready, until
// their deadline. Sets are idempotent: a coordinator that kept its keys
// accepts the same value again. docs/RELIABILITY.md, "Keys across a
// coordinator restart".
void KeyValueForwarder::WatchUpstream() {
  grpc_connectivity_state last = channel_->GetState(/*try_to_connect=*/false);
  bool lost = false;                            // left READY since the last time the Sets went up
  std::vector<v1::KeyValueSetRequest> waiting;  // to go up once their run is known
  absl::Time waiting_until = absl::InfinitePast();
  while (true) {
    {
      accord::MutexLock l(&calls_->mu);
      if (calls_->stopping) return;
    }
    const absl::Duration tick = waiting.empty() ? absl::Milliseconds(250) : absl::Milliseconds(50);
    const bool changed = channel_->WaitForStateChange(last, absl::ToChronoTime(absl::Now() + tick));
    if (changed) {
      // A reconnect may be READY again by the time the state is read.
      if (last == GRPC_CHANNEL_READY) lost = true;
      last = channel_->GetState(/*try_to_connect=*/false);
      if (last == GRPC_CHANNEL_READY && lost) {
        lost = false;
        calls_->ledger.Prune(
            [this](const std::string& job, const std::string& run) { return Live(job, run); });
        waiting = calls_->ledger.All();
        waiting_until = absl::Now() + slack_;
        if (!waiting.empty()) {
          ACCORD_LOG(INFO) << "the coordinator's connection is back: setting " << waiting.size()
                           << " key(s) of " << calls_->ledger.scopes()
                           << " run(s) again, in case it restarted and lost them";
        }
      }
    }
    if (waiting.empty()) continue;
    if (absl::Now() >= waiting_until) {
      ACCORD_LOG(WARNING) << waiting.size() << " key(s) not set again: their run was still not "
                          << "known " << absl::FormatDuration(slack_) << " after the connection "
                          << "came back";
      waiting.clear();
      continue;
    }
    SetAgain(&waiting);
  }
}

// A kept Set goes up naming its run, which the node's hello has named
// already, so it joins that run as the hello did. One made before its node
// learned its run waits here until the run is known (and names it
// then; its node and epoch it carries from when it was made): sent without
// it, it would start a run of its own at a coordinator that restarted
// before the node's hello came back. A relay
// names its own run, which is its sidecars' run.
void KeyValueForwarder::SetAgain(std::vector<v1::KeyValueSetRequest>* waiting) {
  std::vector<v1::KeyValueSetRequest> sets;
  for (auto it = waiting->begin(); it != waiting->end();) {
    if (!Live(it->job_id(), it->run_id())) {
      it = waiting->erase(it);
      continue;
    }
    if (it->run_id().empty() && run_of_ != nullptr) {
      it->set_run_id(run_of_(it->job_id()).value_or(""));
      if (it->run_id().empty()) {
        ++it;  // its run is not known yet
        continue;
      }
    }
    sets.push_back(std::move(*it));
    it = waiting->erase(it);
  }
  struct Again {
    v1::KeyValueSetRequest request;
    v1::KeyValueSetResponse response;
    std::shared_ptr<grpc::ClientContext> context = std::make_shared<grpc::ClientContext>();
  };
  for (v1::KeyValueSetRequest& request : sets) {
    auto again = std::make_shared<Again>();
    again->request = std::move(request);
    again->context->set_deadline(absl::ToChronoTime(absl::Now() + slack_));
    again->context->set_wait_for_ready(true);
    {
      accord::MutexLock l(&calls_->mu);
      if (calls_->stopping) return;
      calls_->live.insert(again->context);
    }
    std::shared_ptr<Calls> calls = calls_;
    stub_->async()->Set(
        again->context.get(), &again->request, &again->response, [again, calls](grpc::Status s) {
          {
            accord::MutexLock l(&calls->mu);
            calls->live.erase(again->context);
          }
          if (again->context->GetServerTrailingMetadata().count(wire::kJobVerdictMetadataKey) !=
              0) {
            // The run is over: nothing of it to keep.
            calls->ledger.Forget(again->request.job_id(), again->request.run_id());
          } else if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED) {
            ACCORD_LOG(WARNING) << "setting key \"" << again->request.key() << "\" of job "
                                << again->request.job_id()
                                << " again failed: " << s.error_message();
          }
        });
  }
}

void KeyValueForwarder::Stop() {
  std::vector<std::shared_ptr<grpc::ClientContext>> live;
  {
    accord::MutexLock l(&calls_->mu);
    calls_->stopping = true;
    live.assign(calls_->live.begin(), calls_->live.end());
  }
  // Outside the lock: a cancelled call's callback takes it.
  for (const auto& ctx : live) ctx->TryCancel();
}

template <typename Request>
void KeyValueForwarder::Stamp(Request* request) const {
  if (jobs_ == nullptr) return;
  Sidecar::RunStamp run = jobs_->CurrentRun(request->job_id());
  if (run.job_id.empty() || run.job_id != request->job_id()) return;
  request->set_run_id(run.run_id);
  request->set_node_id(run.node_id);
  request->set_node_epoch(run.node_epoch);
}

grpc::ServerUnaryReactor* KeyValueForwarder::Set(grpc::CallbackServerContext* context,
                                                 const v1::KeyValueSetRequest* request,
                                                 v1::KeyValueSetResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!only_job_.empty() && request->job_id() != only_job_) {
    reactor->Finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                 absl::StrCat("this sidecar serves job ", only_job_, " only")));
    return reactor;
  }
  if (grpc::Status s = CheckToken(request->job_id(), request->token()); !s.ok()) {
    reactor->Finish(s);
    return reactor;
  }
  // The watcher starts with the first Set, once SetJobs/SetRunOf are done.
  std::call_once(watch_once_, [this] { watcher_ = std::thread([this] { WatchUpstream(); }); });
  // Keeps only the runs still served here (their keys may be set again).
  calls_->ledger.Prune(
      [this](const std::string& job, const std::string& run) { return Live(job, run); });
  // The upstream request owns a copy carrying the sidecar's token.
  auto call = std::make_shared<ForwardedCall<v1::KeyValueSetRequest, v1::KeyValueSetResponse>>();
  call->request = *request;
  if (!token_.empty()) call->request.set_token(token_);
  Stamp(&call->request);
  call->response = response;
  call->server_context = context;
  call->reactor = reactor;
  call->calls = calls_;
  call->deadline = absl::Now() + slack_;
  v1::KeyValueService::Stub* stub = stub_.get();
  Forward(call, [stub](grpc::ClientContext* ctx, const v1::KeyValueSetRequest* req,
                       v1::KeyValueSetResponse* resp, std::function<void(grpc::Status)> done) {
    stub->async()->Set(ctx, req, resp, std::move(done));
  });
  return reactor;
}

grpc::ServerUnaryReactor* KeyValueForwarder::Get(grpc::CallbackServerContext* context,
                                                 const v1::KeyValueGetRequest* request,
                                                 v1::KeyValueGetResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!only_job_.empty() && request->job_id() != only_job_) {
    reactor->Finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                 absl::StrCat("this sidecar serves job ", only_job_, " only")));
    return reactor;
  }
  if (grpc::Status s = CheckToken(request->job_id(), request->token()); !s.ok()) {
    reactor->Finish(s);
    return reactor;
  }
  auto call = std::make_shared<ForwardedCall<v1::KeyValueGetRequest, v1::KeyValueGetResponse>>();
  call->request = *request;
  if (!token_.empty()) call->request.set_token(token_);
  Stamp(&call->request);
  call->response = response;
  call->server_context = context;
  call->reactor = reactor;
  call->calls = calls_;
  call->wait_until = absl::Now() + absl::Milliseconds(std::max<int64_t>(0, request->timeout_ms()));
  call->deadline = call->wait_until + slack_;
  v1::KeyValueService::Stub* stub = stub_.get();
  Forward(call, [stub](grpc::ClientContext* ctx, const v1::KeyValueGetRequest* req,
                       v1::KeyValueGetResponse* resp, std::function<void(grpc::Status)> done) {
    stub->async()->Get(ctx, req, resp, std::move(done));
  });
  return reactor;
}

GrpcUpstream::GrpcUpstream(std::shared_ptr<grpc::Channel> channel, UpstreamHandler* handler,
                           absl::Duration max_backoff)
    : stub_(v1::CoordinatorService::NewStub(channel)),
      handler_(handler),
      max_backoff_(max_backoff) {}

GrpcUpstream::~GrpcUpstream() { Stop(); }

void GrpcUpstream::Start() {
  reader_ = std::thread([this] { ReadLoop(); });
  writer_ = std::thread([this] { WriteLoop(); });
}

void GrpcUpstream::Stop() {
  {
    accord::MutexLock l(&mu_);
    // What is queued (a last rank's leave) is written and the call ended
    // first, within a bound.
    if (!stopping_ && call_.stream != nullptr) {
      call_.ending = true;
      AwaitCallEndLocked(call_.id, 2 * kEndBound);
    }
    stopping_ = true;
    if (call_.context != nullptr) call_.context->TryCancel();
  }
  if (reader_.joinable()) reader_.join();
  if (writer_.joinable()) writer_.join();
}

void GrpcUpstream::Send(v1::NodeMessage message) {
  accord::MutexLock l(&mu_);
  if (!connected_) return;  // resent by OnUpstreamConnected
  queue_.push_back(std::move(message));
}

void GrpcUpstream::Reset(std::vector<v1::NodeMessage> messages) {
  accord::MutexLock l(&mu_);
  queue_.clear();
  for (v1::NodeMessage& m : messages) queue_.push_back(std::move(m));
}

// The call ends after what was queued for it (a rank's leave, say) is
// written: cancelling at once could drop it at the coordinator.
void GrpcUpstream::Reconnect() {
  accord::MutexLock l(&mu_);
  reconnect_requested_ = true;
  if (call_.context != nullptr) call_.ending = true;
}

void GrpcUpstream::EndCallLocked() {
  const uint64_t id = call_.id;
  auto* stream = call_.stream;
  call_.half_closed = true;
  call_.writing = true;
  mu_.Unlock();
  const bool ok = stream->WritesDone();
  mu_.Lock();
  call_.writing = false;
  // The coordinator finishes the stream once it has read it to the end.
  if (!ok || !AwaitCallEndLocked(id, kEndBound)) {
    if (call_.id == id && call_.context != nullptr) call_.context->TryCancel();
  }
}

bool GrpcUpstream::AwaitCallEndLocked(uint64_t id, absl::Duration bound) {
  auto ended = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || call_.id != id || call_.context == nullptr;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&ended), bound);
}

void GrpcUpstream::WriteLoop() {
  accord::MutexLock l(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](GrpcUpstream* u) ABSL_EXCLUSIVE_LOCKS_REQUIRED(u->mu_) {
          return u->stopping_ || (u->call_.stream != nullptr && !u->call_.half_closed &&
                                  (!u->queue_.empty() || u->call_.ending));
        },
        this));
    if (stopping_) return;
    if (queue_.empty()) {
      EndCallLocked();
      continue;
    }
    v1::NodeMessage m = std::move(queue_.front());
    queue_.pop_front();
    auto* stream = call_.stream;
    call_.writing = true;
    mu_.Unlock();
    const bool ok = stream->Write(m);
    mu_.Lock();
    call_.writing = false;
    if (!ok && call_.context != nullptr) call_.context->TryCancel();
  }
}

void GrpcUpstream::ReadLoop() {
  ReconnectBackoff backoff(absl::Milliseconds(100), max_backoff_);
  while (true) {
    auto context = std::make_unique<grpc::ClientContext>();
    {
      accord::MutexLock l(&mu_);
      if (stopping_) return;
      call_ = Call{call_.id + 1, context.get()};
    }
    std::unique_ptr<grpc::ClientReaderWriter<v1::NodeMessage, v1::CoordinatorMessage>> stream =
        stub_->Session(context.get());
    {
      accord::MutexLock l(&mu_);
      connected_ = true;
      queue_.clear();
    }
    handler_->OnUpstreamConnected();
    {
      accord::MutexLock l(&mu_);
      call_.stream = stream.get();
    }
    v1::CoordinatorMessage in;
    bool got_any = false;
    while (stream->Read(&in)) {
      got_any = true;
      handler_->HandleCoordinatorMessage(&in);
    }
    {
      accord::MutexLock l(&mu_);
      connected_ = false;
      call_.context->TryCancel();
      mu_.Await(absl::Condition(
          +[](GrpcUpstream* u) ABSL_EXCLUSIVE_LOCKS_REQUIRED(u->mu_) { return !u->call_.writing; },
          this));
      call_ = Call{call_.id};
      queue_.clear();
    }
    grpc::Status status = stream->Finish();
    if (got_any) backoff.Reset();
    accord::MutexLock l(&mu_);
    if (stopping_) return;
    if (reconnect_requested_) {
      // Ended on purpose (the node's job ended): the next job's stream
      // starts at once, not after a failure backoff.
      reconnect_requested_ = false;
      continue;
    }
    const absl::Duration wait = backoff.Next();
    ACCORD_LOG(WARNING) << "coordinator stream ended (" << status.error_message() << ")"
                        << UpstreamHint(status) << "; reconnecting in "
                        << absl::FormatDuration(wait);
    // Interruptible wait: Stop() sets stopping_.
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), wait);
  }
}

}  // namespace accord::daemon
