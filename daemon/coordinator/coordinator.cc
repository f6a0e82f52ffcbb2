#include "daemon/coordinator/coordinator.h"

#include <algorithm>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "daemon/common/node_hello.h"
#include "daemon/coordinator/coordinator_effects.h"
#include "daemon/coordinator/located_errors.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

using located::Error;
using located::ErrorFrom;
using located::OutOfOrder;

uint64_t RunSeed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// Decodes the full-form manifests of a batch without the lock (one entry
// per manifest, in order; empty for any other message): streams read on
// several threads decode side by side (docs/ARCHITECTURE.md, "More than one
// core").
std::vector<PredecodedContent> DecodeBeforeLock(const v1::NodeMessage& message) {
  std::vector<PredecodedContent> out;
  if (!message.has_manifests() || message.manifests().manifests_size() == 0 ||
      message.manifests().manifests(0).repeat()) {
    return out;
  }
  out.reserve(message.manifests().manifests_size());
  for (const v1::Manifest& m : message.manifests().manifests()) out.push_back(PredecodeContent(m));
  return out;
}

}  // namespace

void EventQueue::Push(ObserveEvent event) {
  accord::MutexLock l(&mu_);
  events_.push_back(std::move(event));
  have_events_.store(true, std::memory_order_release);
}

std::vector<ObserveEvent> EventQueue::Take() {
  std::vector<ObserveEvent> out;
  if (!have_events_.load(std::memory_order_acquire)) return out;
  accord::MutexLock l(&mu_);
  out.swap(events_);
  have_events_.store(false, std::memory_order_relaxed);
  return out;
}

v1::DecisionBatch* Coordinator::Outbox::ReplyBatch(NodeSink* sink) {
  for (auto& [s, msg] : direct) {
    if (s == sink && msg.has_decisions()) return msg.mutable_decisions();
  }
  direct.emplace_back(sink, v1::CoordinatorMessage());
  return direct.back().second.mutable_decisions();
}

Coordinator::Coordinator(CoordinatorOptions options, Clock* clock)
    : options_(options), timer_(clock), runs_(RunSeed()) {
  int threads = options_.decide_threads;
  if (threads <= 0) threads = std::clamp<int>(std::thread::hardware_concurrency(), 1, 8);
  pool_ = std::make_unique<WorkerPool>(threads);
  if (options_.start_timer_thread) timer_.Start([this] { CheckDeadlines(); });
}

Coordinator::~Coordinator() { Stop(); }

void Coordinator::Stop() { timer_.Stop(); }

Coordinator::SessionId Coordinator::OpenSession(NodeSink* sink) {
  accord::MutexLock l(&mu_);
  const SessionId id = next_session_++;
  sessions_[id].sink = sink;
  ++stats_.sessions;
  return id;
}

void Coordinator::CloseSession(SessionId id) {
  {
    accord::MutexLock l(&mu_);
    auto it = sessions_.find(id);
    if (it != sessions_.end()) {
      const Session s = it->second;
      const absl::Time now = timer_.Now();
      Outbox out;
      Effects fx(*this, out, s.job);
      // Its held-back repeat (if any) counts as sent before the stream ended.
      if (s.job != nullptr) s.job->BreakWave(now, fx);
      FlushLocked(out);
      sessions_.erase(it);
      --stats_.sessions;
      if (s.stream != nullptr && s.job->Disconnect(*s.stream, now, fx)) {
        s.job->FailForAWaitGivenUp(/*leaving=*/-1, /*all_gone=*/true, now, fx);
        const JobCore& core = s.job->core();
        if (const Run* run = runs_.Find(core.job_id);
            run != nullptr && run->run_id == core.run_id && run->state != RunState::kFailed) {
          runs_.NoteLastNodeGone(core.job_id, core.run_id, now, options_.node_reconnect_grace);
        }
        RemoveJobLocked(s.job);
      }
    }
  }
  Deliver();
}

