#include "daemon/coordinator/coordinator.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/log.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

constexpr char kServerVersion[] = "accord-coordinator/0.1";

v1::DecisionError Error(v1::ErrorKind kind, absl::StatusCode code, std::string message,
                        absl::string_view job_id = "", absl::string_view group_id = "",
                        int64_t step = -1) {
  v1::DecisionError e = wire::MakeError(kind, absl::Status(code, message));
  e.set_job_id(std::string(job_id));
  e.set_group_id(std::string(group_id));
  e.set_step(step);
  return e;
}

// Mixes one node content key into the order-independent combination of a
// step's contributions.
uint64_t MixKey(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return k;
}

// First parameter index where two specs differ (or the shorter count).
int FirstDifference(const GroupSpec& a, const GroupSpec& b) {
  const size_t n = std::min(a.params.size(), b.params.size());
  for (size_t i = 0; i < n; ++i) {
    if (!(a.params[i] == b.params[i])) return static_cast<int>(i);
  }
  return a.params.size() == b.params.size() ? -1 : static_cast<int>(n);
}

}  // namespace

v1::DecisionBatch* Coordinator::Outbox::ReplyBatch(NodeSink* sink) {
  for (auto& [s, msg] : direct) {
    if (s == sink && msg.has_decisions()) return msg.mutable_decisions();
  }
  direct.emplace_back(sink, v1::CoordinatorMessage());
  return direct.back().second.mutable_decisions();
}

