// GrpcClient's connection: the stream's writer and reader, the hello, the
// resume and the reconnects. The phases and what follows a stream's end are
// ClientConnection's (client/connection.h); this file performs them.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/grpc_client.h"
#include "core/log.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/wire.h"

namespace accord {
namespace {

constexpr char kClientVersion[] = "accord-client/0.1.0";

// A stream's channel: a connection attempt (the socket's connect and the
// sidecar's HTTP/2 settings) ends within a second instead of gRPC's 20 s, so
// an attempt that finds a sidecar stopped ends in time for the next one, or
// for the reconnect grace.
std::shared_ptr<grpc::Channel> SessionChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

}  // namespace

v1::RankMessage GrpcClient::AdapterCountsMessage(const AdapterCounts& counts) {
  v1::RankMessage msg;
  v1::AdapterCounts* c = msg.mutable_adapter_counts();
  c->set_speculated(counts.speculated);
  c->set_repaired(counts.repaired);
  c->set_redone(counts.redone);
  return msg;
}

bool GrpcClient::CanWriteDirectlyLocked() const {
  return conn_.welcomed() && !writing_ && outbox_.empty() && !conn_.read_ended() &&
         !conn_.stopping();
}

void GrpcClient::WriterLoop() {
  accord::MutexLock lock(&mu_);
  while (true) {
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return (!outbox_.empty() && !writing_) || conn_.read_ended() || conn_.stopping();
    };
    mu_.Await(absl::Condition(&ready));
    if (conn_.read_ended() || conn_.stopping()) break;
    v1::RankMessage msg = std::move(outbox_.front());
    outbox_.pop_front();
    writing_ = true;
    mu_.Unlock();
    const bool ok = stream_.rw->Write(msg);
    mu_.Lock();
    writing_ = false;
    if (!ok) break;  // the reader sees the stream end
    RecycleBatchLocked(&msg);
  }
  conn_.WriterStopped();
}

v1::RankMessage GrpcClient::HelloLocked(bool resume) {
  v1::RankMessage hello;
  v1::RankHello* h = hello.mutable_hello();
  h->set_job_id(options_.job_id);
  h->set_rank(options_.rank);
  h->set_world_size(options_.world_size);
  h->set_local_rank(options_.local_rank);
  h->set_token(options_.token);
  h->set_client_version(kClientVersion);
  h->set_reconnects(options_.reconnect_grace > absl::ZeroDuration());
  h->set_launch_id(options_.launch_id);
  if (resume) {
    v1::RankResume* r = h->mutable_resume();
    r->set_run_id(conn_.run_id());
    r->set_node_epoch(conn_.node_epoch());
    r->set_holds_local_decisions(conn_.holds_local_decisions());
    for (const std::string& id : groups_.order) {
      v1::GroupResume* gr = r->add_groups();
      gr->set_group_id(id);
      gr->set_decided_step(groups_.by_id.find(id)->second.decided_step);
    }
  }
  return hello;
}

void GrpcClient::OpenStreamLocked() {
  stream_.channel = SessionChannel(absl::StrCat("unix:", options_.socket_path));
  stream_.stub = v1::RankService::NewStub(stream_.channel);
  stream_.ctx = std::make_unique<grpc::ClientContext>();
  // The hello goes with the first write, on the writer's thread: creating
  // the stream then never waits for a connection (gRPC waits up to 20 s for
  // a sidecar that accepts but does not answer, a stopped one), so neither
  // the connect timeout nor this lock depends on gRPC's.
  stream_.ctx->set_initial_metadata_corked(true);
  if (conn_.stopping()) stream_.ctx->TryCancel();
  stream_.rw = stream_.stub->Session(stream_.ctx.get());
  conn_.StreamOpened();
}

void GrpcClient::QueueResumeLocked() {
  outbox_.clear();
  outbox_.push_back(HelloLocked(/*resume=*/true));
  struct Resend {
    int64_t step;
    size_t order;
    const std::string* group_id;
    const Pending* pending;
  };
  std::vector<Resend> resend;
  for (size_t i = 0; i < groups_.order.size(); ++i) {
    GroupState& g = groups_.by_id.find(groups_.order[i])->second;
    if (g.reg == RegState::kFailed) continue;
    v1::RankMessage reg;
    *reg.mutable_registration() = wire::GroupSpecToProto(g.spec, g.policy);
    outbox_.push_back(std::move(reg));
    // The new sidecar knows no previous content: repeats start again.
    g.last_key.reset();
    for (const Pending& p : g.pending) resend.push_back(Resend{p.step, i, &groups_.order[i], &p});
  }
  if (facts_.adapter_counts.has_value())
    outbox_.push_back(AdapterCountsMessage(*facts_.adapter_counts));
  if (resend.empty()) return;
  std::sort(resend.begin(), resend.end(), [](const Resend& a, const Resend& b) {
    return a.step != b.step ? a.step < b.step : a.order < b.order;
  });
  v1::RankMessage batch;
  Manifest m;
  m.ranks = RankSet(options_.world_size);
  m.ranks.Add(options_.rank);
  for (const Resend& r : resend) {
    m.step = r.step;
    m.dtypes = *r.pending->content;
    wire::ManifestToProto(*r.group_id, m, /*with_ranks=*/false,
                          batch.mutable_manifests()->add_manifests());
  }
  outbox_.push_back(std::move(batch));
}