void Coordinator::HandleMessage(SessionId id, const v1::NodeMessage& message) {
  // Full forms' dtypes are decoded here, before the lock.
  std::vector<PredecodedContent> predecoded = DecodeBeforeLock(message);
  {
    accord::MutexLock l(&mu_);
    auto it = sessions_.find(id);
    if (it != sessions_.end()) {
      Outbox out;
      DispatchLocked(id, it->second, message, &predecoded, out);
      FlushLocked(out);
    }
  }
  Deliver();
}

void Coordinator::DispatchLocked(SessionId id, Session& s, const v1::NodeMessage& message,
                                 std::vector<PredecodedContent>* predecoded, Outbox& out) {
  if (message.has_manifests()) {
    ++(message.manifests().repeat_batch_key() != 0 ? stats_.batch_repeats
                                                   : stats_.manifest_batches);
  }
  if (options_.repeat_waves && message.has_manifests() && s.stream != nullptr) {
    // The clock is read only when a wave starts or completes: a join is
    // O(1) per node.
    Effects fx(*this, out, s.job);
    if (s.job->TryJoinWave(
            *s.stream, message.manifests(), [this] { return timer_.Now(); }, fx)) {
      return;
    }
  }
  const absl::Time now = timer_.Now();
  if (options_.repeat_waves) {
    // Anything else first settles the job's held-back repeats.
    Job* job = s.job;
    if (job == nullptr && message.has_hello()) {
      auto jit = jobs_.find(message.hello().job_id());
      if (jit != jobs_.end()) job = &jit->second;
    }
    Effects fx(*this, out, job);
    if (job != nullptr) job->BreakWavesFor(s.stream, message, now, fx);
  }
  Effects fx(*this, out, s.job);
  switch (message.body_case()) {
    case v1::NodeMessage::kHello:
      HandleHelloLocked(id, s, message.hello(), out);
      break;
    case v1::NodeMessage::kRegistration:
    case v1::NodeMessage::kManifests:
    case v1::NodeMessage::kRankEvent:
    case v1::NodeMessage::kProgress:
      if (s.stream == nullptr) {
        fx.SendError(s.sink, OutOfOrder(v1::INVALID_REQUEST,
                                        "node message before NodeHello (or after the job's state "
                                        "was dropped); send NodeHello first"));
      } else if (message.has_registration()) {
        s.job->HandleRegistration(*s.stream, message.registration(), now, fx);
      } else if (message.has_rank_event()) {
        // A leave after a cut key-value wait fails the job with that wait's
        // words before any step the rank misses names it.
        if (!message.rank_event().joined()) {
          s.job->FailForAWaitGivenUp(message.rank_event().rank(), false, now, fx);
        }
        s.job->HandleRankEvent(*s.stream, message.rank_event(), fx);
      } else if (message.has_progress()) {
        s.job->HandleProgress(*s.stream, message.progress(), now, fx);
      } else {
        s.job->HandleManifests(*s.stream, message.manifests(), predecoded, now, fx);
      }
      break;
    default:
      fx.SendError(s.sink, Error(v1::INVALID_REQUEST, "empty or unknown NodeMessage body"));
  }
  // A failure fails every domain's steps: none stays held back.
  if (options_.repeat_waves && s.job != nullptr) s.job->BreakWavesIfFailed(now, fx);
}