Coordinator::Coordinator(CoordinatorOptions options, Clock* clock)
    : options_(options), clock_(clock) {
  {
    accord::MutexLock l(&mu_);
    std::random_device rd;
    run_nonce_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
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
  Session s = it->second;
  sessions_.erase(it);
  --stats_.sessions;
  if (s.node == nullptr || s.node->session != id) return;
  s.node->session = 0;
  s.node->sink = nullptr;
  s.node->disconnected_at = clock_->Now();
  --s.job->connected_nodes;
  ObserveNodeLocked(*s.job, *s.node, /*connected=*/false);
  if (s.job->connected_nodes == 0) {
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
  if (job.failed || job.connected_nodes == static_cast<int>(job.nodes.size())) return false;
  std::vector<const NodeState*> lost;
  for (const auto& [node_id, node] : job.nodes) {
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
          if (job.rank_owner[r] == node && !covered.Contains(r)) missing.push_back(r);
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
      v1::UNAVAILABLE, absl::StatusCode::kUnavailable,
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
  for (const auto& [group_id, g] : job->groups) stats_.usage_bytes -= g.usage_bytes;
  for (const auto& [node_id, node] : job->nodes) {
    for (const auto& [group_id, ng] : node.groups) {
      stats_.retained_contents -= static_cast<int64_t>(ng.retained.size());
    }
  }
  const std::string job_id = job->job_id;
  const std::string run_id = job->run_id;
  jobs_.erase(job_id);
  stats_.jobs = static_cast<int64_t>(jobs_.size());
  if (auto rit = runs_.find(job_id); rit != runs_.end() && rit->second.run_id == run_id) {
    ACCORD_LOG(INFO) << "job " << job_id << " run " << run_id
                     << " ended; its state and keys are dropped";
    // A failed run is never resumed (its late requests get RUN_ENDED); a
    // healthy one whose last node only lost its connection may be (its
    // sidecar's RESUME takes it over, as after a coordinator restart).
    if (rit->second.failed) NoteRunEndedLocked(job_id, run_id);
    ended_runs_.push_back(
        EndedRun{job_id, KeyScopeOf(rit->second),
                 wire::KindError(v1::RUN_ENDED, absl::StrCat("job ", job_id, " run ", run_id,
                                                             " ended: its last node left"))});
    runs_.erase(rit);
    stats_.runs = static_cast<int64_t>(runs_.size());
  }
}

Coordinator::Run& Coordinator::StartRunLocked(const std::string& job_id, std::string run_id) {
  if (run_id.empty()) {
    const uint64_t n = run_nonce_++;
    run_id = absl::StrCat(
        "r", absl::Hex(MixKey(n) ^ MixKey(MixKey(n) + 0x9e3779b97f4a7c15ull), absl::kZeroPad16));
  }
  Run& run = runs_[job_id];
  run = Run();
  run.run_id = std::move(run_id);
  run.started = clock_->Now();
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
  auto rit = runs_.find(job_id);
  if (rit == runs_.end()) return;
  const std::string run_id = rit->second.run_id;
  const std::string scope = KeyScopeOf(rit->second);
  if (auto jit = jobs_.find(job_id); jit != jobs_.end()) {
    Job& job = jit->second;
    for (auto& [node_id, node] : job.nodes) {
      if (node.sink == nullptr || error == nullptr) continue;
      v1::CoordinatorMessage m;
      *m.mutable_error() = *error;
      NoteErrorLocked(m.error());
      out.direct.emplace_back(node.sink, std::move(m));
    }
    RemoveJobLocked(&job);  // queues the run's end
  }
  if (auto again = runs_.find(job_id); again != runs_.end() && again->second.run_id == run_id) {
    ACCORD_LOG(INFO) << "job " << job_id << " run " << run_id
                     << " ended; its state and keys are dropped";
    ended_runs_.push_back(EndedRun{job_id, KeyScopeOf(again->second), why});
    runs_.erase(again);
    stats_.runs = static_cast<int64_t>(runs_.size());
  } else if (!ended_runs_.empty() && ended_runs_.back().run_id == scope) {
    ended_runs_.back().why = why;
  }
  // A superseded run is never resumed: its late requests get RUN_ENDED.
  if (error != nullptr) NoteRunEndedLocked(job_id, run_id);
}

absl::StatusOr<Coordinator::Run*> Coordinator::JoinRunLocked(const std::string& job_id,
                                                             v1::NodeHello::RunStart start,
                                                             const std::string& run_id,
                                                             const std::string& node_id,
                                                             uint64_t node_epoch, Outbox& out) {
  auto rit = runs_.find(job_id);
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
    // that ended here.
    if (rit == runs_.end()) {
      if (recently_ended_set_.contains(std::make_pair(job_id, run_id))) {
        return wire::KindError(
            v1::RUN_ENDED,
            absl::StrCat("job ", job_id, " run ", run_id,
                         " has ended (its last node left, it failed and its nodes left, or a "
                         "restart superseded it); node \"",
                         node_id, "\" still speaks for it: stop its ranks"));
      }
      return start_run(run_id);
    }
    Run& run = rit->second;
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
  if (rit == runs_.end()) return start_run(run_id);
  Run& run = rit->second;
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
      v1::DecisionError e =
          Error(v1::RUN_ENDED, absl::StatusCode::kFailedPrecondition, msg, job_id);
      ACCORD_LOG(WARNING) << msg;
      EndRunLocked(job_id, wire::KindError(v1::RUN_ENDED, msg), &e, out);
      return start_run("");
    }
    run.node_epochs[node_id] = node_epoch;
  }
  return &run;
}

void Coordinator::NoteRunEndedLocked(const std::string& job_id, const std::string& run_id) {
  if (recently_ended_set_.insert(std::make_pair(job_id, run_id)).second) {
    recently_ended_.emplace_back(job_id, run_id);
  }
  while (recently_ended_.size() > kRecentlyEnded) {
    recently_ended_set_.erase(recently_ended_.front());
    recently_ended_.pop_front();
  }
}

std::string Coordinator::KeyScopeOf(const Run& run) {
  return run.failed ? absl::StrCat(run.run_id, "/after-failure") : run.run_id;
}

absl::Time Coordinator::ExpireStartingRunsLocked(absl::Time now) {
  absl::Time next = absl::InfiniteFuture();
  std::vector<std::string> expired;
  for (const auto& [job_id, run] : runs_) {
    if (jobs_.find(job_id) != jobs_.end()) continue;
    const absl::Time due = run.started + options_.run_start_timeout;
    if (due <= now) {
      expired.push_back(job_id);
    } else {
      next = std::min(next, due);
    }
  }
  Outbox none;
  for (const std::string& job_id : expired) {
    ACCORD_LOG(WARNING) << "job " << job_id << ": run " << runs_[job_id].run_id
                        << " got no node within --run_start_timeout; ending it";
    EndRunLocked(job_id,
                 wire::KindError(v1::RUN_ENDED,
                                 absl::StrCat("job ", job_id, " run ", runs_[job_id].run_id,
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
    ended.swap(ended_runs_);
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
      result = KeyScopeOf(**run);
    }
    FlushLocked(out);
  }
  DeliverRunEnds();
  DeliverEvents();
  return result;
}

std::string Coordinator::CurrentRun(const std::string& job_id) {
  accord::MutexLock l(&mu_);
  auto it = runs_.find(job_id);
  return it == runs_.end() ? "" : it->second.run_id;
}

void Coordinator::HandleMessage(SessionId id, const v1::NodeMessage& message) {
  HandleMessageWithoutDelivery(id, message);
  DeliverRunEnds();
  DeliverEvents();
}

void Coordinator::HandleMessageWithoutDelivery(SessionId id, const v1::NodeMessage& message) {
  accord::MutexLock l(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  Session& s = it->second;
  Outbox out;
  switch (message.body_case()) {
    case v1::NodeMessage::kHello:
      HandleHelloLocked(id, s, message.hello(), out);
      break;
    case v1::NodeMessage::kRegistration:
    case v1::NodeMessage::kManifests:
    case v1::NodeMessage::kRankEvent:
    case v1::NodeMessage::kProgress:
      if (s.node == nullptr) {
        v1::CoordinatorMessage reply;
        *reply.mutable_error() =
            Error(v1::INVALID_REQUEST, absl::StatusCode::kFailedPrecondition,
                  "node message before NodeHello (or after the job's state was dropped); send "
                  "NodeHello first");
        out.direct.emplace_back(s.sink, std::move(reply));
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
        HandleManifestsLocked(s, message.manifests(), out);
      }
      break;
    default: {
      v1::CoordinatorMessage reply;
      *reply.mutable_error() = Error(v1::INVALID_REQUEST, absl::StatusCode::kInvalidArgument,
                                     "empty or unknown NodeMessage body");
      out.direct.emplace_back(s.sink, std::move(reply));
    }
  }
  FlushLocked(out);
}

void Coordinator::FlushLocked(Outbox& out) {
  for (auto& [sink, msg] : out.direct) {
    if (sink != nullptr) sink->Send(std::make_shared<const v1::CoordinatorMessage>(std::move(msg)));
  }
  auto broadcast = [&](Job* job, v1::CoordinatorMessage&& msg) {
    if (jobs_.find(job->job_id) == jobs_.end()) return;
    auto shared = std::make_shared<const v1::CoordinatorMessage>(std::move(msg));
    for (auto& [node_id, node] : job->nodes) {
      if (node.sink != nullptr) node.sink->Send(shared);
    }
  };
  for (auto& [job, msg] : out.broadcast_other) broadcast(job, std::move(msg));
  for (auto& [job, msg] : out.broadcast_decisions) broadcast(job, std::move(msg));
}

void Coordinator::HandleHelloLocked(SessionId id, Session& s, const v1::NodeHello& hello,
                                    Outbox& out) {
  auto reply_error = [&](v1::ErrorKind kind, absl::StatusCode code, std::string msg,
                         std::vector<int> ranks = {}) {
    v1::CoordinatorMessage reply;
    *reply.mutable_error() = Error(kind, code, std::move(msg), hello.job_id());
    for (int r : ranks) reply.mutable_error()->add_ranks(r);
    NoteErrorLocked(reply.error());
    out.direct.emplace_back(s.sink, std::move(reply));
  };
  if (s.node != nullptr) {
    reply_error(
        v1::INVALID_REQUEST, absl::StatusCode::kFailedPrecondition,
        absl::StrCat("node \"", s.node->node_id, "\" sent a second NodeHello on one session"));
    return;
  }
  if (hello.job_id().empty() || hello.node_id().empty()) {
    reply_error(v1::INVALID_REQUEST, absl::StatusCode::kInvalidArgument,
                "NodeHello needs a job_id and a node_id");
    return;
  }
  const int world = hello.world_size();
  if (world > options_.max_world_size) {
    reply_error(v1::LIMIT_EXCEEDED, absl::StatusCode::kResourceExhausted,
                absl::StrCat("job ", hello.job_id(), ": world size ", world, " from node \"",
                             hello.node_id(), "\" exceeds --max_ranks=", options_.max_world_size,
                             "; raise the coordinator's --max_ranks"));
    return;
  }
  if (world < 1) {
    reply_error(v1::INVALID_REQUEST, absl::StatusCode::kInvalidArgument,
                absl::StrCat("job ", hello.job_id(), ": world size ", world, " from node \"",
                             hello.node_id(), "\" must be at least 1"));
    return;
  }
  std::vector<int> ranks(hello.ranks().begin(), hello.ranks().end());
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= world || (i > 0 && ranks[i] == ranks[i - 1])) {
      reply_error(v1::INVALID_REQUEST, absl::StatusCode::kInvalidArgument,
                  absl::StrCat("job ", hello.job_id(), ": node \"", hello.node_id(),
                               "\" announced rank ", ranks[i], " twice or outside 0..", world - 1));
      return;
    }
  }
  absl::StatusOr<Run*> run = JoinRunLocked(hello.job_id(), hello.run_start(), hello.run_id(),
                                           hello.node_id(), hello.node_epoch(), out);
  if (!run.ok()) {
    reply_error(wire::KindOf(run.status()), run.status().code(),
                std::string(run.status().message()));
    return;
  }
  const std::string run_id = (*run)->run_id;
  auto jit = jobs_.find(hello.job_id());
  if (jit == jobs_.end()) {
    if (static_cast<int>(jobs_.size()) >= options_.max_jobs) {
      reply_error(
          v1::LIMIT_EXCEEDED, absl::StatusCode::kResourceExhausted,
          absl::StrCat("job ", hello.job_id(), ": the coordinator already serves ", jobs_.size(),
                       " jobs (--max_jobs); raise the limit or shard jobs "
                       "across coordinators"));
      return;
    }
    Job& job = jobs_[hello.job_id()];
    job.job_id = hello.job_id();
    job.run_id = run_id;
    job.world_size = world;
    job.rank_owner.assign(world, nullptr);
    job.rank_left_step.assign(world, -1);
    if (options_.observer != nullptr) job.observer = options_.observer->ForJob(job.job_id, world);
    stats_.jobs = static_cast<int64_t>(jobs_.size());
    jit = jobs_.find(hello.job_id());
    ACCORD_LOG(INFO) << "job " << job.job_id << " run " << run_id << ": created with world size "
                     << world << " by node \"" << hello.node_id() << "\"";
  }
  Job& job = jit->second;
  if (job.world_size != world) {
    reply_error(v1::WORLD_SIZE_MISMATCH, absl::StatusCode::kFailedPrecondition,
                absl::StrCat("job ", job.job_id, ": node \"", hello.node_id(),
                             "\" says world size ", world, " but the job has world size ",
                             job.world_size, "; check WORLD_SIZE of every launcher"));
    if (job.connected_nodes == 0) RemoveJobLocked(&job);
    return;
  }
  // Ranks held by another connected node are refused.
  for (int r : ranks) {
    NodeState* owner = job.rank_owner[r];
    if (owner != nullptr && owner->node_id != hello.node_id() && owner->session != 0) {
      reply_error(v1::DUPLICATE_RANK, absl::StatusCode::kAlreadyExists,
                  absl::StrCat("job ", job.job_id, ": rank ", r, " is already served by node \"",
                               owner->node_id, "\"; node \"", hello.node_id(),
                               "\" announced it too. Check RANK of the processes on both nodes"),
                  {r});
      if (job.connected_nodes == 0) RemoveJobLocked(&job);
      return;
    }
  }
  NodeState& node = job.nodes[hello.node_id()];
  node.node_id = hello.node_id();
  node.answers_progress = hello.answers_progress();
  if (node.session != 0) {
    // The same node reconnected before its old stream was noticed as gone.
    auto old = sessions_.find(node.session);
    if (old != sessions_.end()) {
      old->second.node = nullptr;
      old->second.job = nullptr;
    }
    --job.connected_nodes;
  }
  for (int r : node.ranks) {
    if (job.rank_owner[r] == &node) job.rank_owner[r] = nullptr;
  }
  auto set = std::make_shared<RankSet>(job.world_size);
  for (int r : ranks) {
    NodeState* owner = job.rank_owner[r];
    if (owner != nullptr && owner != &node) {
      // Moved from a disconnected node.
      owner->ranks.erase(std::remove(owner->ranks.begin(), owner->ranks.end(), r),
                         owner->ranks.end());
    }
    job.rank_owner[r] = &node;
    set->Add(r);
  }
  node.ranks = ranks;
  SetRankSet(node, std::move(set));
  node.session = id;
  node.sink = s.sink;
  node.disconnected_at = absl::InfiniteFuture();
  ++job.connected_nodes;
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
  if (job.failed) {
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
    v1::CoordinatorMessage reply;
    *reply.mutable_error() = Error(v1::INVALID_REQUEST, absl::StatusCode::kInvalidArgument,
                                   absl::StrCat("job ", job.job_id, ": RankEvent for rank ", r,
                                                " outside 0..", job.world_size - 1),
                                   job.job_id);
    out.direct.emplace_back(s.sink, std::move(reply));
    return;
  }
  if (e.joined()) {
    NodeState* owner = job.rank_owner[r];
    if (owner == &node) return;
    if (owner != nullptr && owner->session != 0) {
      v1::CoordinatorMessage reply;
      *reply.mutable_error() =
          Error(v1::DUPLICATE_RANK, absl::StatusCode::kAlreadyExists,
                absl::StrCat("job ", job.job_id, ": rank ", r, " joined node \"", node.node_id,
                             "\" but is already served by node \"", owner->node_id,
                             "\"; check RANK of the processes on both nodes"),
                job.job_id);
      reply.mutable_error()->add_ranks(r);
      NoteErrorLocked(reply.error());
      out.direct.emplace_back(s.sink, std::move(reply));
      return;
    }
    if (owner != nullptr) {
      owner->ranks.erase(std::remove(owner->ranks.begin(), owner->ranks.end(), r),
                         owner->ranks.end());
    }
    job.rank_owner[r] = &node;
    node.ranks.push_back(r);
    std::sort(node.ranks.begin(), node.ranks.end());
    auto set = std::make_shared<RankSet>(*node.rank_set);
    set->Add(r);
    SetRankSet(node, std::move(set));
    return;
  }
  // A rank this node does not serve (e.g. one refused as a duplicate) leaving
  // changes nothing.
  if (job.rank_owner[r] != &node) return;
  // The rank left: any pending step that still needs it can never complete.
  job.rank_left_step[r] = std::max(job.rank_left_step[r], e.last_step());
  if (job.failed) return;
  for (auto& [gid, g] : job.groups) {
    for (auto& [step, p] : g.pending) {
      RankSet covered(job.world_size);
      for (const Contribution& c : p.contributions) covered.Union(*c.content->ranks);
      for (int x : p.progress_reported) covered.Add(x);
      if (covered.Contains(r)) continue;
      std::vector<int> missing = covered.Missing();
      v1::DecisionError err = MissingRanksErrorLocked(
          job, g, step, p, missing,
          absl::StrCat("rank ", r, " left (its stream to the sidecar on node \"", node.node_id,
                       "\" ended)"));
      FailJobLocked(job, &g, step, std::move(err), out);
      return;
    }
  }
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
    v1::CoordinatorMessage msg;
    msg.mutable_registration()->set_group_id(reg.group_id());
    *msg.mutable_registration()->mutable_error() = std::move(err);
    NoteErrorLocked(msg.registration().error());
    out.direct.emplace_back(s.sink, std::move(msg));
  };
  absl::StatusOr<GroupSpec> spec = wire::GroupSpecFromProto(reg);
  if (!spec.ok()) {
    reply(Error(v1::INVALID_REQUEST, spec.status().code(),
                absl::StrCat("job ", job.job_id, ": ", spec.status().message()), job.job_id,
                reg.group_id()));
    return;
  }
  absl::StatusOr<Policy> policy = wire::PolicyFromProto(reg.policy());
  if (!policy.ok()) {
    reply(Error(v1::INVALID_REQUEST, policy.status().code(),
                absl::StrCat("job ", job.job_id, " group \"", reg.group_id(),
                             "\": ", policy.status().message()),
                job.job_id, reg.group_id()));
    return;
  }
  if (static_cast<int64_t>(spec->params.size()) > options_.max_params_per_group) {
    reply(Error(
        v1::LIMIT_EXCEEDED, absl::StatusCode::kResourceExhausted,
        absl::StrCat("job ", job.job_id, " group \"", reg.group_id(), "\": ", spec->params.size(),
                     " parameters exceed --max_params_per_group=", options_.max_params_per_group),
        job.job_id, reg.group_id()));
    return;
  }
  RankSet ranks(job.world_size);
  for (int r : nr.ranks()) {
    if (r < 0 || r >= job.world_size || !node.rank_set->Contains(r)) {
      reply(Error(v1::INVALID_REQUEST, absl::StatusCode::kInvalidArgument,
                  absl::StrCat("job ", job.job_id, " group \"", reg.group_id(), "\": rank ", r,
                               " is not served by node \"", node.node_id, "\""),
                  job.job_id, reg.group_id()));
      return;
    }
    ranks.Add(r);
  }
  if (ranks.Empty()) {
    reply(Error(v1::INVALID_REQUEST, absl::StatusCode::kInvalidArgument,
                absl::StrCat("job ", job.job_id, " group \"", reg.group_id(),
                             "\": registration names no rank"),
                job.job_id, reg.group_id()));
    return;
  }
  auto git = job.groups.find(reg.group_id());
  if (git == job.groups.end()) {
    if (static_cast<int>(job.groups.size()) >= options_.max_groups_per_job) {
      reply(
          Error(v1::LIMIT_EXCEEDED, absl::StatusCode::kResourceExhausted,
                absl::StrCat("job ", job.job_id, ": group \"", reg.group_id(),
                             "\" would exceed --max_groups_per_job=", options_.max_groups_per_job),
                job.job_id, reg.group_id()));
      return;
    }
    GroupState& g = job.groups[reg.group_id()];
    g.group_id = reg.group_id();
    if (job.observer != nullptr) g.observer = job.observer->ForGroup(g.group_id);
    g.registered = RankSet(job.world_size);
    git = job.groups.find(reg.group_id());
  }
  GroupState& g = git->second;
  const std::string policy_bytes = wire::PolicyToProto(*policy).SerializeAsString();
  int variant = -1;
  for (size_t i = 0; i < g.variants.size(); ++i) {
    if (g.variants[i].spec == *spec && g.variants[i].policy_bytes == policy_bytes) {
      variant = static_cast<int>(i);
    }
  }
  if (variant < 0) {
    g.variants.push_back(RegVariant{*spec, *policy, policy_bytes, RankSet(job.world_size)});
    variant = static_cast<int>(g.variants.size()) - 1;
  }
  g.variants[variant].ranks.Union(ranks);
  g.registered.Union(ranks);
  NodeGroupState& ng = node.groups[reg.group_id()];
  ng.variant = variant;
  switch (g.reg_state) {
    case RegState::kCollecting:
      if (g.registered.Full()) FinishRegistrationLocked(job, g, out);
      break;
    case RegState::kOk: {
      v1::CoordinatorMessage msg;
      msg.mutable_registration()->set_group_id(g.group_id);
      if (variant == g.spec_variant) {
        msg.mutable_registration()->set_spec_fingerprint(g.spec_fingerprint);
      } else {
        *msg.mutable_registration()->mutable_error() =
            Error(v1::REGISTRATION_MISMATCH, absl::StatusCode::kFailedPrecondition,
                  absl::StrCat("job ", job.job_id, " group \"", g.group_id, "\": ranks ",
                               FormatRanks(ranks.Members()), " on node \"", node.node_id,
                               "\" registered a spec or policy different from the one every rank "
                               "agreed on; check the model definition on those ranks"),
                  job.job_id, g.group_id);
        NoteErrorLocked(msg.registration().error());
      }
      out.direct.emplace_back(s.sink, std::move(msg));
      break;
    }
    case RegState::kFailed: {
      v1::CoordinatorMessage msg;
      msg.mutable_registration()->set_group_id(g.group_id);
      *msg.mutable_registration()->mutable_error() = g.reg_error;
      out.direct.emplace_back(s.sink, std::move(msg));
      break;
    }
  }
}

void Coordinator::FinishRegistrationLocked(Job& job, GroupState& g, Outbox& out) {
  v1::CoordinatorMessage msg;
  msg.mutable_registration()->set_group_id(g.group_id);
  // The reference is the variant of the lowest rank.
  int ref = 0;
  int ref_rank = job.world_size;
  for (size_t i = 0; i < g.variants.size(); ++i) {
    std::vector<int> members = g.variants[i].ranks.Members();
    if (!members.empty() && members[0] < ref_rank) {
      ref_rank = members[0];
      ref = static_cast<int>(i);
    }
  }
  if (g.variants.size() == 1) {
    g.reg_state = RegState::kOk;
    g.spec_variant = 0;
    g.spec_fingerprint = SpecFingerprint(g.variants[0].spec);
    msg.mutable_registration()->set_spec_fingerprint(g.spec_fingerprint);
  } else {
    // Name the first other variant (by lowest rank) and every differing rank.
    int other = -1;
    int other_rank = job.world_size;
    std::vector<int> differing;
    for (size_t i = 0; i < g.variants.size(); ++i) {
      if (static_cast<int>(i) == ref) continue;
      std::vector<int> members = g.variants[i].ranks.Members();
      differing.insert(differing.end(), members.begin(), members.end());
      if (!members.empty() && members[0] < other_rank) {
        other_rank = members[0];
        other = static_cast<int>(i);
      }
    }
    std::sort(differing.begin(), differing.end());
    const RegVariant& a = g.variants[ref];
    const RegVariant& b = g.variants[other];
    absl::Status cmp = CompareRegistration(a.spec, ref_rank, b.spec, other_rank);
    std::string detail;
    int param = -1;
    if (!cmp.ok()) {
      detail = std::string(cmp.message());
      param = FirstDifference(a.spec, b.spec);
    } else {
      detail = absl::StrCat("group \"", g.group_id, "\": rank ", ref_rank, " and rank ", other_rank,
                            " registered different reduce policies (",
                            wire::PolicyToProto(a.policy).ShortDebugString(), " vs ",
                            wire::PolicyToProto(b.policy).ShortDebugString(), ")");
    }
    v1::DecisionError err =
        Error(v1::REGISTRATION_MISMATCH, absl::StatusCode::kFailedPrecondition,
              absl::StrCat("job ", job.job_id, ": ", detail, "; ranks ", FormatRanks(differing),
                           " differ from rank ", ref_rank,
                           ". Every rank must build the same model and wrap it the same way"),
              job.job_id, g.group_id);
    err.set_param_index(param);
    if (param >= 0 && param < static_cast<int>(a.spec.params.size())) {
      err.set_param_name(a.spec.params[param].name);
    } else if (param >= 0 && param < static_cast<int>(b.spec.params.size())) {
      err.set_param_name(b.spec.params[param].name);
    }
    err.add_ranks(ref_rank);
    for (int r : differing) err.add_ranks(r);
    g.reg_state = RegState::kFailed;
    g.reg_error = err;
    *msg.mutable_registration()->mutable_error() = std::move(err);
    NoteErrorLocked(g.reg_error);
    ACCORD_LOG(WARNING) << g.reg_error.message();
    // Pending steps of the group can never be decided.
    v1::DecisionBatch& batch = *out.broadcast_decisions[&job].mutable_decisions();
    for (auto& [step, p] : g.pending) {
      v1::Decision* d = batch.add_decisions();
      d->set_group_id(g.group_id);
      d->set_step(step);
      *d->mutable_error() = g.reg_error;
      d->mutable_error()->set_step(step);
    }
    g.pending.clear();
  }
  out.broadcast_other.emplace_back(&job, std::move(msg));
}

absl::StatusOr<std::shared_ptr<const Coordinator::Content>> Coordinator::ParseFull(
    const NodeState& node, const GroupState& group, const RegVariant& variant, int world,
    const v1::Manifest& m) {
  const size_t num_params = variant.spec.params.size();
  const bool all_node_ranks = m.rank_bits().empty();
  if (all_node_ranks && node.ranks.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("node \"", node.node_id, "\" serves no rank but sent a manifest"));
  }
  auto content = std::make_shared<Content>();
  // The node's own rank set is shared when the manifest speaks for all its
  // ranks: only the dtypes are decoded (no rank set per manifest).
  absl::StatusOr<Manifest> parsed;
  if (all_node_ranks) {
    content->dtypes.resize(num_params);
    if (absl::Status s = wire::ManifestDTypesFromProto(m, num_params, content->dtypes.data());
        !s.ok()) {
      return s;
    }
    content->ranks = node.rank_set;
    content->rank_count = static_cast<int>(node.ranks.size());
    if (m.cache_key() == 0) {  // only the key needs a Manifest
      parsed.emplace();
      parsed->dtypes.assign(content->dtypes.begin(), content->dtypes.end());
      parsed->ranks = *node.rank_set;
    }
  } else {
    parsed = wire::ManifestFromProto(m, num_params, world, -1);
    if (!parsed.ok()) return parsed.status();
    const auto& words = parsed->ranks.words();
    const auto& node_words = node.rank_set->words();
    for (size_t i = 0; i < words.size(); ++i) {
      if (words[i] & ~node_words[i]) {
        std::vector<int> foreign;
        for (int r : parsed->ranks.Members()) {
          if (!node.rank_set->Contains(r)) foreign.push_back(r);
        }
        return absl::InvalidArgumentError(absl::StrCat(
            "manifest for group \"", m.group_id(), "\" step ", m.step(), ": rank_bits name ranks ",
            FormatRanks(foreign), " that node \"", node.node_id, "\" does not serve"));
      }
    }
    content->rank_count = parsed->ranks.Count();
    content->ranks = std::make_shared<const RankSet>(parsed->ranks);
  }
  for (const v1::RankUsage& u : m.rank_detail()) {
    if (!content->ranks->Contains(u.rank())) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest for group \"", m.group_id(), "\" step ", m.step(),
                       ": rank_detail for rank ", u.rank(), " which the manifest does not cover"));
    }
    absl::StatusOr<std::vector<bool>> used = wire::UnpackBits(
        u.used_bits(), num_params,
        absl::StrCat("manifest for group \"", m.group_id(), "\" rank_detail of rank ", u.rank()));
    if (!used.ok()) return used.status();
    content->detail.push_back(RankDetail{u.rank(), *std::move(used)});
  }
  if (all_node_ranks) {
    content->word_lo = node.word_lo;
    content->word_hi = node.word_hi;
  } else {
    const std::vector<uint64_t>& words = content->ranks->words();
    int lo = 0;
    int hi = static_cast<int>(words.size());
    while (lo < hi && words[lo] == 0) ++lo;
    while (hi > lo && words[hi - 1] == 0) --hi;
    content->word_lo = lo;
    content->word_hi = hi;
  }
  content->key = m.cache_key() != 0 ? m.cache_key() : ManifestKey(*parsed);
  if (!all_node_ranks) content->dtypes.assign(parsed->dtypes.begin(), parsed->dtypes.end());
  return std::shared_ptr<const Content>(std::move(content));
}

