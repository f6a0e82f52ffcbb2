#include "daemon/coordinator/coordinator.h"

#include <algorithm>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/log.h"
#include "daemon/common/decision_errors.h"
#include "daemon/common/node_hello.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

constexpr char kServerVersion[] = "accord-coordinator/0.1";

// Errors (docs/ARCHITECTURE.md, "Errors"): the builders of
// daemon/common/decision_errors.h, with the job, group and step they are
// about. None pairs a kind with a code by hand.
v1::DecisionError Located(v1::DecisionError e, absl::string_view job_id, absl::string_view group_id,
                          int64_t step) {
  e.set_job_id(std::string(job_id));
  e.set_group_id(std::string(group_id));
  e.set_step(step);
  return e;
}

// An error of `kind` with the kind's canonical code (wire::CodeOfKind).
v1::DecisionError Error(v1::ErrorKind kind, absl::string_view message,
                        absl::string_view job_id = "", absl::string_view group_id = "",
                        int64_t step = -1) {
  return Located(KindedError(kind, message), job_id, group_id, step);
}

// An error caused by a status from a lower layer or a check (a registration
// or manifest that does not convert, a decision core Decide refused, a
// refused NodeHello): keeps the cause's code and message (after `context`),
// and its kind unless `kind` is given.
v1::DecisionError ErrorFrom(v1::ErrorKind kind, const absl::Status& cause,
                            absl::string_view context, absl::string_view job_id = "",
                            absl::string_view group_id = "", int64_t step = -1) {
  return Located(ErrorFromStatus(kind, cause, context), job_id, group_id, step);
}

// A well-formed request the stream's state does not allow (before NodeHello,
// a second hello, a repeat the coordinator cannot resolve): FAILED_PRECONDITION.
v1::DecisionError OutOfOrder(v1::ErrorKind kind, absl::string_view message,
                             absl::string_view job_id = "", absl::string_view group_id = "",
                             int64_t step = -1) {
  return Located(OutOfOrderError(kind, message), job_id, group_id, step);
}

// Mixes one node content key into the order-independent combination of a
// step's contributions.
uint64_t MixKey(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return k;
}

}  // namespace

v1::DecisionBatch* Coordinator::Outbox::ReplyBatch(NodeSink* sink) {
  for (auto& [s, msg] : direct) {
    if (s == sink && msg.has_decisions()) return msg.mutable_decisions();
  }
  direct.emplace_back(sink, v1::CoordinatorMessage());
  return direct.back().second.mutable_decisions();
}

namespace {
uint64_t RunSeed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}
}  // namespace

Coordinator::Coordinator(CoordinatorOptions options, Clock* clock)
    : options_(options), clock_(clock), runs_(RunSeed()) {
  int threads = options_.decide_threads;
  if (threads <= 0) threads = std::clamp<int>(std::thread::hardware_concurrency(), 1, 8);
  pool_ = std::make_unique<WorkerPool>(threads);
  if (options_.start_timer_thread) timer_ = std::thread([this] { TimerLoop(); });
}

Coordinator::~Coordinator() { Stop(); }

void Coordinator::Stop() {
  {
    accord::MutexLock l(&mu_);
    stopping_ = true;
    timer_cv_.SignalAll();
  }
  if (timer_.joinable()) timer_.join();
}

void Coordinator::TimerLoop() {
  accord::MutexLock l(&mu_);
  while (!stopping_) {
    if (clock_->Now() >= next_deadline_) {
      mu_.Unlock();
      CheckDeadlines();
      mu_.Lock();
      continue;
    }
    clock_->WaitUntil(&timer_cv_, &mu_, next_deadline_);
  }
}

Coordinator::SessionId Coordinator::OpenSession(NodeSink* sink) {
  accord::MutexLock l(&mu_);
  const SessionId id = next_session_++;
  sessions_[id].sink = sink;
  ++stats_.sessions;
  return id;
}

void Coordinator::CloseSession(SessionId id) {
  CloseSessionWithoutDelivery(id);
  DeliverRunEnds();
  DeliverEvents();
}