void Coordinator::FlushLocked(Outbox& out) {
  for (auto& [sink, msg] : out.direct) {
    if (sink != nullptr) sink->Send(std::make_shared<const v1::CoordinatorMessage>(std::move(msg)));
  }
  auto broadcast = [&](Job* job, v1::CoordinatorMessage&& msg) {
    if (jobs_.find(job->job_id()) == jobs_.end()) return;
    auto shared = std::make_shared<const v1::CoordinatorMessage>(std::move(msg));
    for (auto& [node_id, node] : job->core().members.nodes()) {
      if (node.sink != nullptr) node.sink->Send(shared);
    }
  };
  for (auto& [job, msg] : out.broadcast_other) broadcast(job, std::move(msg));
  for (auto& [job, msg] : out.broadcast_decisions) broadcast(job, std::move(msg));
  if (out.late == nullptr) return;
  for (auto& [sinks, msg] : out.late->scoped_decisions) {
    auto shared = std::make_shared<const v1::CoordinatorMessage>(std::move(msg));
    for (NodeSink* sink : sinks) {
      if (sink != nullptr) sink->Send(shared);
    }
  }
  for (auto& [job, msg] : out.late->broadcast_last) broadcast(job, std::move(msg));
}

absl::Status Coordinator::ValidateHello(const Session& s, const v1::NodeHello& hello,
                                        std::vector<int>& ranks) const {
  if (s.stream != nullptr) {
    return wire::WithKind(
        absl::FailedPreconditionError(absl::StrCat("node \"", s.stream->node->node_id,
                                                   "\" sent a second NodeHello on one session")),
        v1::INVALID_REQUEST);
  }
  absl::StatusOr<std::vector<int>> checked =
      CheckNodeHello(hello, options_.max_world_size, "coordinator");
  if (!checked.ok()) return checked.status();
  ranks = *std::move(checked);
  return absl::OkStatus();
}

absl::StatusOr<Job*> Coordinator::FindOrCreateJobLocked(const v1::NodeHello& hello,
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
  std::unique_ptr<JobObserver> observer;
  if (options_.observer != nullptr) observer = options_.observer->ForJob(hello.job_id(), world);
  Job& job = jobs_
                 .try_emplace(hello.job_id(), hello.job_id(), run_id, world, options_,
                              std::move(observer), pool_.get())
                 .first->second;
  stats_.jobs = static_cast<int64_t>(jobs_.size());
  ACCORD_LOG(INFO) << "job " << job.job_id() << " run " << run_id << ": created with world size "
                   << world << " by node \"" << hello.node_id() << "\"";
  return &job;
}