void Coordinator::HandleManifestsLocked(Session& s, const v1::ManifestBatch& batch, Outbox& out) {
  Job& job = *s.job;
  NodeState& node = *s.node;
  BatchRecord& record = s.last_batch;
  if (batch.repeat_batch_key() != 0) {
    if (batch.manifests_size() > 0 || record.Key() != batch.repeat_batch_key()) {
      v1::CoordinatorMessage reply;
      *reply.mutable_error() = Error(
          v1::INVALID_REQUEST, absl::StatusCode::kFailedPrecondition,
          absl::StrCat("job ", job.job_id, " step ", batch.repeat_step(), ": node \"", node.node_id,
                       "\" sent a batch repeat with key ", absl::Hex(batch.repeat_batch_key()),
                       batch.manifests_size() > 0
                           ? std::string(" together with manifests")
                           : absl::StrCat(" but the previous batch on this stream has key ",
                                          absl::Hex(record.Key()), " (", record.entries.size(),
                                          " manifests)"),
                       "; the sidecar and the coordinator disagree on the stream's history. "
                       "Check the sidecar's version; restarting it resends in full form"),
          job.job_id, "", batch.repeat_step());
      NoteErrorLocked(reply.error());
      out.direct.emplace_back(s.sink, std::move(reply));
      return;
    }
    ManifestRef ref;
    ref.step = batch.repeat_step();
    ref.repeat = true;
    for (BatchEntry& e : record.entries) {
      if (e.group == nullptr || e.node_group == nullptr) {
        // Unknown when recorded; it may have been registered since.
        auto git = job.groups.find(e.group_id);
        auto ngit = node.groups.find(e.group_id);
        if (git != job.groups.end() && ngit != node.groups.end()) {
          e.group = &git->second;
          e.node_group = &ngit->second;
        }
      }
      ref.group_id = e.group_id;
      ref.cache_key = e.cache_key;
      HandleManifestLocked(s, ref, e.group, e.node_group, out);
    }
    return;
  }
  if (batch.manifests_size() == 0) return;
  // The new record. An entry naming the same group as the old record's entry
  // at its position (the common case: the same groups every step) keeps its
  // resolved pointers instead of two hash lookups.
  const size_t n = static_cast<size_t>(batch.manifests_size());
  if (record.entries.size() > n) record.entries.resize(n);
  record.entries.reserve(n);
  record.key = 0;
  for (size_t i = 0; i < n; ++i) {
    const v1::Manifest& m = batch.manifests(static_cast<int>(i));
    if (i == record.entries.size()) record.entries.emplace_back();
    BatchEntry& e = record.entries[i];
    if (e.group == nullptr || e.node_group == nullptr || e.group_id != m.group_id()) {
      e.group_id = m.group_id();
      e.group = nullptr;
      e.node_group = nullptr;
      auto git = job.groups.find(m.group_id());
      auto ngit = node.groups.find(m.group_id());
      if (git != job.groups.end() && ngit != node.groups.end()) {
        e.group = &git->second;
        e.node_group = &ngit->second;
      }
    }
    e.cache_key = m.cache_key();
    ManifestRef ref{m.group_id(), m.step(), m.repeat(), m.cache_key(), m.repeat() ? nullptr : &m};
    HandleManifestLocked(s, ref, e.group, e.node_group, out);
  }
}