void GrpcClient::SessionLoop() {
  while (true) {
    std::thread writer([this] { WriterLoop(); });
    v1::RankReply reply;
    while (stream_.rw->Read(&reply)) HandleReply(reply);
    {
      accord::MutexLock lock(&mu_);
      conn_.ReadEnded();
      // Finish must not overlap a write: the writer's or a caller's.
      auto writes_over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return conn_.stream_phase() == ClientConnection::StreamPhase::kOver && !writing_;
      };
      mu_.Await(absl::Condition(&writes_over));
    }
    writer.join();
    const grpc::Status s = stream_.rw->Finish();
    accord::MutexLock lock(&mu_);
    if (!NextStreamLocked(s)) return;
  }
}

bool GrpcClient::NextStreamLocked(const grpc::Status& s) {
  ClientConnection::StreamEnd end;
  end.ok = s.ok();
  end.unavailable = s.error_code() == grpc::StatusCode::UNAVAILABLE;
  end.message = s.error_message();
  const ClientConnection::AfterEnd after = conn_.StreamEnded(end, absl::Now());
  if (after.first_miss) {
    ACCORD_LOG(INFO) << "rank " << options_.rank << ": no sidecar answers at "
                     << options_.socket_path << " yet (" << s.error_message()
                     << "); trying again until the connect timeout";
  }
  if (after.lost) {
    ACCORD_LOG(WARNING) << "rank " << options_.rank << ": the stream to the sidecar at "
                        << options_.socket_path << " ended"
                        << (s.ok() ? std::string() : absl::StrCat(": ", s.error_message()))
                        << "; reconnecting for up to "
                        << absl::FormatDuration(options_.reconnect_grace);
  }
  if (after.close.has_value()) {
    FailAllLocked(*after.close);
    return false;
  }
  auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return conn_.stopping(); };
  mu_.AwaitWithDeadline(absl::Condition(&stop), after.retry_at);
  const ClientConnection::Next next = conn_.RetryDue(absl::Now());
  if (next.close.has_value()) {
    FailAllLocked(*next.close);
    return false;
  }
  OpenStreamLocked();
  if (next.resume) {
    QueueResumeLocked();
  } else {
    outbox_.clear();
    outbox_.push_back(HelloLocked(/*resume=*/false));
  }
  return true;
}

void GrpcClient::HandleReply(const v1::RankReply& reply) {
  accord::MutexLock lock(&mu_);
  switch (reply.body_case()) {
    case v1::RankReply::kWelcome:
      HandleWelcomeLocked(reply.welcome());
      break;
    case v1::RankReply::kRegistration:
      HandleRegistrationLocked(reply.registration());
      break;
    case v1::RankReply::kDecisions: {
      // Every future of the reply completes under one lock of the hub.
      accord::MutexLock hub_lock(&hub_->mu);
      for (const v1::Decision& d : reply.decisions().decisions()) HandleDecisionLocked(d);
      break;
    }
    case v1::RankReply::kError:
      HandleErrorLocked(reply.error());
      break;
    case v1::RankReply::BODY_NOT_SET:
      ACCORD_LOG(WARNING) << "empty reply from the sidecar at " << options_.socket_path
                          << "; ignored";
      break;
  }
}

void GrpcClient::HandleWelcomeLocked(const v1::Welcome& w) {
  facts_.welcome_members = w.members();
  const std::optional<absl::Duration> resumed_after =
      conn_.Welcomed(w.node_id(), w.run_id(), w.node_epoch(), absl::Now());
  if (resumed_after.has_value()) {
    ACCORD_LOG(INFO) << "rank " << options_.rank << ": resumed with the sidecar at "
                     << options_.socket_path << " after " << absl::FormatDuration(*resumed_after);
  }
}

void GrpcClient::HandleErrorLocked(const v1::DecisionError& e) {
  NoteVerdictLocked(e);
  absl::Status s = wire::ErrorToStatus(e);
  if (s.ok()) s = absl::UnknownError("the sidecar sent an error without a code");
  // An error about one group (and step) completes only what it names.
  if (!e.group_id().empty()) {
    auto it = groups_.by_id.find(e.group_id());
    if (it != groups_.by_id.end()) {
      GroupState& g = it->second;
      auto p = FindPending(g, e.step());
      if (p != g.pending.end()) {
        p->state->Complete(s);
        g.decided_step = std::max(g.decided_step, e.step());
        g.pending.erase(p);
        return;
      }
      if (g.reg == RegState::kPending) {
        g.reg = RegState::kFailed;
        g.reg_status = s;
        return;
      }
    }
  }
  if (conn_.reconnecting() && e.kind() == v1::DUPLICATE_RANK) {
    // The sidecar has not yet seen this rank's previous stream end: the
    // next attempt of the resume goes through.
    ACCORD_LOG(INFO) << "rank " << options_.rank << ": " << s << "; trying again";
    return;
  }
  ACCORD_LOG(ERROR) << "rank " << options_.rank << ": " << s;
  conn_.FatalError(s);
  FailAllLocked(s);
}

}  // namespace accord