void Coordinator::CloseSessionWithoutDelivery(SessionId id) {
  accord::MutexLock l(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  if (it->second.job != nullptr) {
    // Its held-back repeat (if any) counts as sent before the stream ended.
    Outbox out;
    BreakWaveLocked(*it->second.job, out);
    FlushLocked(out);
  }
  Session s = it->second;
  sessions_.erase(it);
  --stats_.sessions;
  if (s.node == nullptr || s.node->session != id) return;
  s.job->members.Disconnect(*s.node, clock_->Now());
  ObserveNodeLocked(*s.job, *s.node, /*connected=*/false);
  if (s.job->members.connected() == 0) {
    ACCORD_LOG(INFO) << "job " << s.job->job_id << ": last node (" << s.node->node_id
                     << ") disconnected; dropping the job's state";
    RemoveJobLocked(s.job);
    return;
  }
  ACCORD_LOG(WARNING) << "job " << s.job->job_id << ": node \"" << s.node->node_id
                      << "\" disconnected; it has "
                      << absl::FormatDuration(options_.node_reconnect_grace)
                      << " (--node_reconnect_grace) to come back before a step that needs its "
                         "ranks fails the job";
  WakeTimerAtLocked(s.node->disconnected_at + options_.node_reconnect_grace);
}

void Coordinator::WakeTimerAtLocked(absl::Time at) {
  if (at < next_deadline_) {
    next_deadline_ = at;
    timer_cv_.SignalAll();
  }
}

bool Coordinator::FailIfNodeLostLocked(Job& job, absl::Time now, absl::Time& next, Outbox& out) {
  if (job.failed() || job.members.all_connected()) return false;
  std::vector<const NodeState*> lost;
  for (const auto& [node_id, node] : job.members.nodes()) {
    if (node.session != 0 || node.disconnected_at == absl::InfiniteFuture()) continue;
    const absl::Time due = node.disconnected_at + options_.node_reconnect_grace;
    if (due <= now) {
      lost.push_back(&node);
    } else {
      next = std::min(next, due);
    }
  }
  if (lost.empty()) return false;
  // The lowest (group, step) that needs a lost node's ranks names the
  // failure, so every run of this test of fate reads the same.
  GroupState* culprit = nullptr;
  int64_t culprit_step = 0;
  const NodeState* culprit_node = nullptr;
  std::vector<int> needed;
  for (auto& [gid, g] : job.groups) {
    if (culprit != nullptr && g.group_id > culprit->group_id) continue;
    for (auto& [step, p] : g.pending) {
      if (culprit == &g && step >= culprit_step) break;
      RankSet covered(job.world_size);
      for (const Contribution& c : p.contributions) covered.Union(*c.content->ranks);
      for (const NodeState* node : lost) {
        std::vector<int> missing;
        for (int r : node->ranks) {
          if (job.members.OwnerOf(r) == node && !covered.Contains(r)) missing.push_back(r);
        }
        if (missing.empty()) continue;
        culprit = &g;
        culprit_step = step;
        culprit_node = node;
        needed = std::move(missing);
        break;
      }
      if (culprit == &g) break;  // pending is ordered: the first step found is the lowest
    }
  }
  if (culprit == nullptr) return false;
  v1::DecisionError err = Error(
      v1::UNAVAILABLE,
      absl::StrCat("job ", job.job_id, " group \"", culprit->group_id, "\" step ", culprit_step,
                   ": node \"", culprit_node->node_id, "\" (ranks ", FormatRanks(needed),
                   ") lost its connection to the coordinator and did not come back within ",
                   absl::FormatDuration(options_.node_reconnect_grace),
                   " (--node_reconnect_grace), so its ranks cannot take part: its sidecar was "
                   "restarted or its host is unreachable, and accord clients do not reconnect "
                   "to a restarted sidecar; restart the job"),
      job.job_id, culprit->group_id, culprit_step);
  for (int r : needed) err.add_ranks(r);
  FailJobLocked(job, culprit, culprit_step, err, out);
  // Every rank gets it at once, also those not waiting for a decision: each
  // sidecar passes a job error to all its ranks and closes them.
  // Without group and step, so a client fails every call with it (the text
  // still names them).
  v1::CoordinatorMessage m;
  *m.mutable_error() = err;
  m.mutable_error()->clear_group_id();
  m.mutable_error()->set_step(-1);
  out.broadcast_other.emplace_back(&job, std::move(m));
  return true;
}

void Coordinator::RemoveJobLocked(Job* job) {
  for (auto& [id, s] : sessions_) {
    if (s.job == job) {
      s.job = nullptr;
      s.node = nullptr;
      s.last_batch = BatchRecord();
    }
  }
  if (!job->groups.empty()) RetireJobLocked(*job);
  // Usage windows not handed to a retired job are freed with the job.
  for (const auto& [group_id, g] : job->groups) stats_.usage_bytes -= g.usage.bytes();
  for (const auto& [node_id, node] : job->members.nodes()) {
    for (const auto& [group_id, ng] : node.groups) {
      stats_.retained_contents -= static_cast<int64_t>(ng.contents.retained());
    }
  }
  const std::string job_id = job->job_id;
  const std::string run_id = job->run_id;
  jobs_.erase(job_id);
  stats_.jobs = static_cast<int64_t>(jobs_.size());
  Run* run = runs_.Find(job_id);
  if (run == nullptr || run->run_id != run_id) return;
  ACCORD_LOG(INFO) << "job " << job_id << " run " << run_id
                   << " ended; its state and keys are dropped";
  // A failed run is never resumed (its late requests get RUN_ENDED); a
  // healthy one whose last node only lost its connection may be (its
  // sidecar's RESUME takes it over, as after a coordinator restart).
  if (run->state == RunState::kFailed) runs_.Remember(job_id, run_id, run->failure);
  runs_.End(job_id, run_id,
            wire::KindError(v1::RUN_ENDED, absl::StrCat("job ", job_id, " run ", run_id,
                                                        " ended: its last node left")));
  stats_.runs = static_cast<int64_t>(runs_.size());
}

Run& Coordinator::StartRunLocked(const std::string& job_id, std::string run_id) {
  Run& run = runs_.Start(job_id, std::move(run_id), clock_->Now());
  stats_.runs = static_cast<int64_t>(runs_.size());
  ACCORD_LOG(INFO) << "job " << job_id << ": run " << run.run_id << " started";
  if (jobs_.find(job_id) == jobs_.end()) {
    // Until a node joins, the run ends at run_start_timeout (the timer).
    WakeTimerAtLocked(run.started + options_.run_start_timeout);
  }
  return run;
}

void Coordinator::EndRunLocked(const std::string& job_id, const absl::Status& why,
                               const v1::DecisionError* error, Outbox& out) {
  const Run* run = runs_.Find(job_id);
  if (run == nullptr) return;
  const std::string run_id = run->run_id;
  const std::string scope = RunRegistry::KeyScopeOf(*run);
  if (auto jit = jobs_.find(job_id); jit != jobs_.end()) {
    Job& job = jit->second;
    for (auto& [node_id, node] : job.members.nodes()) {
      if (node.sink == nullptr || error == nullptr) continue;
      SendErrorLocked(node.sink, *error, out);
    }
    RemoveJobLocked(&job);  // queues the run's end
  }
  if (runs_.End(job_id, run_id, why)) {
    ACCORD_LOG(INFO) << "job " << job_id << " run " << run_id
                     << " ended; its state and keys are dropped";
    stats_.runs = static_cast<int64_t>(runs_.size());
  } else {
    runs_.SetLastEndReason(scope, why);  // the end RemoveJobLocked queued
  }
  // A superseded run is never resumed: its late requests get RUN_ENDED.
  if (error != nullptr) runs_.Remember(job_id, run_id, *error);
}

absl::StatusOr<Run*> Coordinator::JoinRunLocked(const std::string& job_id,
                                                v1::NodeHello::RunStart start,
                                                const std::string& run_id,
                                                const std::string& node_id, uint64_t node_epoch,
                                                Outbox& out) {
  Run* current = runs_.Find(job_id);
  auto start_run = [&](std::string id) -> absl::StatusOr<Run*> {
    if (static_cast<int>(runs_.size()) >= options_.max_jobs) {
      return wire::KindError(
          v1::LIMIT_EXCEEDED,
          absl::StrCat("job ", job_id, ": the coordinator already serves ", runs_.size(),
                       " jobs (--max_jobs); raise the limit or shard jobs across coordinators"));
    }
    Run& run = StartRunLocked(job_id, std::move(id));
    if (!node_id.empty()) run.node_epochs[node_id] = node_epoch;
    return &run;
  };
  if (start == v1::NodeHello::RUN_START_RESUME) {
    // A reconnect (or a request stamped with the run): the run must be the
    // current one, or unknown here (this coordinator restarted) and not one
    // that ended here. A node back too late for a run that failed or was
    // superseded gets the very error the run's other nodes got, so every
    // rank of the run ends with one error (docs/RELIABILITY.md, "Chaos").
    if (const v1::DecisionError* why = runs_.RememberedError(job_id, run_id)) {
      if (current == nullptr || current->run_id != run_id) {
        return wire::KindError(why->kind(), why->message());
      }
    }
    if (current == nullptr) {
      if (runs_.Remembered(job_id, run_id)) {
        return wire::KindError(
            v1::RUN_ENDED,
            absl::StrCat("job ", job_id, " run ", run_id,
                         " has ended (its last node left, it failed and its nodes left, or a "
                         "restart superseded it); node \"",
                         node_id, "\" still speaks for it: stop its ranks"));
      }
      return start_run(run_id);
    }
    Run& run = *current;
    if (run.run_id != run_id) {
      return wire::KindError(
          v1::RUN_ENDED,
          absl::StrCat("job ", job_id, " run ", run_id, " has ended (the job's current run is ",
                       run.run_id, ", started by a restart under the same job id); node \"",
                       node_id, "\" still speaks for the old run: stop its ranks"));
    }
    if (!node_id.empty()) run.node_epochs[node_id] = node_epoch;
    return &run;
  }
  if (current == nullptr) return start_run(run_id);
  Run& run = *current;
  if (start == v1::NodeHello::RUN_START_NEW) {
    auto nit = run.node_epochs.find(node_id);
    if (nit != run.node_epochs.end() && nit->second != node_epoch) {
      // This node's ranks were restarted: the current run is over, even if
      // a stream of it still lingers (half-open) somewhere.
      const std::string old = run.run_id;
      const std::string msg =
          absl::StrCat("job ", job_id, " run ", old, " ended: node \"", node_id,
                       "\" started a new run of the same job id (its ranks were restarted), so "
                       "this run gets no more decisions; stop the ranks of the old run");
      v1::DecisionError e = Error(v1::RUN_ENDED, msg, job_id);
      ACCORD_LOG(WARNING) << msg;
      EndRunLocked(job_id, wire::KindError(v1::RUN_ENDED, msg), &e, out);
      return start_run("");
    }
    run.node_epochs[node_id] = node_epoch;
  }
  return &run;
}

absl::Time Coordinator::ExpireStartingRunsLocked(absl::Time now) {
  absl::Time next = absl::InfiniteFuture();
  Outbox none;
  for (const std::string& job_id : runs_.StartingPast(now, options_.run_start_timeout, next)) {
    const std::string run_id = runs_.Find(job_id)->run_id;
    ACCORD_LOG(WARNING) << "job " << job_id << ": run " << run_id
                        << " got no node within --run_start_timeout; ending it";
    EndRunLocked(job_id,
                 wire::KindError(v1::RUN_ENDED,
                                 absl::StrCat("job ", job_id, " run ", run_id,
                                              " ended: no node joined it within ",
                                              absl::FormatDuration(options_.run_start_timeout),
                                              " (--run_start_timeout)")),
                 nullptr, none);
  }
  return next;
}

void Coordinator::DeliverRunEnds() {
  // In order across threads (as observer events): a failed run's drop moves
  // its waiters to the fresh scope before that scope's own end drops it.
  accord::MutexLock order(&deliver_mu_);
  std::vector<EndedRun> ended;
  {
    accord::MutexLock l(&mu_);
    ended = runs_.TakeEnded();
  }
  if (!options_.on_run_ended) return;
  for (const EndedRun& e : ended) options_.on_run_ended(e.job_id, e.run_id, e.why, e.successor);
}

absl::StatusOr<std::string> Coordinator::RunForKeyValue(const std::string& job_id,
                                                        const KeyValueOrigin& origin) {
  absl::StatusOr<std::string> result;
  {
    accord::MutexLock l(&mu_);
    Outbox out;
    v1::NodeHello::RunStart start = v1::NodeHello::RUN_START_UNSPECIFIED;
    if (!origin.run_id.empty()) {
      start = v1::NodeHello::RUN_START_RESUME;
    } else if (!origin.node_id.empty()) {
      start = v1::NodeHello::RUN_START_NEW;
    }
    absl::StatusOr<Run*> run =
        JoinRunLocked(job_id, start, origin.run_id, origin.node_id, origin.node_epoch, out);
    if (!run.ok()) {
      result = run.status();
    } else {
      result = RunRegistry::KeyScopeOf(**run);
    }
    FlushLocked(out);
  }
  DeliverRunEnds();
  DeliverEvents();
  return result;
}

std::string Coordinator::CurrentRun(const std::string& job_id) {
  accord::MutexLock l(&mu_);
  const Run* run = runs_.Find(job_id);
  return run == nullptr ? "" : run->run_id;
}

int Coordinator::WorldSize(const std::string& job_id) {
  accord::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? 0 : it->second.world_size;
}

std::vector<std::string> Coordinator::DescribeRanks(const std::string& job_id,
                                                    const std::vector<int>& ranks) {
  std::vector<std::string> out;
  accord::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return out;
  const Job& job = it->second;
  out.reserve(ranks.size());
  for (int r : ranks) {
    out.push_back(r >= 0 && r < job.world_size ? job.members.Describe(r)
                                               : absl::StrCat("rank ", r, " (outside the world)"));
  }
  return out;
}

void Coordinator::HandleMessage(SessionId id, const v1::NodeMessage& message) {
  // Full forms' dtypes are decoded here, before the lock: streams read on
  // several threads decode side by side (docs/ARCHITECTURE.md, "More than
  // one core").
  std::vector<Predecoded> predecoded = DecodeBeforeLock(message);
  HandleMessageWithoutDelivery(id, message, &predecoded);
  DeliverRunEnds();
  DeliverEvents();
}

std::vector<Coordinator::Predecoded> Coordinator::DecodeBeforeLock(const v1::NodeMessage& message) {
  std::vector<Predecoded> out;
  if (!message.has_manifests() || message.manifests().manifests_size() == 0 ||
      message.manifests().manifests(0).repeat()) {
    return out;
  }
  out.reserve(message.manifests().manifests_size());
  for (const v1::Manifest& m : message.manifests().manifests()) out.push_back(PredecodeContent(m));
  return out;
}

void Coordinator::HandleMessageWithoutDelivery(SessionId id, const v1::NodeMessage& message,
                                               std::vector<Predecoded>* predecoded) {
  accord::MutexLock l(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  Session& s = it->second;
  Outbox out;
  if (options_.repeat_waves) {
    if (message.has_manifests() && TryJoinWaveLocked(id, s, message.manifests(), out)) {
      FlushLocked(out);
      return;
    }
    // Anything else first settles the job's held-back repeats.
    Job* job = s.job;
    if (job == nullptr && message.has_hello()) {
      auto jit = jobs_.find(message.hello().job_id());
      if (jit != jobs_.end()) job = &jit->second;
    }
    if (job != nullptr) BreakWaveLocked(*job, out);
  }
  switch (message.body_case()) {
    case v1::NodeMessage::kHello:
      HandleHelloLocked(id, s, message.hello(), out);
      break;
    case v1::NodeMessage::kRegistration:
    case v1::NodeMessage::kManifests:
    case v1::NodeMessage::kRankEvent:
    case v1::NodeMessage::kProgress:
      if (s.node == nullptr) {
        SendErrorLocked(s.sink,
                        OutOfOrder(v1::INVALID_REQUEST,
                                   "node message before NodeHello (or after the job's state was "
                                   "dropped); send NodeHello first"),
                        out);
        break;
      }
      if (message.has_registration()) {
        HandleRegistrationLocked(s, message.registration(), out);
      } else if (message.has_rank_event()) {
        HandleRankEventLocked(s, message.rank_event(), out);
      } else if (message.has_progress() && message.progress().partial()) {
        HandlePartialProgressLocked(s, message.progress());
      } else if (message.has_progress()) {
        HandleProgressLocked(s, message.progress());
      } else {
        HandleManifestsLocked(s, message.manifests(), predecoded, out);
      }
      break;
    default:
      SendErrorLocked(s.sink, Error(v1::INVALID_REQUEST, "empty or unknown NodeMessage body"), out);
  }
  FlushLocked(out);
}

void Coordinator::SendErrorLocked(NodeSink* sink, v1::DecisionError error, Outbox& out) {
  NoteErrorLocked(error);
  v1::CoordinatorMessage reply;
  *reply.mutable_error() = std::move(error);
  out.direct.emplace_back(sink, std::move(reply));
}

void Coordinator::SendRegistrationErrorLocked(NodeSink* sink, const std::string& group_id,
                                              v1::DecisionError error, Outbox& out) {
  NoteErrorLocked(error);
  v1::CoordinatorMessage reply;
  reply.mutable_registration()->set_group_id(group_id);
  *reply.mutable_registration()->mutable_error() = std::move(error);
  out.direct.emplace_back(sink, std::move(reply));
}

void Coordinator::SendDecisionErrorLocked(NodeSink* sink, absl::string_view group_id, int64_t step,
                                          v1::DecisionError error, Outbox& out) {
  NoteErrorLocked(error);
  v1::Decision* d = out.ReplyBatch(sink)->add_decisions();
  d->set_group_id(std::string(group_id));
  d->set_step(step);
  *d->mutable_error() = std::move(error);
}

void Coordinator::FlushLocked(Outbox& out) {
  for (auto& [sink, msg] : out.direct) {
    if (sink != nullptr) sink->Send(std::make_shared<const v1::CoordinatorMessage>(std::move(msg)));
  }
  auto broadcast = [&](Job* job, v1::CoordinatorMessage&& msg) {
    if (jobs_.find(job->job_id) == jobs_.end()) return;
    auto shared = std::make_shared<const v1::CoordinatorMessage>(std::move(msg));
    for (auto& [node_id, node] : job->members.nodes()) {
      if (node.sink != nullptr) node.sink->Send(shared);
    }
  };
  for (auto& [job, msg] : out.broadcast_other) broadcast(job, std::move(msg));
  for (auto& [job, msg] : out.broadcast_decisions) broadcast(job, std::move(msg));
}

absl::Status Coordinator::ValidateHello(const Session& s, const v1::NodeHello& hello,
                                        std::vector<int>& ranks) const {
  if (s.node != nullptr) {
    return wire::WithKind(
        absl::FailedPreconditionError(
            absl::StrCat("node \"", s.node->node_id, "\" sent a second NodeHello on one session")),
        v1::INVALID_REQUEST);
  }
  absl::StatusOr<std::vector<int>> checked =
      CheckNodeHello(hello, options_.max_world_size, "coordinator");
  if (!checked.ok()) return checked.status();
  ranks = *std::move(checked);
  return absl::OkStatus();
}

absl::StatusOr<Coordinator::Job*> Coordinator::FindOrCreateJobLocked(const v1::NodeHello& hello,
                                                                     const std::string& run_id) {
  auto jit = jobs_.find(hello.job_id());
  if (jit != jobs_.end()) return &jit->second;
  if (static_cast<int>(jobs_.size()) >= options_.max_jobs) {
    return wire::KindError(
        v1::LIMIT_EXCEEDED,
        absl::StrCat("job ", hello.job_id(), ": the coordinator already serves ", jobs_.size(),
                     " jobs (--max_jobs); raise the limit or shard jobs "
                     "across coordinators"));
  }
  const int world = hello.world_size();
  Job& job = jobs_.try_emplace(hello.job_id(), world).first->second;
  job.job_id = hello.job_id();
  job.run_id = run_id;
  if (options_.observer != nullptr) job.observer = options_.observer->ForJob(job.job_id, world);
  stats_.jobs = static_cast<int64_t>(jobs_.size());
  ACCORD_LOG(INFO) << "job " << job.job_id << " run " << run_id << ": created with world size "
                   << world << " by node \"" << hello.node_id() << "\"";
  return &job;
}

absl::Status Coordinator::CheckJoinLocked(const Job& job, const v1::NodeHello& hello,
                                          const std::vector<int>& ranks) const {
  // Ranks held by another connected node are refused.
  return CheckNodeJoins(job.job_id, job.world_size, hello, [&] {
    RankHeldElsewhere held;
    held.rank = job.members.HeldElsewhere(hello.node_id(), ranks);
    if (held.rank >= 0) held.node_id = job.members.OwnerOf(held.rank)->node_id;
    return held;
  });
}

void Coordinator::HandleHelloLocked(SessionId id, Session& s, const v1::NodeHello& hello,
                                    Outbox& out) {
  auto refuse = [&](const absl::Status& why, std::vector<int> error_ranks = {}) {
    v1::DecisionError e = ErrorFrom(v1::ERROR_KIND_UNSPECIFIED, why, "", hello.job_id());
    for (int r : error_ranks) e.add_ranks(r);
    SendErrorLocked(s.sink, std::move(e), out);
  };
  std::vector<int> ranks;
  if (absl::Status valid = ValidateHello(s, hello, ranks); !valid.ok()) {
    refuse(valid);
    return;
  }
  absl::StatusOr<Run*> run = JoinRunLocked(hello.job_id(), hello.run_start(), hello.run_id(),
                                           hello.node_id(), hello.node_epoch(), out);
  if (!run.ok()) {
    refuse(run.status());
    return;
  }
  absl::StatusOr<Job*> found = FindOrCreateJobLocked(hello, (*run)->run_id);
  if (!found.ok()) {
    refuse(found.status());
    return;
  }
  (*run)->SetRunning();
  Job& job = **found;
  if (absl::Status joins = CheckJoinLocked(job, hello, ranks); !joins.ok()) {
    std::vector<int> held;
    if (wire::KindOf(joins) == v1::DUPLICATE_RANK) {
      held.push_back(job.members.HeldElsewhere(hello.node_id(), ranks));
    }
    refuse(joins, std::move(held));
    if (job.members.connected() == 0) RemoveJobLocked(&job);
    return;
  }
  PlaceNodeLocked(id, s, job, hello, ranks, out);
}

void Coordinator::PlaceNodeLocked(SessionId id, Session& s, Job& job, const v1::NodeHello& hello,
                                  const std::vector<int>& ranks, Outbox& out) {
  uint64_t replaced = 0;
  NodeState& node =
      job.members.Connect(hello.node_id(), ranks, id, s.sink, hello.answers_progress(), &replaced);
  if (auto old = sessions_.find(replaced); replaced != 0 && old != sessions_.end()) {
    // The same node reconnected before its old stream was noticed as gone.
    old->second.node = nullptr;
    old->second.job = nullptr;
  }
  s.job = &job;
  s.node = &node;
  s.last_batch = BatchRecord();
  ObserveNodeLocked(job, node, /*connected=*/true);
  v1::CoordinatorMessage reply;
  reply.mutable_welcome()->set_node_id(node.node_id);
  reply.mutable_welcome()->set_server_version(kServerVersion);
  reply.mutable_welcome()->set_batch_repeat(true);
  reply.mutable_welcome()->set_deadline_ms(absl::ToInt64Milliseconds(options_.deadline));
  reply.mutable_welcome()->set_run_id(job.run_id);
  out.direct.emplace_back(s.sink, std::move(reply));
  if (job.failed()) {
    v1::CoordinatorMessage fail;
    *fail.mutable_error() = job.failure;
    out.direct.emplace_back(s.sink, std::move(fail));
  }
}

void Coordinator::HandleRankEventLocked(Session& s, const v1::RankEvent& e, Outbox& out) {
  Job& job = *s.job;
  NodeState& node = *s.node;
  const int r = e.rank();
  if (r < 0 || r >= job.world_size) {
    SendErrorLocked(s.sink,
                    Error(v1::INVALID_REQUEST,
                          absl::StrCat("job ", job.job_id, ": RankEvent for rank ", r,
                                       " outside 0..", job.world_size - 1),
                          job.job_id),
                    out);
    return;
  }
  if (e.joined()) {
    if (job.members.JoinRank(node, r) == Membership::Join::kHeldElsewhere) {
      v1::DecisionError err =
          Error(v1::DUPLICATE_RANK,
                absl::StrCat("job ", job.job_id, ": rank ", r, " joined node \"", node.node_id,
                             "\" but is already served by node \"", job.members.OwnerOf(r)->node_id,
                             "\"; check RANK of the processes on both nodes"),
                job.job_id);
      err.add_ranks(r);
      SendErrorLocked(s.sink, std::move(err), out);
    }
    return;
  }
  // The rank left: any pending step that still needs it can never complete.
  if (!job.members.LeaveRank(node, r, e.last_step())) return;
  if (job.failed()) return;
  // The lowest (group, step) that needs it names the failure.
  GroupState* culprit = nullptr;
  int64_t culprit_step = 0;
  PendingStep* culprit_pending = nullptr;
  for (auto& [gid, g] : job.groups) {
    if (culprit != nullptr && g.group_id > culprit->group_id) continue;
    for (auto& [step, p] : g.pending) {
      RankSet covered(job.world_size);
      for (const Contribution& c : p.contributions) covered.Union(*c.content->ranks);
      for (int x : p.clock.reported()) {
        if (x >= 0 && x < job.world_size) covered.Add(x);
      }
      if (covered.Contains(r)) continue;
      culprit = &g;
      culprit_step = step;
      culprit_pending = &p;
      break;  // pending is ordered by step
    }
  }
  if (culprit == nullptr) return;
  // Named: the ranks that left (this one at least); live ranks that had not
  // submitted the step yet are not at fault (StepFacts::AtFault).
  v1::DecisionError err = MissingRanksErrorLocked(
      job, *culprit, culprit_step, *culprit_pending,
      absl::StrCat("rank ", r, " left (its stream to the sidecar on node \"", node.node_id,
                   "\" ended)"));
  FailJobLocked(job, culprit, culprit_step, std::move(err), out);
}

void Coordinator::HandleRegistrationLocked(Session& s, const v1::NodeRegistration& nr,
                                           Outbox& out) {
  Job& job = *s.job;
  NodeState& node = *s.node;
  const v1::GroupRegistration& reg = nr.registration();
  auto reply = [&](v1::DecisionError err) {
    // About this registration only: name its ranks so the sidecar answers
    // just them, not every local rank of the group.
    for (int r : nr.ranks()) err.add_ranks(r);
    SendRegistrationErrorLocked(s.sink, reg.group_id(), std::move(err), out);
  };
  absl::StatusOr<GroupSpec> spec = wire::GroupSpecFromProto(reg);
  if (!spec.ok()) {
    reply(ErrorFrom(v1::INVALID_REQUEST, spec.status(), absl::StrCat("job ", job.job_id, ": "),
                    job.job_id, reg.group_id()));
    return;
  }
  absl::StatusOr<Policy> policy = wire::PolicyFromProto(reg.policy());
  if (!policy.ok()) {
    reply(ErrorFrom(v1::INVALID_REQUEST, policy.status(),
                    absl::StrCat("job ", job.job_id, " group \"", reg.group_id(), "\": "),
                    job.job_id, reg.group_id()));
    return;
  }
  absl::StatusOr<std::vector<int>> ranks = CheckRegistration(job, node, nr, *spec);
  absl::StatusOr<GroupState*> group =
      ranks.ok() ? FindOrCreateGroupLocked(job, reg.group_id()) : ranks.status();
  if (!group.ok()) {
    reply(ErrorFrom(v1::ERROR_KIND_UNSPECIFIED, group.status(), "", job.job_id, reg.group_id()));
    return;
  }
  RegisterLocked(s, **group, *spec, *policy, *ranks, out);
}

absl::StatusOr<std::vector<int>> Coordinator::CheckRegistration(const Job& job,
                                                                const NodeState& node,
                                                                const v1::NodeRegistration& nr,
                                                                const GroupSpec& spec) const {
  const std::string& group_id = nr.registration().group_id();
  if (static_cast<int64_t>(spec.params.size()) > options_.max_params_per_group) {
    return wire::KindError(
        v1::LIMIT_EXCEEDED,
        absl::StrCat("job ", job.job_id, " group \"", group_id, "\": ", spec.params.size(),
                     " parameters exceed --max_params_per_group=", options_.max_params_per_group));
  }
  // A list, not a world-sized set: a registration costs its own ranks.
  std::vector<int> ranks;
  ranks.reserve(nr.ranks_size());
  for (int r : nr.ranks()) {
    if (r < 0 || r >= job.world_size || !node.rank_set->Contains(r)) {
      return wire::KindError(v1::INVALID_REQUEST,
                             absl::StrCat("job ", job.job_id, " group \"", group_id, "\": rank ", r,
                                          " is not served by node \"", node.node_id, "\""));
    }
    ranks.push_back(r);
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  if (ranks.empty()) {
    return wire::KindError(
        v1::INVALID_REQUEST,
        absl::StrCat("job ", job.job_id, " group \"", group_id, "\": registration names no rank"));
  }
  return ranks;
}

absl::StatusOr<Coordinator::GroupState*> Coordinator::FindOrCreateGroupLocked(
    Job& job, const std::string& group_id) {
  auto git = job.groups.find(group_id);
  if (git != job.groups.end()) return &git->second;
  if (static_cast<int>(job.groups.size()) >= options_.max_groups_per_job) {
    return wire::KindError(
        v1::LIMIT_EXCEEDED,
        absl::StrCat("job ", job.job_id, ": group \"", group_id,
                     "\" would exceed --max_groups_per_job=", options_.max_groups_per_job));
  }
  GroupState& g =
      job.groups.try_emplace(group_id, job.world_size, job.job_id, group_id).first->second;
  if (job.observer != nullptr) g.observer = job.observer->ForGroup(group_id);
  return &g;
}

void Coordinator::RegisterLocked(Session& s, GroupState& g, const GroupSpec& spec,
                                 const Policy& policy, const std::vector<int>& ranks, Outbox& out) {
  Job& job = *s.job;
  NodeState& node = *s.node;
  const GroupRegistration::State before = g.registration.state();
  if (job.failed() && before == GroupRegistration::State::kCollecting) {
    // A group first registered after the job failed can never complete
    // (every group collecting at the failure was failed with it): the job's
    // failure again (counted when it happened).
    v1::CoordinatorMessage msg;
    msg.mutable_registration()->set_group_id(g.group_id);
    *msg.mutable_registration()->mutable_error() = job.failure;
    msg.mutable_registration()->mutable_error()->set_kind(v1::JOB_FAILED);
    out.direct.emplace_back(s.sink, std::move(msg));
    return;
  }
  const GroupRegistration::Added added = g.registration.Add(spec, policy, ranks);
  auto [ngit, created] = node.groups.try_emplace(g.group_id);
  if (created) ngit->second.waves_counted = g.waves;  // waves before it are not its
  ngit->second.variant = added.variant;
  if (added.completed) {
    BroadcastRegistrationLocked(job, g, out);
    return;
  }
  if (before == GroupRegistration::State::kCollecting) {
    // The first registration starts the group's clock (docs/ARCHITECTURE.md,
    // "Every wait names who is missing").
    if (g.registration_due == absl::InfiniteFuture()) {
      g.registration_due = clock_->Now() + options_.deadline;
      WakeTimerAtLocked(g.registration_due);
    }
    return;
  }
  if (before == GroupRegistration::State::kFailed) {
    // The group's failure again (counted when it happened).
    v1::CoordinatorMessage msg;
    msg.mutable_registration()->set_group_id(g.group_id);
    *msg.mutable_registration()->mutable_error() = g.registration.error();
    out.direct.emplace_back(s.sink, std::move(msg));
    return;
  }
  if (!g.registration.IsAgreed(added.variant)) {
    SendRegistrationErrorLocked(
        s.sink, g.group_id,
        Error(v1::REGISTRATION_MISMATCH,
              absl::StrCat("job ", job.job_id, " group \"", g.group_id, "\": ranks ",
                           FormatRanks(ranks), " on node \"", node.node_id,
                           "\" registered a spec or policy different from the one every rank "
                           "agreed on; check the model definition on those ranks"),
              job.job_id, g.group_id),
        out);
    return;
  }
  v1::CoordinatorMessage msg;
  msg.mutable_registration()->set_group_id(g.group_id);
  msg.mutable_registration()->set_spec_fingerprint(g.registration.fingerprint());
  out.direct.emplace_back(s.sink, std::move(msg));
}

void Coordinator::BroadcastRegistrationLocked(Job& job, GroupState& g, Outbox& out) {
  v1::CoordinatorMessage msg;
  msg.mutable_registration()->set_group_id(g.group_id);
  if (g.registration.state() == GroupRegistration::State::kAgreed) {
    msg.mutable_registration()->set_spec_fingerprint(g.registration.fingerprint());
    out.broadcast_other.emplace_back(&job, std::move(msg));
    return;
  }
  const v1::DecisionError& error = g.registration.error();
  *msg.mutable_registration()->mutable_error() = error;
  NoteErrorLocked(error);
  ACCORD_LOG(WARNING) << error.message();
  // Pending steps of the group can never be decided.
  v1::DecisionBatch& batch = *out.broadcast_decisions[&job].mutable_decisions();
  for (auto& [step, p] : g.pending) {
    v1::Decision* d = batch.add_decisions();
    d->set_group_id(g.group_id);
    d->set_step(step);
    *d->mutable_error() = error;
    d->mutable_error()->set_step(step);
  }
  g.pending.clear();
  out.broadcast_other.emplace_back(&job, std::move(msg));
}

void Coordinator::HandleManifestsLocked(Session& s, const v1::ManifestBatch& batch,
                                        std::vector<Predecoded>* predecoded, Outbox& out) {
  if (batch.repeat_batch_key() != 0) {
    HandleBatchRepeatLocked(s, batch, out);
    return;
  }
  if (batch.manifests_size() == 0) return;
  // The new record. An entry naming the same group as the old record's entry
  // at its position (the common case: the same groups every step) keeps its
  // resolved pointers instead of two hash lookups.
  BatchRecord& record = s.last_batch;
  const size_t n = static_cast<size_t>(batch.manifests_size());
  if (record.entries.size() > n) record.entries.resize(n);
  record.entries.reserve(n);
  record.groups_key = 0;
  const int64_t step = batch.manifests(0).step();
  // The record's key, hashed here while the entries are at hand: the first
  // batch repeat then costs O(1) (a wave at scale), not a pass over them.
  wire::BatchKeyHasher hasher;
  std::vector<EntryRef>& refs = entry_refs_;
  refs.clear();
  for (size_t i = 0; i < n; ++i) {
    const v1::Manifest& m = batch.manifests(static_cast<int>(i));
    if (i == record.entries.size()) record.entries.emplace_back();
    BatchEntry& e = record.entries[i];
    if (e.group_id != m.group_id()) {
      e.group_id = m.group_id();
      e.group = nullptr;
      e.node_group = nullptr;
    }
    ResolveEntryLocked(s, e);
    e.cache_key = m.cache_key();
    hasher.Add(e.group_id, e.cache_key);
    Predecoded* pre =
        predecoded != nullptr && predecoded->size() == n ? &(*predecoded)[i] : nullptr;
    refs.push_back(EntryRef{ManifestRef{m.group_id(), m.step(), m.repeat(), m.cache_key(),
                                        m.repeat() ? nullptr : &m, pre},
                            e.group, e.node_group});
  }
  record.key = hasher.Finish();
  bool all_added = HandleEntriesLocked(s, refs, out);
  for (const EntryRef& r : refs) all_added = all_added && r.m.step == step;
  NoteSyncedLocked(s, step, all_added);
}

void Coordinator::HandleBatchRepeatLocked(Session& s, const v1::ManifestBatch& batch, Outbox& out) {
  BatchRecord& record = s.last_batch;
  if (batch.manifests_size() > 0 || record.key != batch.repeat_batch_key()) {
    const Job& job = *s.job;
    SendErrorLocked(
        s.sink,
        OutOfOrder(
            v1::INVALID_REQUEST,
            absl::StrCat("job ", job.job_id, " step ", batch.repeat_step(), ": node \"",
                         s.node->node_id, "\" sent a batch repeat with key ",
                         absl::Hex(batch.repeat_batch_key()),
                         batch.manifests_size() > 0
                             ? std::string(" together with manifests")
                             : absl::StrCat(" but the previous batch on this stream has key ",
                                            absl::Hex(record.key), " (", record.entries.size(),
                                            " manifests)"),
                         "; the sidecar and the coordinator disagree on the stream's "
                         "history. Check the sidecar's version; restarting it resends in "
                         "full form"),
            job.job_id, "", batch.repeat_step()),
        out);
    return;
  }
  RepeatBatchLocked(s, batch.repeat_step(), out);
}

void Coordinator::RepeatBatchLocked(Session& s, int64_t step, Outbox& out) {
  std::vector<EntryRef>& refs = entry_refs_;
  refs.clear();
  for (BatchEntry& e : s.last_batch.entries) {
    ResolveEntryLocked(s, e);  // unknown when recorded: it may have been registered since
    ManifestRef ref;
    ref.group_id = e.group_id;
    ref.step = step;
    ref.repeat = true;
    ref.cache_key = e.cache_key;
    refs.push_back(EntryRef{ref, e.group, e.node_group});
  }
  const bool all_added = HandleEntriesLocked(s, refs, out);
  NoteSyncedLocked(s, step, all_added);
}

bool Coordinator::HandleEntriesLocked(Session& s, std::vector<EntryRef>& refs, Outbox& out) {
  const size_t n = refs.size();
  bool all_added = true;
  // Steps this batch completes are decided together at its end.
  collect_ready_ = pool_->threads() > 1;
  // Side by side when the batch is large enough and names each group once
  // (HandleEntry changes only its own group's state).
  bool parallel =
      pool_->threads() > 1 && n >= 2 && static_cast<int64_t>(n) >= options_.parallel_min_entries;
  if (parallel) {
    ++batch_stamp_;
    for (const EntryRef& r : refs) {
      if (r.g == nullptr || r.ng == nullptr || r.g->ready || r.g->batch_stamp == batch_stamp_) {
        parallel = false;
        break;
      }
      r.g->batch_stamp = batch_stamp_;
    }
  }
  if (!parallel) {
    for (const EntryRef& r : refs)
      all_added = HandleManifestLocked(s, r.m, r.g, r.ng, out) && all_added;
  } else {
    std::vector<EntryResult>& results = entry_results_;
    results.assign(n, EntryResult());
    const Job& job = *s.job;
    NodeState& node = *s.node;
    const absl::Time now = wave_first_seen_.value_or(clock_->Now());
    pool_->ParallelFor(static_cast<int64_t>(n), [&](int64_t i) {
      const EntryRef& r = refs[i];
      EntryResult& result = results[i];
      result.answer = AnswersWithoutContent(job, r.g, r.ng, r.m.step);
      if (!result.answer) HandleEntry(job, node, *r.g, *r.ng, r.m, now, result);
    });
    stats_.parallel_entries += static_cast<int64_t>(n);
    for (size_t i = 0; i < n; ++i) {
      all_added =
          ApplyEntryLocked(s, refs[i].m, refs[i].g, refs[i].ng, results[i], out) && all_added;
    }
  }
  DecideReadyLocked(*s.job, out);
  collect_ready_ = false;
  return all_added;
}

void Coordinator::ResolveEntryLocked(Session& s, BatchEntry& e) {
  if (e.group != nullptr && e.node_group != nullptr) return;
  auto git = s.job->groups.find(e.group_id);
  auto ngit = s.node->groups.find(e.group_id);
  if (git != s.job->groups.end() && ngit != s.node->groups.end()) {
    e.group = &git->second;
    e.node_group = &ngit->second;
    s.last_batch.groups_key = 0;
  }
}

// Repeat waves: docs/ARCHITECTURE.md, "Repeat waves".
void Coordinator::NoteSyncedLocked(Session& s, int64_t step, bool all_added) {
  if (!options_.repeat_waves || s.job == nullptr) return;
  Job& job = *s.job;
  if (job.sync_step != step) {
    job.sync_step = step;
    job.sync_sessions = 0;
    job.sync_ok = true;
  }
  if (!all_added || s.last_batch.entries.empty()) return;
  if (s.synced_step == step) {
    job.sync_ok = false;  // a second batch at the step: its record is not the step's
    return;
  }
  s.synced_step = step;
  const uint64_t groups = s.last_batch.GroupsKey();
  if (job.sync_sessions == 0) {
    job.sync_groups = groups;
  } else if (groups != job.sync_groups) {
    job.sync_ok = false;
  }
  ++job.sync_sessions;
  if (!job.sync_ok || job.failed() || !job.members.all_connected() ||
      job.sync_sessions != job.members.connected()) {
    return;
  }
  // Every node added its whole record at `step`: each group decided it from
  // exactly these contents. Once per step, O(groups).
  for (const BatchEntry& e : s.last_batch.entries) {
    const GroupState& g = *e.group;
    if (g.last_decided_step != step || !g.pending.empty() || !g.last_ok ||
        g.last_decision == nullptr) {
      return;
    }
  }
  job.wave_base = step;
  job.wave_members = job.sync_sessions;
}

bool Coordinator::TryJoinWaveLocked(SessionId id, Session& s, const v1::ManifestBatch& batch,
                                    Outbox& out) {
  if (s.job == nullptr || s.node == nullptr || batch.repeat_batch_key() == 0 ||
      batch.manifests_size() > 0) {
    return false;
  }
  Job& job = *s.job;
  RepeatWave& wave = job.wave;
  const int64_t step = batch.repeat_step();
  if (job.wave_base < 0 || job.failed() || s.synced_step != job.wave_base ||
      step <= job.wave_base || s.wave_step == step ||
      (!wave.sessions.empty() && wave.step != step) ||
      s.last_batch.key != batch.repeat_batch_key()) {
    return false;
  }
  if (wave.sessions.empty()) {
    wave.step = step;
    wave.first_seen = clock_->Now();
    // The check the entry-by-entry path's pending steps would wake for.
    const StepDeadline clock(wave.first_seen, options_.deadline);
    wave.wake = options_.observer != nullptr ? clock.stall_at() : clock.deadline();
    WakeTimerAtLocked(wave.wake);
  }
  wave.sessions.push_back(id);
  s.wave_step = step;
  s.node->last_step = std::max(s.node->last_step, step);
  if (static_cast<int>(wave.sessions.size()) == job.wave_members) CompleteWaveLocked(job, out);
  return true;
}

void Coordinator::CompleteWaveLocked(Job& job, Outbox& out) {
  RepeatWave wave = std::move(job.wave);
  job.wave = RepeatWave();
  std::vector<Session*> members;
  members.reserve(wave.sessions.size());
  int64_t manifests = 0;
  for (SessionId id : wave.sessions) {
    Session& m = sessions_.at(id);  // a session that closed broke the wave first
    members.push_back(&m);
    manifests += static_cast<int64_t>(m.last_batch.entries.size());
    m.synced_step = wave.step;
    m.wave_step = -1;
  }
  if (job.retained > 0) {
    // Contents retained across the base step are no longer named (the
    // entry-by-entry path would prune them now).
    for (Session* m : members) {
      for (BatchEntry& e : m->last_batch.entries) {
        PruneContributionsLocked(job, *e.group, *e.node_group);
      }
    }
  }
  stats_.manifests += manifests;
  stats_.cache_hits += manifests;
  ++stats_.repeat_waves;
  if (job.observer != nullptr) job.observer->OnManifests(/*cache_hit=*/true, manifests);
  const int64_t nodes = static_cast<int64_t>(members.size());
  const int64_t wait_us = absl::ToInt64Microseconds(clock_->Now() - wave.first_seen);
  const std::vector<BatchEntry>& entries = members.front()->last_batch.entries;
  v1::DecisionBatch& batch = *out.broadcast_decisions[&job].mutable_decisions();
  for (size_t i = 0; i < entries.size(); ++i) {
    GroupState& g = *entries[i].group;
    g.cache_hits += nodes;
    ++g.waves;
    v1::Decision* d = batch.add_decisions();
    d->set_group_id(g.group_id);
    d->set_step(wave.step);
    d->set_wait_us(wait_us);
    d->set_same_as_previous(true);
    ++stats_.decisions;
    ++stats_.same_as_previous;
    g.last_decided_step = wave.step;
    g.last_decision_wait_us = wait_us;
    ObserveDecisionLocked(job, g, wave.step, nullptr, *d, nullptr, [&] {
      std::vector<std::shared_ptr<const Content>> contents;
      contents.reserve(members.size());
      for (Session* m : members) {
        contents.push_back(m->last_batch.entries[i].node_group->contents.current());
      }
      return contents;
    });
  }
  job.wave_base = wave.step;
  job.sync_step = wave.step;
  job.sync_sessions = static_cast<int>(nodes);
}

void Coordinator::BreakWaveLocked(Job& job, Outbox& out) {
  job.wave_base = -1;
  if (job.wave.sessions.empty()) return;
  RepeatWave wave = std::move(job.wave);
  job.wave = RepeatWave();
  wave_first_seen_ = wave.first_seen;
  for (SessionId id : wave.sessions) {
    auto it = sessions_.find(id);
    if (it == sessions_.end() || it->second.job != &job) continue;
    it->second.wave_step = -1;
    RepeatBatchLocked(it->second, wave.step, out);
  }
  wave_first_seen_.reset();
  job.wave_base = -1;  // RepeatBatchLocked may have synced it again
}

void Coordinator::CountWaveSkips(const GroupState& g, NodeGroupState& ng) {
  ng.contents.AddSkipSteps(g.waves - ng.waves_counted);
  ng.waves_counted = g.waves;
}

std::shared_ptr<const Coordinator::Content> Coordinator::Contribution::Owner() const {
  return group->contents.Owner(content);  // never null: a pending contribution's content is held
}

uint64_t Coordinator::BatchRecord::GroupsKey() {
  if (groups_key == 0) {
    uint64_t h = entries.size();
    for (const BatchEntry& e : entries) h = absl::HashOf(h, e.group);
    groups_key = h | 1;
  }
  return groups_key;
}

std::map<int64_t, Coordinator::PendingStep>::iterator Coordinator::StartStepLocked(
    Job& job, GroupState& g, int64_t step, absl::Time first_seen) {
  auto [pit, wake] = StartStep(job, g, step, first_seen);
  WakeTimerAtLocked(wake);
  return pit;
}

std::pair<std::map<int64_t, Coordinator::PendingStep>::iterator, absl::Time> Coordinator::StartStep(
    const Job& job, GroupState& g, int64_t step, absl::Time first_seen) const {
  auto pit = g.pending.try_emplace(step, first_seen, options_.deadline).first;
  PendingStep& p = pit->second;
  p.contributions.reserve(job.members.connected());
  // With an observer the timer also wakes at half the deadline (stall event).
  absl::Time wake = options_.observer != nullptr ? p.clock.stall_at() : p.clock.deadline();
  // A node gone (sidecar restarted?) may already be past its grace.
  if (!job.members.all_connected()) {
    for (const auto& [node_id, node] : job.members.nodes()) {
      if (node.session == 0 && node.disconnected_at != absl::InfiniteFuture()) {
        wake = std::min(wake, node.disconnected_at + options_.node_reconnect_grace);
      }
    }
  }
  return {pit, wake};
}

bool Coordinator::HandleManifestLocked(Session& s, const ManifestRef& m, GroupState* gp,
                                       NodeGroupState* ngp, Outbox& out) {
  // A group's steps are decided in order, before anything else about it.
  if (gp != nullptr && gp->ready) DecideReadyLocked(*s.job, out);
  EntryResult r;
  if (AnswersWithoutContent(*s.job, gp, ngp, m.step)) {
    r.answer = true;
  } else {
    HandleEntry(*s.job, *s.node, *gp, *ngp, m, wave_first_seen_.value_or(clock_->Now()), r);
  }
  return ApplyEntryLocked(s, m, gp, ngp, r, out);
}

bool Coordinator::AnswersWithoutContent(const Job& job, const GroupState* g,
                                        const NodeGroupState* ng, int64_t step) {
  return job.failed() || g == nullptr || ng == nullptr || ng->variant < 0 ||
         g->registration.state() == GroupRegistration::State::kFailed || step < 0 ||
         step <= g->last_decided_step;
}

void Coordinator::HandleEntry(const Job& job, NodeState& node, GroupState& g, NodeGroupState& ng,
                              const ManifestRef& m, absl::Time now, EntryResult& r) const {
  CountWaveSkips(g, ng);
  r.retained -= ng.contents.Prune(g.last_decided_step);
  const Content* content = ResolveContent(job, node, g, ng, m, r);
  PendingStep* p = content == nullptr ? nullptr : PendingStepFor(job, g, m, now, r);
  r.added =
      p == nullptr ? Added::kRefused : AddContribution(job, node, ng, m, content, *p, r.error);
  r.complete = r.added == Added::kAdded && p->ranks_covered >= job.world_size;
}

bool Coordinator::ApplyEntryLocked(Session& s, const ManifestRef& m, GroupState* gp,
                                   NodeGroupState* ngp, EntryResult& r, Outbox& out) {
  ++stats_.manifests;
  if (r.answer) {
    AnswerWithoutContentLocked(s, m, gp, ngp, out);
    return false;
  }
  Job& job = *s.job;
  GroupState& g = *gp;
  stats_.cache_hits += r.cache_hits;
  stats_.cache_misses += r.cache_misses;
  stats_.repeat_key_mismatches += r.key_mismatches;
  stats_.retained_contents += r.retained;
  job.retained += r.retained;
  if (job.observer != nullptr) {
    if (r.cache_hits > 0) job.observer->OnManifests(/*cache_hit=*/true, r.cache_hits);
    if (r.cache_misses > 0) job.observer->OnManifests(/*cache_hit=*/false, r.cache_misses);
  }
  if (r.wake != absl::InfiniteFuture()) WakeTimerAtLocked(r.wake);
  if (r.added == Added::kRefused) {
    SendDecisionErrorLocked(s.sink, m.group_id, m.step, std::move(r.error), out);
  }
  if (r.added != Added::kAdded) return false;
  s.node->last_step = std::max(s.node->last_step, m.step);
  if (r.complete) {
    if (collect_ready_) {
      g.ready = true;
      ready_.push_back(ReadyStep{&g, m.step});
    } else {
      DecideStepLocked(job, g, m.step, g.pending.at(m.step), nullptr, out);
      g.pending.erase(m.step);
    }
  }
  return true;
}

void Coordinator::AnswerWithoutContentLocked(Session& s, const ManifestRef& m, GroupState* g,
                                             NodeGroupState* ng, Outbox& out) {
  const Job& job = *s.job;
  // Built only on the error paths: the common path allocates nothing here.
  auto where = [&] {
    return absl::StrCat("job ", job.job_id, " group \"", m.group_id, "\" step ", m.step);
  };
  auto refuse = [&](v1::ErrorKind kind, std::string message) {
    SendDecisionErrorLocked(s.sink, m.group_id, m.step,
                            Error(kind, message, job.job_id, m.group_id, m.step), out);
  };
  if (job.failed()) {
    // The job's failure again (counted when it happened).
    v1::Decision* d = out.ReplyBatch(s.sink)->add_decisions();
    d->set_group_id(std::string(m.group_id));
    d->set_step(m.step);
    *d->mutable_error() = job.failure;
    d->mutable_error()->set_kind(v1::JOB_FAILED);
    return;
  }
  if (g == nullptr || ng == nullptr || ng->variant < 0) {
    refuse(v1::UNKNOWN_GROUP,
           absl::StrCat(where(), ": node \"", s.node->node_id,
                        "\" has not registered this group; register it before sending "
                        "manifests"));
    return;
  }
  if (g->registration.state() == GroupRegistration::State::kFailed) {
    // The group's failure again (counted when it happened).
    v1::Decision* d = out.ReplyBatch(s.sink)->add_decisions();
    d->set_group_id(g->group_id);
    d->set_step(m.step);
    *d->mutable_error() = g->registration.error();
    d->mutable_error()->set_step(m.step);
    return;
  }
  if (m.step < 0) {
    refuse(v1::INVALID_MANIFEST, absl::StrCat(where(), ": negative step"));
    return;
  }
  if (m.step == g->last_decided_step && g->last_decision != nullptr) {
    // A resend after a reconnect whose decision was lost: answer again.
    v1::Decision* again = out.ReplyBatch(s.sink)->add_decisions();
    *again = *g->last_decision;
    again->set_step(m.step);
    again->set_wait_us(g->last_decision_wait_us);
    return;
  }
  refuse(v1::STEP_REGRESSION,
         absl::StrCat(where(), ": step ", m.step, " is older than the last decided step ",
                      g->last_decided_step,
                      " of this group; check that the training loop's step counter "
                      "only moves forward (was the process restarted alone?)"));
}

void Coordinator::PruneContributionsLocked(Job& job, const GroupState& g, NodeGroupState& ng) {
  const int64_t pruned = ng.contents.Prune(g.last_decided_step);
  stats_.retained_contents -= pruned;
  job.retained -= pruned;
}

const Coordinator::Content* Coordinator::ResolveContent(const Job& job, const NodeState& node,
                                                        GroupState& g, NodeGroupState& ng,
                                                        const ManifestRef& m, EntryResult& r) {
  if (m.repeat) {
    const Content* cached = ng.contents.Repeat(m.cache_key);
    if (cached == nullptr) {
      ++r.key_mismatches;
      r.error = OutOfOrder(
          v1::INVALID_MANIFEST,
          absl::StrCat("job ", job.job_id, " group \"", m.group_id, "\" step ", m.step,
                       ": repeat-form manifest with cache key ", absl::Hex(m.cache_key),
                       " but node \"", node.node_id, "\"'s previous manifest for this group ",
                       ng.contents.current() == nullptr
                           ? std::string("is unknown here")
                           : absl::StrCat("has key ", absl::Hex(ng.contents.current()->key)),
                       "; resend this step in full form"),
          job.job_id, m.group_id, m.step);
      r.error.set_resend_full_form(true);
      return nullptr;
    }
    ++r.cache_hits;
    ++g.cache_hits;
    return cached;
  }
  const size_t num_params = g.registration.variant(ng.variant).spec.params.size();
  const ServedRanks served{node.node_id, static_cast<int>(node.ranks.size()), node.rank_set,
                           node.word_lo, node.word_hi};
  std::shared_ptr<const Content> predecoded =
      m.predecoded != nullptr ? ContentFromPredecoded(served, num_params, *m.full, *m.predecoded)
                              : nullptr;
  absl::StatusOr<std::shared_ptr<const Content>> parsed =
      predecoded != nullptr ? std::move(predecoded)
                            : ParseContent(served, num_params, job.world_size, *m.full);
  if (!parsed.ok()) {
    const bool non_float = wire::KindOf(parsed.status()) == v1::NON_FLOAT_DTYPE;
    r.error = Error(non_float ? v1::NON_FLOAT_DTYPE : v1::INVALID_MANIFEST,
                    absl::StrCat("job ", job.job_id, ": ", parsed.status().message()), job.job_id,
                    m.group_id, m.step);
    return nullptr;
  }
  r.retained += ng.contents.Replace(*std::move(parsed));
  ++r.cache_misses;
  ++g.cache_misses;
  return ng.contents.current().get();
}

Coordinator::PendingStep* Coordinator::PendingStepFor(const Job& job, GroupState& g,
                                                      const ManifestRef& m, absl::Time now,
                                                      EntryResult& r) const {
  auto pit = g.pending.find(m.step);
  if (pit != g.pending.end()) return &pit->second;
  if (static_cast<int>(g.pending.size()) >= options_.max_pending_steps) {
    r.error = Error(v1::LIMIT_EXCEEDED,
                    absl::StrCat("job ", job.job_id, " group \"", m.group_id, "\" step ", m.step,
                                 ": ", g.pending.size(),
                                 " steps of this group are already waiting for ranks "
                                 "(--max_pending_steps); some ranks are far behind"),
                    job.job_id, m.group_id, m.step);
    return nullptr;
  }
  auto [it, wake] = StartStep(job, g, m.step, now);
  r.wake = std::min(r.wake, wake);
  return &it->second;
}

Coordinator::Added Coordinator::AddContribution(const Job& job, NodeState& node, NodeGroupState& ng,
                                                const ManifestRef& m, const Content* content,
                                                PendingStep& p, v1::DecisionError& error) {
  if (ng.contents.Contributed(m.step)) {
    // The node already spoke for this step: an identical resend is a no-op;
    // ranks that joined the node late may add a disjoint contribution.
    RankSet earlier(job.world_size);
    for (const Contribution& c : p.contributions) {
      if (c.node != &node) continue;
      if (c.content == content ||
          (c.content->key == content->key && *c.content->ranks == *content->ranks)) {
        return Added::kResent;
      }
      earlier.Union(*c.content->ranks);
    }
    if (earlier.Intersects(*content->ranks)) {
      // A restarted relay resends in parts what it had sent as one manifest
      // (docs/ARCHITECTURE.md, "Relays"): ranks already spoken for add nothing.
      RankSet both = earlier;
      both.Union(*content->ranks);
      if (both == earlier) return Added::kResent;
      error = OutOfOrder(v1::INVALID_MANIFEST,
                         absl::StrCat("job ", job.job_id, " group \"", m.group_id, "\" step ",
                                      m.step, ": node \"", node.node_id,
                                      "\" sent a second, different manifest for ranks it already "
                                      "reported at this step"),
                         job.job_id, m.group_id, m.step);
      return Added::kRefused;
    }
  } else {
    ng.contents.AddStep(m.step);
  }
  // content is the cache's current one here: its key and rank count are in
  // the cache (no Content access, and no reference count traffic, per repeat).
  p.ranks_covered += ng.contents.rank_count();
  p.combined_key += MixKey(ng.contents.key());
  p.contributions.push_back(Contribution{&node, content, &ng});
  p.all_repeat = p.all_repeat && m.repeat;
  ng.contents.CountSkips();
  return Added::kAdded;
}

bool Coordinator::SameAsPrevious(const GroupState& g, const PendingStep& p) {
  return p.all_repeat && g.last_ok && g.last_decision != nullptr &&
         p.combined_key == g.last_combined_key;
}

absl::StatusOr<Decision> Coordinator::ComputeDecision(const RegVariant& agreed, int world_size,
                                                      int64_t step, const PendingStep& p) {
  StepMerger merger(agreed.spec.params.size(), world_size, step);
  for (const Contribution& c : p.contributions) merger.Add(*c.content);
  return merger.Decide(agreed);
}

void Coordinator::DecideReadyLocked(Job& job, Outbox& out) {
  if (ready_.empty()) return;
  std::vector<ReadyStep> ready = std::move(ready_);
  ready_.clear();
  // The steps that need a core Decide, and what each one's merge costs.
  struct Work {
    const RegVariant* agreed;
    const PendingStep* step;
    int64_t step_id;
    std::optional<absl::StatusOr<Decision>> decision;
  };
  std::vector<Work> work;
  std::vector<int> work_of(ready.size(), -1);
  int64_t contents = 0;
  for (size_t i = 0; i < ready.size(); ++i) {
    GroupState& g = *ready[i].group;
    const PendingStep& p = g.pending.at(ready[i].step);
    if (SameAsPrevious(g, p)) continue;
    work_of[i] = static_cast<int>(work.size());
    work.push_back(Work{&g.registration.reference(), &p, ready[i].step, std::nullopt});
    contents += static_cast<int64_t>(p.contributions.size());
  }
  if (work.size() >= 2 && pool_->threads() > 1 &&
      contents >= options_.parallel_decide_min_contents) {
    // Each part reads its step's contents and registration (unchanged until
    // the loop returns) and writes its own slot.
    const int world = job.world_size;
    pool_->ParallelFor(static_cast<int64_t>(work.size()), [&work, world](int64_t i) {
      Work& w = work[i];
      w.decision = ComputeDecision(*w.agreed, world, w.step_id, *w.step);
    });
    stats_.parallel_decides += static_cast<int64_t>(work.size());
  }
  for (size_t i = 0; i < ready.size(); ++i) {
    GroupState& g = *ready[i].group;
    g.ready = false;
    PendingStep& p = g.pending.at(ready[i].step);
    absl::StatusOr<Decision>* computed = nullptr;
    if (work_of[i] >= 0 && work[work_of[i]].decision.has_value()) {
      computed = &*work[work_of[i]].decision;
    }
    DecideStepLocked(job, g, ready[i].step, p, computed, out);
    g.pending.erase(ready[i].step);
  }
}

void Coordinator::DecideStepLocked(Job& job, GroupState& g, int64_t step, PendingStep& p,
                                   absl::StatusOr<Decision>* computed, Outbox& out) {
  const uint64_t combined = p.combined_key;
  v1::Decision* d = out.broadcast_decisions[&job].mutable_decisions()->add_decisions();
  d->set_group_id(g.group_id);
  d->set_step(step);
  d->set_wait_us(absl::ToInt64Microseconds(clock_->Now() - p.clock.first_seen()));
  ++stats_.decisions;
  if (SameAsPrevious(g, p)) {
    d->set_same_as_previous(true);
    ++stats_.same_as_previous;
    g.last_decided_step = step;
    // The stored full decision stands for this step too (resends patch the
    // step and wait; no copy per repeated decision).
    g.last_decision_wait_us = d->wait_us();
    ObserveDecisionLocked(job, g, step, p, *d, nullptr);
    return;
  }
  absl::StatusOr<Decision> decision =
      computed != nullptr ? std::move(*computed)
                          : ComputeDecision(g.registration.reference(), job.world_size, step, p);
  if (decision.ok()) {
    wire::DecisionToProto(*decision, d->mutable_ok());
    g.last_ok = true;
  } else {
    *d->mutable_error() =
        ErrorFrom(v1::INVALID_MANIFEST, decision.status(), absl::StrCat("job ", job.job_id, ": "),
                  job.job_id, g.group_id, step);
    g.last_ok = false;
    NoteErrorLocked(d->error());
  }
  g.last_decided_step = step;
  g.last_combined_key = combined;
  g.last_decision = std::make_shared<const v1::Decision>(*d);
  g.last_decision_wait_us = d->wait_us();
  ObserveDecisionLocked(job, g, step, p, *d, decision.ok() ? &*decision : nullptr);
}

Coordinator::StepFacts::StepFacts(const Job& job, const GroupState& g, const PendingStep& at)
    : job_(job), at_(at), last_decided_(g.last_decided_step), submitted_(job.world_size) {
  auto submitted = [&](const PendingStep& p) {
    RankSet set(job.world_size);
    for (const Contribution& c : p.contributions) set.Union(*c.content->ranks);
    for (int r : p.clock.reported()) {
      if (r >= 0 && r < job.world_size) set.Add(r);
    }
    return set;
  };
  submitted_ = submitted(at);
  for (auto it = g.pending.rbegin(); it != g.pending.rend() && it->first > last_decided_; ++it) {
    if (&it->second == &at) continue;
    later_.emplace_back(it->first, submitted(it->second));
  }
}

int64_t Coordinator::StepFacts::LastStep(int rank) const {
  // Every rank submitted every decided step of the group.
  int64_t last = last_decided_;
  for (const auto& [step, ranks] : later_) {
    if (step > last && ranks.Contains(rank)) {
      last = step;
      break;  // newest first
    }
  }
  // Its sidecar's answer about this group (it holds steps not sent yet).
  for (const auto& [r, step] : at_.clock.last_steps()) {
    if (r == rank) last = std::max(last, step);
  }
  return last;
}

Coordinator::StepFacts::Missing Coordinator::StepFacts::AtFault() const {
  Missing out;
  for (int r : submitted_.Missing()) {
    (job_.members.Gone(r) ? out.named : out.waiting).push_back(r);
  }
  if (out.named.empty()) std::swap(out.named, out.waiting);
  return out;
}

v1::DecisionError Coordinator::MissingRanksErrorLocked(const Job& job, const GroupState& g,
                                                       int64_t step, const PendingStep& p,
                                                       absl::string_view why) {
  const StepFacts facts(job, g, p);
  const StepFacts::Missing missing = facts.AtFault();
  std::vector<std::string> parts;
  v1::DecisionError err;
  for (int r : missing.named) {
    const int64_t last = facts.LastStep(r);
    err.add_ranks(r);
    err.add_last_steps(last);
    if (parts.size() < 32) {
      const NodeState* owner = job.members.OwnerOf(r);
      std::string node = owner ? owner->node_id : std::string();
      for (const auto& [pr, pn] : p.clock.rank_nodes()) {
        if (pr == r) node = pn;  // the sidecar behind a relay
      }
      parts.push_back(
          absl::StrCat("rank ", r, " (last step ", last, ", node ",
                       node.empty() ? std::string("unknown") : absl::StrCat("\"", node, "\""),
                       // Only a rank known to have submitted a later step of
                       // this group skipped this one (e.g. its step counter
                       // moved on across a restart): it will never submit it.
                       last > step ? ", past this step: it skipped it" : "", ")"));
    }
  }
  if (missing.named.size() > parts.size()) {
    parts.push_back(absl::StrCat("and ", missing.named.size() - parts.size(), " more"));
  }
  std::vector<int> submitted;
  for (int r = 0; r < job.world_size; ++r) {
    if (facts.Submitted(r)) submitted.push_back(r);
  }
  std::string msg = absl::StrCat(
      "job ", job.job_id, " group \"", g.group_id, "\" step ", step, ": ", why, "; missing ranks ",
      FormatRanks(missing.named), ": ", absl::StrJoin(parts, ", "), "; ",
      submitted.empty() ? std::string("no rank submitted it")
                        : absl::StrCat("ranks ", FormatRanks(submitted), " submitted it"),
      missing.waiting.empty()
          ? std::string()
          : absl::StrCat("; not yet heard from ranks ", FormatRanks(missing.waiting),
                         ", which are still connected"),
      ". Check the missing ranks' processes and their sidecars' logs; the job is failed");
  v1::DecisionError e = Error(v1::MISSING_RANKS, std::move(msg), job.job_id, g.group_id, step);
  *e.mutable_ranks() = err.ranks();
  *e.mutable_last_steps() = err.last_steps();
  return e;
}

void Coordinator::FailJobLocked(Job& job, GroupState* culprit, int64_t culprit_step,
                                v1::DecisionError error, Outbox& out) {
  ACCORD_LOG(ERROR) << error.message();
  job.Fail(error);
  NoteErrorLocked(error);
  // The run's key-value entries (bootstrap keys) are of no use any more:
  // dropped now. Keys set after the failure (e.g. a coordinated shutdown) go
  // to a fresh scope, which the run's end drops; a late drop of the old
  // scope can never take them.
  runs_.Fail(job.job_id, job.run_id, error);
  v1::DecisionBatch& batch = *out.broadcast_decisions[&job].mutable_decisions();
  // In group id order, so every coordinator sends the same message.
  std::vector<GroupState*> waiting;
  for (auto& [gid, g] : job.groups) {
    if (!g.pending.empty()) waiting.push_back(&g);
  }
  std::sort(waiting.begin(), waiting.end(),
            [](const GroupState* a, const GroupState* b) { return a->group_id < b->group_id; });
  for (GroupState* g : waiting) {
    for (auto& [step, p] : g->pending) {
      v1::Decision* d = batch.add_decisions();
      d->set_group_id(g->group_id);
      d->set_step(step);
      *d->mutable_error() = error;
      if (g != culprit || step != culprit_step) d->mutable_error()->set_kind(v1::JOB_FAILED);
    }
    g->pending.clear();
  }
  // Registrations still collecting can never complete now: every rank that
  // registered one (and any that registers it later) gets the failure, in
  // group id order.
  std::vector<GroupState*> collecting;
  for (auto& [gid, g] : job.groups) {
    if (g.registration.state() == GroupRegistration::State::kCollecting) collecting.push_back(&g);
  }
  std::sort(collecting.begin(), collecting.end(),
            [](const GroupState* a, const GroupState* b) { return a->group_id < b->group_id; });
  for (GroupState* g : collecting) {
    v1::DecisionError e = error;
    if (g != culprit || culprit_step != -1) e.set_kind(v1::JOB_FAILED);
    g->registration.Fail(e);
    v1::CoordinatorMessage msg;
    msg.mutable_registration()->set_group_id(g->group_id);
    *msg.mutable_registration()->mutable_error() = std::move(e);
    out.broadcast_other.emplace_back(&job, std::move(msg));
  }
}

void Coordinator::FailRegistrationAtDeadlineLocked(Job& job, GroupState& g, Outbox& out) {
  const std::vector<int> missing = g.registration.Unregistered();
  std::vector<std::string> parts;
  for (int r : missing) {
    if (parts.size() == 32) {
      parts.push_back(absl::StrCat("and ", missing.size() - 32, " more"));
      break;
    }
    parts.push_back(job.members.Describe(r));
  }
  std::vector<int> registered;
  for (int r = 0, m = 0; r < job.world_size; ++r) {
    if (m < static_cast<int>(missing.size()) && missing[m] == r) {
      ++m;
    } else {
      registered.push_back(r);
    }
  }
  v1::DecisionError err = Error(
      v1::MISSING_RANKS,
      absl::StrCat("job ", job.job_id, " group \"", g.group_id,
                   "\": not every rank registered the group within ",
                   absl::FormatDuration(options_.deadline),
                   " of its first registration (--deadline); missing ranks ", FormatRanks(missing),
                   ": ", absl::StrJoin(parts, ", "), "; ",
                   registered.empty()
                       ? std::string("no rank registered it")
                       : absl::StrCat("ranks ", FormatRanks(registered), " registered it"),
                   ". Check that the missing ranks run and register this group (every rank must "
                   "build and wrap the same model), their processes and their sidecars' logs; the "
                   "job is failed"),
      job.job_id, g.group_id, -1);
  for (int r : missing) {
    err.add_ranks(r);
    err.add_last_steps(-1);  // none of this group: it was never registered
  }
  FailJobLocked(job, &g, -1, std::move(err), out);
}

bool Coordinator::AskProgressLocked(Job& job, GroupState& g, int64_t step, PendingStep& p,
                                    absl::Time now, Outbox& out) {
  RankSet covered(job.world_size);
  for (const Contribution& c : p.contributions) covered.Union(*c.content->ranks);
  std::vector<const NodeState*> asked;
  for (int r : covered.Missing()) {
    const NodeState* owner = job.members.OwnerOf(r);
    if (owner == nullptr || !owner->connected() || owner->sink == nullptr ||
        !owner->answers_progress) {
      continue;
    }
    if (std::find(asked.begin(), asked.end(), owner) == asked.end()) asked.push_back(owner);
  }
  if (asked.empty()) return false;
  for (const NodeState* node : asked) {
    v1::CoordinatorMessage q;
    q.mutable_progress_query()->set_group_id(g.group_id);
    q.mutable_progress_query()->set_step(step);
    out.direct.emplace_back(node->sink, std::move(q));
  }
  ACCORD_LOG(WARNING) << "job " << job.job_id << " group \"" << g.group_id << "\" step " << step
                      << ": deadline passed; asking " << asked.size()
                      << " node(s) which of their ranks submitted";
  // A short grace past the deadline: a quarter of it, at most one second.
  p.clock.Ask(std::move(asked), now + std::min(absl::Seconds(1), options_.deadline / 4));
  return true;
}

void Coordinator::RecordProgressLocked(const Job& job, const NodeState& node,
                                       const v1::NodeProgress& progress, PendingStep& p) {
  // Trust a node only about its own ranks.
  auto own = [&](int r) { return r >= 0 && r < job.world_size && job.members.OwnerOf(r) == &node; };
  for (int r : progress.reported()) {
    if (own(r)) p.clock.AddReported(r);
  }
  const int n = std::min(progress.ranks_size(), progress.last_steps_size());
  for (int i = 0; i < n; ++i) {
    if (own(progress.ranks(i))) {
      p.clock.AddLastStep(progress.ranks(i), progress.last_steps(i));
      if (progress.rank_nodes_size() == progress.ranks_size()) {
        p.clock.AddRankNode(progress.ranks(i), progress.rank_nodes(i));
      }
    }
  }
}

void Coordinator::HandleProgressLocked(Session& s, const v1::NodeProgress& progress) {
  Job& job = *s.job;
  auto git = job.groups.find(progress.group_id());
  if (git == job.groups.end()) return;
  auto pit = git->second.pending.find(progress.step());
  if (pit == git->second.pending.end()) return;
  PendingStep& p = pit->second;
  const StepDeadline::Answered answered = p.clock.Answer(s.node, clock_->Now());
  if (answered == StepDeadline::Answered::kIgnored) return;
  RecordProgressLocked(job, *s.node, progress, p);
  if (answered == StepDeadline::Answered::kAll) {
    next_deadline_ = p.clock.grace_end();
    timer_cv_.SignalAll();
  }
}

void Coordinator::HandlePartialProgressLocked(Session& s, const v1::NodeProgress& progress) {
  Job& job = *s.job;
  if (job.failed()) return;  // every rank already has the job's failure
  auto git = job.groups.find(progress.group_id());
  if (git == job.groups.end() ||
      git->second.registration.state() != GroupRegistration::State::kAgreed)
    return;
  GroupState& g = git->second;
  const int64_t step = progress.step();
  // Decided already (the decision is on its way) or nonsense: nothing to time.
  if (step < 0 || step <= g.last_decided_step) return;
  auto pit = g.pending.find(step);
  if (pit == g.pending.end()) {
    if (static_cast<int>(g.pending.size()) >= options_.max_pending_steps) return;
    // The step began when the node's first rank submitted it, not now.
    const absl::Duration waited = std::clamp(absl::Microseconds(progress.waited_us()),
                                             absl::ZeroDuration(), options_.deadline);
    pit = StartStepLocked(job, g, step, clock_->Now() - waited);
    ACCORD_LOG(INFO) << "job " << job.job_id << " group \"" << g.group_id << "\" step " << step
                     << ": node \"" << s.node->node_id << "\" reports " << progress.reported_size()
                     << " of its ranks submitted it " << absl::FormatDuration(waited)
                     << " ago and others not; the deadline clock runs";
  }
  RecordProgressLocked(job, *s.node, progress, pit->second);
}

void Coordinator::CheckDeadlines() {
  CheckDeadlinesWithoutDelivery();
  DeliverRunEnds();
  DeliverEvents();
}

bool Coordinator::CheckStepLocked(Job& job, GroupState& g, int64_t step, PendingStep& p,
                                  absl::Time now, absl::Time& next, Outbox& out) {
  switch (p.clock.Check(now, options_.observer != nullptr, next)) {
    case StepDeadline::Due::kNothing:
      return false;
    case StepDeadline::Due::kStall:
      ObserveStallLocked(job, g, step, p, now);
      return false;
    case StepDeadline::Due::kAsk:
      if (AskProgressLocked(job, g, step, p, now, out)) {
        next = std::min(next, p.clock.grace_end());
        return false;
      }
      break;  // nobody to ask: the step fails now
    case StepDeadline::Due::kFail:
      break;
  }
  return true;
}

void Coordinator::FailStepAtDeadlineLocked(Job& job, GroupState& g, int64_t step, PendingStep& p,
                                           absl::Time now, Outbox& out) {
  // Ranks their sidecar saw submit are not missing (their node waits for a
  // node-mate); StepFacts names only the others.
  v1::DecisionError err = MissingRanksErrorLocked(
      job, g, step, p,
      absl::StrCat("not every rank reported within ", absl::FormatDuration(options_.deadline),
                   " of the step's first submission (--deadline)"));
  ObserveDeadlineFailureLocked(job, g, step, p, err, now);
  FailJobLocked(job, &g, step, std::move(err), out);
}

void Coordinator::CheckDeadlinesWithoutDelivery() {
  accord::MutexLock l(&mu_);
  const absl::Time now = clock_->Now();
  Outbox out;
  absl::Time next = absl::InfiniteFuture();
  for (auto& [job_id, job] : jobs_) {
    if (!job.wave.sessions.empty()) {
      // A wave still waiting at its stall or deadline check becomes pending
      // steps, which the loop below checks.
      if (job.wave.wake <= now) {
        BreakWaveLocked(job, out);
      } else {
        next = std::min(next, job.wave.wake);
      }
    }
    if (FailIfNodeLostLocked(job, now, next, out)) continue;
    // In (group id, step) order, so the first step due to fail, which names
    // the failure, does not depend on the order of the group table.
    std::vector<GroupState*> waiting;
    // The lowest group id whose registration is past its deadline names the
    // failure; the registrations are checked before the steps.
    GroupState* unregistered = nullptr;
    for (auto& [gid, g] : job.groups) {
      if (!g.pending.empty()) waiting.push_back(&g);
      if (g.registration.state() != GroupRegistration::State::kCollecting ||
          g.registration_due == absl::InfiniteFuture() || job.failed()) {
        continue;
      }
      if (g.registration_due > now) {
        next = std::min(next, g.registration_due);
      } else if (unregistered == nullptr || g.group_id < unregistered->group_id) {
        unregistered = &g;
      }
    }
    if (unregistered != nullptr) {
      FailRegistrationAtDeadlineLocked(job, *unregistered, out);
      continue;
    }
    std::sort(waiting.begin(), waiting.end(),
              [](const GroupState* a, const GroupState* b) { return a->group_id < b->group_id; });
    bool failed_now = false;
    for (GroupState* g : waiting) {
      for (auto& [step, p] : g->pending) {
        if (CheckStepLocked(job, *g, step, p, now, next, out)) {
          // The group's oldest waiting step names the failure: a later step
          // is due first only when it arrived first, e.g. after a restart
          // where a rank skipped the older one (named "past this step").
          auto oldest = g->pending.begin();
          FailStepAtDeadlineLocked(job, *g, oldest->first, oldest->second, now, out);
          failed_now = true;
          break;
        }
      }
      if (failed_now) break;
    }
  }
  next = std::min(next, ExpireStartingRunsLocked(now));
  next_deadline_ = next;
  FlushLocked(out);
}

CoordinatorStats Coordinator::stats() {
  accord::MutexLock l(&mu_);
  return stats_;
}

absl::StatusOr<std::vector<int64_t>> Coordinator::RankLastSteps(const std::string& job_id) {
  accord::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job ", job_id));
  std::vector<int64_t> out(it->second.world_size);
  for (int r = 0; r < it->second.world_size; ++r) out[r] = it->second.members.LastStep(r);
  return out;
}

absl::StatusOr<SkipMatrix> Coordinator::SkipCounts(const std::string& job_id,
                                                   const std::string& group_id) {
  // Per-node counts are copied under the lock (O(nodes x params)); the
  // per-rank rows (O(world x params)) are built outside it.
  struct NodeCounts {
    std::vector<int> ranks;
    std::vector<int64_t> node_skips;
    absl::flat_hash_map<int, std::vector<int64_t>> rank_extra_skips;
  };
  std::vector<NodeCounts> nodes;
  SkipMatrix out;
  {
    accord::MutexLock l(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job ", job_id));
    Job& job = it->second;
    auto git = job.groups.find(group_id);
    if (git == job.groups.end() || git->second.registration.empty()) {
      return absl::NotFoundError(absl::StrCat("job ", job_id, " has no group \"", group_id, "\""));
    }
    const GroupState& g = git->second;
    const GroupSpec& spec = g.registration.reference().spec;
    for (const ParamSpec& p : spec.params) out.param_names.push_back(p.name);
    for (auto& [node_id, node] : job.members.nodes()) {
      auto ngit = node.groups.find(group_id);
      if (ngit == node.groups.end()) continue;
      NodeGroupState& ng = ngit->second;
      CountWaveSkips(g, ng);
      ng.contents.FlushSkips();
      nodes.push_back(
          NodeCounts{node.ranks, ng.contents.node_skips(), ng.contents.rank_extra_skips()});
    }
  }
  const size_t n = out.param_names.size();
  for (const NodeCounts& node : nodes) {
    for (int r : node.ranks) {
      std::vector<int64_t>& row = out.skips[r];
      row.assign(n, 0);
      for (size_t i = 0; i < n && i < node.node_skips.size(); ++i) row[i] += node.node_skips[i];
      if (auto e = node.rank_extra_skips.find(r); e != node.rank_extra_skips.end()) {
        for (size_t i = 0; i < n && i < e->second.size(); ++i) row[i] += e->second[i];
      }
    }
  }
  return out;
}

}  // namespace accord::daemon