std::shared_ptr<const Coordinator::Content> Coordinator::Contribution::Owner() const {
  if (group->cache.get() == content) return group->cache;
  if (auto it = group->retained.find(content); it != group->retained.end()) {
    return it->second.content;
  }
  return nullptr;  // unreachable: a pending contribution's content is owned
}

uint64_t Coordinator::BatchRecord::Key() {
  if (key == 0 && !entries.empty()) {
    wire::BatchKeyHasher hasher;
    for (const BatchEntry& e : entries) hasher.Add(e.group_id, e.cache_key);
    key = hasher.Finish();
  }
  return key;
}

void Coordinator::SetRankSet(NodeState& node, std::shared_ptr<const RankSet> set) {
  const std::vector<uint64_t>& words = set->words();
  int lo = 0;
  int hi = static_cast<int>(words.size());
  while (lo < hi && words[lo] == 0) ++lo;
  while (hi > lo && words[hi - 1] == 0) --hi;
  node.word_lo = lo;
  node.word_hi = hi;
  node.rank_set = std::move(set);
}

std::map<int64_t, Coordinator::PendingStep>::iterator Coordinator::StartStepLocked(
    Job& job, GroupState& g, int64_t step, absl::Time first_seen) {
  auto [pit, inserted] = g.pending.try_emplace(step);
  PendingStep& p = pit->second;
  p.first_seen = first_seen;
  p.deadline = p.first_seen + options_.deadline;
  p.contributions.reserve(job.connected_nodes);
  // With an observer the timer also wakes at half the deadline (stall event).
  const absl::Time wake =
      options_.observer != nullptr ? p.first_seen + options_.deadline / 2 : p.deadline;
  WakeTimerAtLocked(wake);
  // A node gone (sidecar restarted?) may already be past its grace.
  if (job.connected_nodes < static_cast<int>(job.nodes.size())) {
    for (const auto& [node_id, node] : job.nodes) {
      if (node.session == 0 && node.disconnected_at != absl::InfiniteFuture()) {
        WakeTimerAtLocked(node.disconnected_at + options_.node_reconnect_grace);
      }
    }
  }
  return pit;
}