void Coordinator::HandleHelloLocked(SessionId id, Session& s, const v1::NodeHello& hello,
                                    Outbox& out) {
  auto refuse = [&](const absl::Status& why, std::vector<int> error_ranks = {}) {
    v1::DecisionError e = ErrorFrom(v1::ERROR_KIND_UNSPECIFIED, why, "", hello.job_id());
    for (int r : error_ranks) e.add_ranks(r);
    Effects(*this, out, nullptr).SendError(s.sink, std::move(e));
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
  if (absl::Status joins = job.CheckJoin(hello, ranks); !joins.ok()) {
    std::vector<int> held;
    if (wire::KindOf(joins) == v1::DUPLICATE_RANK) {
      held.push_back(job.core().members.HeldElsewhere(hello.node_id(), ranks));
    }
    refuse(joins, std::move(held));
    if (job.core().members.connected() == 0) RemoveJobLocked(&job);
    return;
  }
  PlaceNodeLocked(id, s, job, hello, ranks, out);
}

void Coordinator::PlaceNodeLocked(SessionId id, Session& s, Job& job, const v1::NodeHello& hello,
                                  const std::vector<int>& ranks, Outbox& out) {
  Effects fx(*this, out, &job);
  SessionId replaced = 0;
  NodeStream& stream = job.Connect(id, s.sink, hello, ranks, fx, &replaced);
  if (auto old = sessions_.find(replaced); replaced != 0 && old != sessions_.end()) {
    // The same node reconnected before its old stream was noticed as gone.
    old->second.job = nullptr;
    old->second.stream = nullptr;
  }
  s.job = &job;
  s.stream = &stream;
}

void Coordinator::RemoveJobLocked(Job* job) {
  for (auto& [id, s] : sessions_) {
    if (s.job == job) {
      s.job = nullptr;
      s.stream = nullptr;
    }
  }
  const JobCore& core = job->core();
  if (!core.groups.empty()) RetireJobLocked(*job);
  // Usage windows not handed to a retired job are freed with the job.
  for (const auto& [group_id, g] : core.groups) stats_.usage_bytes -= g.usage.bytes();
  for (const auto& [node_id, node] : core.members.nodes()) {
    for (const auto& [group_id, ng] : node.groups) {
      stats_.retained_contents -= static_cast<int64_t>(ng.contents.retained());
    }
  }
  const std::string job_id = core.job_id;
  const std::string run_id = core.run_id;
  jobs_.erase(job_id);
  stats_.jobs = static_cast<int64_t>(jobs_.size());
  Run* run = runs_.Find(job_id);
  if (run == nullptr || run->run_id != run_id) return;
  ACCORD_LOG(INFO) << "job " << job_id << " run " << run_id
                   << " ended; its state and keys are dropped";
  // A failed run is never resumed (its late requests get RUN_ENDED); a
  // healthy one whose last node only lost its connection may be (its
  // sidecar's RESUME takes it over, as after a coordinator restart).
  // The end of a failed run drops its fresh key scope: a wait still there
  // (a rank that reached the run late) ends with the run's failure, the
  // words its other ranks got, not with the end.
  if (run->state == RunState::kFailed) {
    runs_.Remember(job_id, *run, run->failure);
    runs_.End(job_id, run_id, wire::ErrorToStatus(run->failure));
  } else {
    runs_.End(job_id, run_id,
              wire::KindError(v1::RUN_ENDED, absl::StrCat("job ", job_id, " run ", run_id,
                                                          " ended: its last node left")));
  }
  stats_.runs = static_cast<int64_t>(runs_.size());
}

void Coordinator::Deliver() {
  // In order across threads: a failed run's drop moves its waiters to the
  // fresh scope before that scope's own end drops it; events reach the
  // observer in the order they happened.
  accord::MutexLock order(&deliver_mu_);
  std::vector<EndedRun> ended;
  {
    accord::MutexLock l(&mu_);
    ended = runs_.TakeEnded();
  }
  if (options_.on_run_ended) {
    for (const EndedRun& e : ended) options_.on_run_ended(e.job_id, e.run_id, e.why, e.successor);
  }
  if (options_.observer == nullptr) return;
  for (const ObserveEvent& e : events_.Take()) options_.observer->OnEvent(e);
}

void Coordinator::CheckDeadlines() {
  {
    accord::MutexLock l(&mu_);
    const absl::Time now = timer_.Now();
    Outbox out;
    absl::Time next = absl::InfiniteFuture();
    for (auto& [job_id, job] : jobs_) {
      Effects fx(*this, out, &job);
      // A node lost past its grace after its rank's key-value wait was cut:
      // that verdict came first.
      job.FailForAWaitGivenUp(/*leaving=*/-1, /*all_gone=*/false, now, fx);
      next = std::min(next, job.CheckDeadlines(now, fx));
    }
    next = std::min(next, ExpireStartingRunsLocked(now));
    timer_.SetNext(next);
    FlushLocked(out);
  }
  Deliver();
}

int Coordinator::WorldSize(const std::string& job_id) {
  accord::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? 0 : it->second.core().world_size;
}

std::vector<std::string> Coordinator::DescribeRanks(const std::string& job_id,
                                                    const std::vector<int>& ranks) {
  std::vector<std::string> out;
  accord::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return out;
  const JobCore& job = it->second.core();
  out.reserve(ranks.size());
  for (int r : ranks) {
    out.push_back(r >= 0 && r < job.world_size ? job.members.Describe(r)
                                               : absl::StrCat("rank ", r, " (outside the world)"));
  }
  return out;
}

CoordinatorStats Coordinator::stats() {
  accord::MutexLock l(&mu_);
  return stats_;
}

}  // namespace accord::daemon