void Coordinator::HandleManifestLocked(Session& s, const ManifestRef& m, GroupState* gp,
                                       NodeGroupState* ngp, Outbox& out) {
  Job& job = *s.job;
  NodeState& node = *s.node;
  ++stats_.manifests;
  auto reply_error = [&](v1::ErrorKind kind, absl::StatusCode code, std::string msg) {
    v1::Decision* d = out.ReplyBatch(s.sink)->add_decisions();
    d->set_group_id(std::string(m.group_id));
    d->set_step(m.step);
    *d->mutable_error() = Error(kind, code, std::move(msg), job.job_id, m.group_id, m.step);
    NoteErrorLocked(d->error());
    return d->mutable_error();
  };
  // Built only on the error paths: the common path allocates nothing here.
  auto where = [&] {
    return absl::StrCat("job ", job.job_id, " group \"", m.group_id, "\" step ", m.step);
  };
  if (job.failed) {
    v1::Decision* d = out.ReplyBatch(s.sink)->add_decisions();
    d->set_group_id(std::string(m.group_id));
    d->set_step(m.step);
    *d->mutable_error() = job.failure;
    d->mutable_error()->set_kind(v1::JOB_FAILED);
    return;
  }
  if (gp == nullptr || ngp == nullptr || ngp->variant < 0) {
    reply_error(v1::UNKNOWN_GROUP, absl::StatusCode::kNotFound,
                absl::StrCat(where(), ": node \"", node.node_id,
                             "\" has not registered this group; register it before sending "
                             "manifests"));
    return;
  }
  GroupState& g = *gp;
  NodeGroupState& ng = *ngp;
  if (g.reg_state == RegState::kFailed) {
    v1::Decision* d = out.ReplyBatch(s.sink)->add_decisions();
    d->set_group_id(g.group_id);
    d->set_step(m.step);
    *d->mutable_error() = g.reg_error;
    d->mutable_error()->set_step(m.step);
    return;
  }
  const int64_t step = m.step;
  if (step < 0) {
    reply_error(v1::INVALID_MANIFEST, absl::StatusCode::kInvalidArgument,
                absl::StrCat(where(), ": negative step"));
    return;
  }
  if (step <= g.last_decided_step) {
    if (step == g.last_decided_step && g.last_decision != nullptr) {
      // A resend after a reconnect whose decision was lost: answer again.
      v1::Decision* again = out.ReplyBatch(s.sink)->add_decisions();
      *again = *g.last_decision;
      again->set_step(step);
      again->set_wait_us(g.last_decision_wait_us);
      return;
    }
    reply_error(v1::STEP_REGRESSION, absl::StatusCode::kFailedPrecondition,
                absl::StrCat(where(), ": step ", step, " is older than the last decided step ",
                             g.last_decided_step,
                             " of this group; check that the training loop's step counter "
                             "only moves forward (was the process restarted alone?)"));
    return;
  }
  // Steps this node already contributed to (few: the pending window).
  auto& mine = ng.contributed_steps;
  mine.erase(
      std::remove_if(mine.begin(), mine.end(), [&](int64_t x) { return x <= g.last_decided_step; }),
      mine.end());
  // Contributions point at contents without owning them: ng.cache owns the
  // current one and `retained` older ones still named by pending steps.
  if (!ng.retained.empty()) {
    const size_t before = ng.retained.size();
    if (mine.empty()) {
      ng.retained.clear();
    } else {
      const int64_t oldest = *std::min_element(mine.begin(), mine.end());
      absl::erase_if(ng.retained, [&](const auto& r) { return r.second.last_step < oldest; });
    }
    stats_.retained_contents -= static_cast<int64_t>(before - ng.retained.size());
  }
  // Resolve the content.
  const Content* content = nullptr;
  if (m.repeat) {
    if (ng.cache == nullptr || ng.cache_key != m.cache_key) {
      ++stats_.repeat_key_mismatches;
      reply_error(
          v1::INVALID_MANIFEST, absl::StatusCode::kFailedPrecondition,
          absl::StrCat(where(), ": repeat-form manifest with cache key ", absl::Hex(m.cache_key),
                       " but node \"", node.node_id, "\"'s previous manifest for this group ",
                       ng.cache == nullptr ? std::string("is unknown here")
                                           : absl::StrCat("has key ", absl::Hex(ng.cache->key)),
                       "; resend this step in full form"))
          ->set_resend_full_form(true);
      return;
    }
    content = ng.cache.get();
    ++stats_.cache_hits;
    ++g.cache_hits;
    if (job.observer != nullptr) job.observer->OnManifest(/*cache_hit=*/true);
  } else {
    absl::StatusOr<std::shared_ptr<const Content>> parsed =
        ParseFull(node, g, g.variants[ng.variant], job.world_size, *m.full);
    if (!parsed.ok()) {
      const bool non_float = wire::KindOf(parsed.status()) == v1::NON_FLOAT_DTYPE;
      reply_error(non_float ? v1::NON_FLOAT_DTYPE : v1::INVALID_MANIFEST,
                  absl::StatusCode::kInvalidArgument,
                  absl::StrCat("job ", job.job_id, ": ", parsed.status().message()));
      return;
    }
    if (!mine.empty() && ng.cache != nullptr) {
      // Steps in `mine` so far used the old content (or older ones).
      const int64_t last = *std::max_element(mine.begin(), mine.end());
      const Content* key = ng.cache.get();
      if (ng.retained.try_emplace(key, NodeGroupState::Retained{std::move(ng.cache), last})
              .second) {
        ++stats_.retained_contents;
      }
    }
    ng.cache = *std::move(parsed);
    content = ng.cache.get();
    ng.cache_key = content->key;
    ng.cache_rank_count = content->rank_count;
    ++stats_.cache_misses;
    ++g.cache_misses;
    if (job.observer != nullptr) job.observer->OnManifest(/*cache_hit=*/false);
  }
  auto pit = g.pending.find(step);
  if (pit == g.pending.end()) {
    if (static_cast<int>(g.pending.size()) >= options_.max_pending_steps) {
      reply_error(v1::LIMIT_EXCEEDED, absl::StatusCode::kResourceExhausted,
                  absl::StrCat(where(), ": ", g.pending.size(),
                               " steps of this group are already waiting for ranks "
                               "(--max_pending_steps); some ranks are far behind"));
      return;
    }
    pit = StartStepLocked(job, g, step, clock_->Now());
  }
  PendingStep& p = pit->second;
  if (std::find(mine.begin(), mine.end(), step) != mine.end()) {
    // The node already spoke for this step: an identical resend is a no-op;
    // ranks that joined the node late may add a disjoint contribution.
    RankSet earlier(job.world_size);
    for (const Contribution& c : p.contributions) {
      if (c.node != &node) continue;
      if (c.content == content ||
          (c.content->key == content->key && *c.content->ranks == *content->ranks)) {
        return;
      }
      earlier.Union(*c.content->ranks);
    }
    if (earlier.Intersects(*content->ranks)) {
      // A restarted relay resends in parts what it had sent as one manifest
      // (docs/ARCHITECTURE.md, "Relays"): ranks already spoken for add nothing.
      RankSet both = earlier;
      both.Union(*content->ranks);
      if (both == earlier) return;
      reply_error(v1::INVALID_MANIFEST, absl::StatusCode::kFailedPrecondition,
                  absl::StrCat(where(), ": node \"", node.node_id,
                               "\" sent a second, different manifest for ranks it already "
                               "reported at this step"));
      return;
    }
  } else {
    mine.push_back(step);
  }
  // content == ng.cache here: its key and rank count are in ng (no Content
  // access, and no reference count traffic, per repeat).
  p.ranks_covered += ng.cache_rank_count;
  p.combined_key += MixKey(ng.cache_key);
  p.contributions.push_back(Contribution{&node, content, &ng});
  p.all_repeat = p.all_repeat && m.repeat;
  node.last_step = std::max(node.last_step, step);
  CountSkips(ng, ng.cache);
  if (p.ranks_covered >= job.world_size) {
    DecideStepLocked(job, g, step, p, out);
    g.pending.erase(step);
  }
}

void Coordinator::CountSkips(NodeGroupState& ng, const std::shared_ptr<const Content>& content) {
  if (ng.skip_content == content) {
    ++ng.skip_steps;
    return;
  }
  FlushSkips(ng);
  ng.skip_content = content;
  ng.skip_steps = 1;
}

void Coordinator::FlushSkips(NodeGroupState& ng) {
  if (ng.skip_content == nullptr || ng.skip_steps == 0) return;
  const Content& c = *ng.skip_content;
  const size_t n = c.dtypes.size();
  if (ng.node_skips.size() != n) ng.node_skips.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (c.dtypes[i] == 0) ng.node_skips[i] += ng.skip_steps;
  }
  for (const RankDetail& d : c.detail) {
    std::vector<int64_t>& extra = ng.rank_extra_skips[d.rank];
    if (extra.size() != n) extra.assign(n, 0);
    for (size_t i = 0; i < n; ++i) {
      if (c.dtypes[i] != 0 && !d.used[i]) extra[i] += ng.skip_steps;
    }
  }
  ng.skip_steps = 0;
}

void Coordinator::DecideStepLocked(Job& job, GroupState& g, int64_t step, PendingStep& p,
                                   Outbox& out) {
  const uint64_t combined = p.combined_key;
  v1::Decision* d = out.broadcast_decisions[&job].mutable_decisions()->add_decisions();
  d->set_group_id(g.group_id);
  d->set_step(step);
  d->set_wait_us(absl::ToInt64Microseconds(clock_->Now() - p.first_seen));
  ++stats_.decisions;
  if (p.all_repeat && g.last_ok && g.last_decision != nullptr && combined == g.last_combined_key) {
    d->set_same_as_previous(true);
    ++stats_.same_as_previous;
    g.last_decided_step = step;
    // The stored full decision stands for this step too (resends patch the
    // step and wait; no copy per repeated decision).
    g.last_decision_wait_us = d->wait_us();
    ObserveDecisionLocked(job, g, step, p, *d, nullptr);
    return;
  }
  const RegVariant& v = g.variants[g.spec_variant >= 0 ? g.spec_variant : 0];
  Manifest merged;
  merged.step = step;
  merged.dtypes.assign(v.spec.params.size(), 0);
  // A node's ranks are a few words of a world-sized set: OR only those.
  std::vector<uint64_t> words((job.world_size + 63) / 64, 0);
  for (const Contribution& c : p.contributions) {
    const Content& content = *c.content;
    const size_t n = std::min(merged.dtypes.size(), content.dtypes.size());
    for (size_t i = 0; i < n; ++i) merged.dtypes[i] |= content.dtypes[i];
    const std::vector<uint64_t>& w = content.ranks->words();
    const int hi = std::min<int>(content.word_hi, static_cast<int>(words.size()));
    for (int i = content.word_lo; i < hi; ++i) words[i] |= w[i];
  }
  if (!RankSet::FromWords(job.world_size, std::move(words), &merged.ranks)) {
    merged.ranks = RankSet(job.world_size);  // Decide reports every rank missing
  }
  absl::StatusOr<Decision> decision = Decide(v.spec, job.world_size, merged, v.policy);
  if (decision.ok()) {
    wire::DecisionToProto(*decision, d->mutable_ok());
    g.last_ok = true;
  } else {
    *d->mutable_error() = Error(v1::INVALID_MANIFEST, decision.status().code(),
                                absl::StrCat("job ", job.job_id, ": ", decision.status().message()),
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

int64_t Coordinator::RankLastStepLocked(const Job& job, int rank) const {
  int64_t last = job.rank_left_step[rank];
  if (const NodeState* owner = job.rank_owner[rank]; owner != nullptr) {
    last = std::max(last, owner->last_step);
  }
  return last;
}

v1::DecisionError Coordinator::MissingRanksErrorLocked(const Job& job, const GroupState& g,
                                                       int64_t step, const PendingStep& p,
                                                       const std::vector<int>& missing,
                                                       absl::string_view why) {
  std::vector<std::string> parts;
  v1::DecisionError err;
  for (int r : missing) {
    int64_t last = RankLastStepLocked(job, r);
    for (const auto& [pr, pl] : p.progress_last) {
      if (pr == r) last = pl;  // the rank's own last step, from its sidecar
    }
    err.add_ranks(r);
    err.add_last_steps(last);
    if (parts.size() < 32) {
      const NodeState* owner = job.rank_owner[r];
      std::string node = owner ? owner->node_id : std::string();
      for (const auto& [pr, pn] : p.progress_node) {
        if (pr == r) node = pn;  // the sidecar behind a relay
      }
      parts.push_back(
          absl::StrCat("rank ", r, " (last step ", last, ", node ",
                       node.empty() ? std::string("unknown") : absl::StrCat("\"", node, "\""),
                       // A rank already past this step skipped it (e.g. its step counter
                       // moved on across a restart): it will never submit it.
                       last > step ? ", past this step: it skipped it" : "", ")"));
    }
  }
  if (missing.size() > parts.size()) {
    parts.push_back(absl::StrCat("and ", missing.size() - parts.size(), " more"));
  }
  // Every rank not missing submitted the step (a node manifest covers it, or
  // its sidecar said so).
  std::vector<int> submitted;
  for (int r = 0, k = 0; r < job.world_size; ++r) {
    while (k < static_cast<int>(missing.size()) && missing[k] < r) ++k;
    if (k < static_cast<int>(missing.size()) && missing[k] == r) continue;
    submitted.push_back(r);
  }
  std::string msg = absl::StrCat(
      "job ", job.job_id, " group \"", g.group_id, "\" step ", step, ": ", why, "; missing ranks ",
      FormatRanks(missing), ": ", absl::StrJoin(parts, ", "), "; ",
      submitted.empty() ? std::string("no rank submitted it")
                        : absl::StrCat("ranks ", FormatRanks(submitted), " submitted it"),
      ". Check the missing ranks' processes and their sidecars' logs; the job is failed");
  v1::DecisionError e = Error(v1::MISSING_RANKS, absl::StatusCode::kDeadlineExceeded,
                              std::move(msg), job.job_id, g.group_id, step);
  *e.mutable_ranks() = err.ranks();
  *e.mutable_last_steps() = err.last_steps();
  return e;
}

void Coordinator::FailJobLocked(Job& job, GroupState* culprit, int64_t culprit_step,
                                v1::DecisionError error, Outbox& out) {
  ACCORD_LOG(ERROR) << error.message();
  job.failed = true;
  job.failure = error;
  NoteErrorLocked(error);
  // The run's key-value entries (bootstrap keys) are of no use any more:
  // dropped now. Keys set after the failure (e.g. a coordinated shutdown) go
  // to a fresh scope, which the run's end drops; a late drop of the old
  // scope can never take them.
  if (auto rit = runs_.find(job.job_id);
      rit != runs_.end() && rit->second.run_id == job.run_id && !rit->second.failed) {
    const std::string scope = KeyScopeOf(rit->second);
    rit->second.failed = true;
    rit->second.failure = error;
    ended_runs_.push_back(
        EndedRun{job.job_id, scope, wire::ErrorToStatus(error), KeyScopeOf(rit->second)});
  }
  v1::DecisionBatch& batch = *out.broadcast_decisions[&job].mutable_decisions();
  for (auto& [gid, g] : job.groups) {
    for (auto& [step, p] : g.pending) {
      v1::Decision* d = batch.add_decisions();
      d->set_group_id(g.group_id);
      d->set_step(step);
      *d->mutable_error() = error;
      if (&g != culprit || step != culprit_step) d->mutable_error()->set_kind(v1::JOB_FAILED);
    }
    g.pending.clear();
  }
}

bool Coordinator::AskProgressLocked(Job& job, GroupState& g, int64_t step, PendingStep& p,
                                    const RankSet& covered, absl::Time now, Outbox& out) {
  std::vector<const NodeState*>& asked = p.progress_unanswered;
  asked.clear();
  for (int r : covered.Missing()) {
    const NodeState* owner = job.rank_owner[r];
    if (owner == nullptr || owner->session == 0 || owner->sink == nullptr ||
        !owner->answers_progress) {
      continue;
    }
    if (std::find(asked.begin(), asked.end(), owner) == asked.end()) asked.push_back(owner);
  }
  if (asked.empty()) return false;
  p.progress_asked = true;
  // A short grace past the deadline: a quarter of it, at most one second.
  p.progress_deadline = now + std::min(absl::Seconds(1), options_.deadline / 4);
  for (const NodeState* node : asked) {
    v1::CoordinatorMessage q;
    q.mutable_progress_query()->set_group_id(g.group_id);
    q.mutable_progress_query()->set_step(step);
    out.direct.emplace_back(node->sink, std::move(q));
  }
  ACCORD_LOG(WARNING) << "job " << job.job_id << " group \"" << g.group_id << "\" step " << step
                      << ": deadline passed; asking " << asked.size()
                      << " node(s) which of their ranks submitted";
  return true;
}

void Coordinator::RecordProgressLocked(const Job& job, const NodeState& node,
                                       const v1::NodeProgress& progress, PendingStep& p) {
  // Trust a node only about its own ranks.
  auto own = [&](int r) { return r >= 0 && r < job.world_size && job.rank_owner[r] == &node; };
  for (int r : progress.reported()) {
    if (own(r)) p.progress_reported.push_back(r);
  }
  const int n = std::min(progress.ranks_size(), progress.last_steps_size());
  for (int i = 0; i < n; ++i) {
    if (own(progress.ranks(i))) {
      p.progress_last.emplace_back(progress.ranks(i), progress.last_steps(i));
      if (progress.rank_nodes_size() == progress.ranks_size()) {
        p.progress_node.emplace_back(progress.ranks(i), progress.rank_nodes(i));
      }
    }
  }
}

void Coordinator::HandleProgressLocked(Session& s, const v1::NodeProgress& progress) {
  Job& job = *s.job;
  auto git = job.groups.find(progress.group_id());
  if (git == job.groups.end()) return;
  auto pit = git->second.pending.find(progress.step());
  if (pit == git->second.pending.end() || !pit->second.progress_asked) return;
  PendingStep& p = pit->second;
  const NodeState* node = s.node;
  auto asked = std::find(p.progress_unanswered.begin(), p.progress_unanswered.end(), node);
  if (asked == p.progress_unanswered.end()) return;  // not asked, or answered already
  p.progress_unanswered.erase(asked);
  RecordProgressLocked(job, *node, progress, p);
  if (p.progress_unanswered.empty()) {
    // Everyone asked has answered: fail now rather than at the grace's end.
    p.progress_deadline = clock_->Now();
    next_deadline_ = p.progress_deadline;
    timer_cv_.SignalAll();
  }
}

void Coordinator::HandlePartialProgressLocked(Session& s, const v1::NodeProgress& progress) {
  Job& job = *s.job;
  if (job.failed) return;  // every rank already has the job's failure
  auto git = job.groups.find(progress.group_id());
  if (git == job.groups.end() || git->second.reg_state != RegState::kOk) return;
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

void Coordinator::CheckDeadlinesWithoutDelivery() {
  accord::MutexLock l(&mu_);
  const absl::Time now = clock_->Now();
  Outbox out;
  absl::Time next = absl::InfiniteFuture();
  for (auto& [job_id, job] : jobs_) {
    bool failed_now = FailIfNodeLostLocked(job, now, next, out);
    for (auto& [gid, g] : job.groups) {
      if (failed_now) break;
      for (auto& [step, p] : g.pending) {
        if (p.deadline > now) {
          next = std::min(next, p.deadline);
          if (options_.observer != nullptr && !p.stall_reported) {
            const absl::Time half = p.first_seen + options_.deadline / 2;
            if (half <= now) {
              p.stall_reported = true;
              ObserveStallLocked(job, g, step, p, now);
            } else {
              next = std::min(next, half);
            }
          }
          continue;
        }
        RankSet covered(job.world_size);
        for (const Contribution& c : p.contributions) covered.Union(*c.content->ranks);
        if (!p.progress_asked && AskProgressLocked(job, g, step, p, covered, now, out)) {
          next = std::min(next, p.progress_deadline);
          continue;
        }
        if (p.progress_asked && p.progress_deadline > now) {
          next = std::min(next, p.progress_deadline);
          continue;
        }
        // Ranks their sidecar saw submit are not missing (their node waits
        // for a node-mate); name only the others.
        for (int r : p.progress_reported) {
          if (r >= 0 && r < job.world_size) covered.Add(r);
        }
        v1::DecisionError err = MissingRanksErrorLocked(
            job, g, step, p, covered.Missing(),
            absl::StrCat("not every rank reported within ", absl::FormatDuration(options_.deadline),
                         " of the step's first submission (--deadline)"));
        if (options_.observer != nullptr) {
          ObserveEvent e;
          e.type = ObserveEvent::Type::kDeadlineFailure;
          e.job_id = job.job_id;
          e.group_id = g.group_id;
          e.step = step;
          e.kind = err.kind();
          e.message = err.message();
          e.ranks.assign(err.ranks().begin(), err.ranks().end());
          e.last_steps.assign(err.last_steps().begin(), err.last_steps().end());
          e.waiting_ms = absl::ToInt64Milliseconds(now - p.first_seen);
          QueueEventLocked(std::move(e));
        }
        FailJobLocked(job, &g, step, std::move(err), out);
        failed_now = true;
        break;
      }
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
  for (int r = 0; r < it->second.world_size; ++r) out[r] = RankLastStepLocked(it->second, r);
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
    if (git == job.groups.end() || git->second.variants.empty()) {
      return absl::NotFoundError(absl::StrCat("job ", job_id, " has no group \"", group_id, "\""));
    }
    const GroupState& g = git->second;
    const GroupSpec& spec = g.variants[g.spec_variant >= 0 ? g.spec_variant : 0].spec;
    for (const ParamSpec& p : spec.params) out.param_names.push_back(p.name);
    for (auto& [node_id, node] : job.nodes) {
      auto ngit = node.groups.find(group_id);
      if (ngit == node.groups.end()) continue;
      NodeGroupState& ng = ngit->second;
      FlushSkips(ng);
      nodes.push_back(NodeCounts{node.ranks, ng.node_skips, ng.rank_extra_skips});
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
