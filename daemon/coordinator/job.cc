#include "daemon/coordinator/job.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "daemon/common/node_hello.h"
#include "daemon/coordinator/deadline_monitor.h"
#include "daemon/coordinator/located_errors.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

using located::Error;
using located::ErrorFrom;
using located::OutOfOrder;

constexpr char kServerVersion[] = "accord-coordinator/0.1";

}  // namespace

Job::Job(std::string job_id, std::string run_id, int world_size, const CoordinatorOptions& options,
         std::unique_ptr<JobObserver> observer, WorkerPool* executor)
    : core_(std::move(job_id), std::move(run_id), world_size, options),
      waves_(options.deadline, options.observer != nullptr),
      pipeline_(options, executor) {
  core_.observer = std::move(observer);
}

absl::Status Job::CheckJoin(const v1::NodeHello& hello, const std::vector<int>& ranks) const {
  const JobCore& job = core_;
  // Ranks held by another connected node are refused.
  return CheckNodeJoins(job.job_id, job.world_size, hello, [&] {
    RankHeldElsewhere held;
    held.rank = job.members.HeldElsewhere(hello.node_id(), ranks);
    if (held.rank >= 0) held.node_id = job.members.OwnerOf(held.rank)->node_id;
    return held;
  });
}

NodeStream& Job::Connect(StreamId id, NodeSink* sink, const v1::NodeHello& hello,
                         const std::vector<int>& ranks, JobEffects& fx, StreamId* replaced) {
  NodeState& node =
      core_.members.Connect(hello.node_id(), ranks, id, sink, hello.answers_progress(), replaced);
  // The same node reconnected before its old stream was noticed as gone.
  if (*replaced != 0) streams_.erase(*replaced);
  NodeStream& s = streams_[id];
  s = NodeStream();
  s.id = id;
  s.sink = sink;
  s.node = &node;
  core_.member_sets.Refresh(node);
  waves_.Changed();
  core_.ObserveNode(node, /*connected=*/true, fx);
  v1::CoordinatorMessage reply;
  reply.mutable_welcome()->set_node_id(node.node_id);
  reply.mutable_welcome()->set_server_version(kServerVersion);
  reply.mutable_welcome()->set_batch_repeat(true);
  reply.mutable_welcome()->set_deadline_ms(absl::ToInt64Milliseconds(core_.options.deadline));
  reply.mutable_welcome()->set_members(true);
  // A RESUME names the run, or an id the run adopted (docs/ARCHITECTURE.md,
  // "Runs"): the node keeps the id it has, so what it stamped with it stays
  // its run's.
  reply.mutable_welcome()->set_run_id(hello.run_start() == v1::NodeHello::RUN_START_RESUME &&
                                              !hello.run_id().empty()
                                          ? hello.run_id()
                                          : core_.run_id);
  fx.Send(sink, std::move(reply));
  if (core_.failed()) {
    v1::CoordinatorMessage fail;
    *fail.mutable_error() = core_.failure;
    fx.Send(sink, std::move(fail));
  }
  return s;
}

bool Job::Disconnect(NodeStream& s, absl::Time now, JobEffects& fx) {
  NodeState* node = s.node;
  const StreamId id = s.id;
  streams_.erase(id);
  if (node == nullptr || node->session != id) return false;
  core_.members.Disconnect(*node, now);
  waves_.Changed();
  core_.ObserveNode(*node, /*connected=*/false, fx);
  if (core_.members.connected() == 0) {
    ACCORD_LOG(INFO) << "job " << core_.job_id << ": last node (" << node->node_id
                     << ") disconnected; dropping the job's state";
    return true;
  }
  const absl::Duration grace = core_.options.node_reconnect_grace;
  ACCORD_LOG(WARNING) << "job " << core_.job_id << ": node \"" << node->node_id
                      << "\" disconnected; it has " << absl::FormatDuration(grace)
                      << " (--node_reconnect_grace) to come back before a step that needs its "
                         "ranks fails the job";
  fx.WakeAt(node->disconnected_at + grace);
  return false;
}

void Job::HandleRankEvent(NodeStream& s, const v1::RankEvent& e, JobEffects& fx) {
  JobCore& job = core_;
  NodeState& node = *s.node;
  const int r = e.rank();
  if (r < 0 || r >= job.world_size) {
    fx.SendError(s.sink, Error(v1::INVALID_REQUEST,
                               absl::StrCat("job ", job.job_id, ": RankEvent for rank ", r,
                                            " outside 0..", job.world_size - 1),
                               job.job_id));
    return;
  }
  if (e.joined()) {
    const Membership::Join join = job.members.JoinRank(node, r);
    if (join == Membership::Join::kJoined) {
      job.member_sets.Refresh(node);
      waves_.Changed();
    }
    if (join == Membership::Join::kHeldElsewhere) {
      v1::DecisionError err =
          Error(v1::DUPLICATE_RANK,
                absl::StrCat("job ", job.job_id, ": rank ", r, " joined node \"", node.node_id,
                             "\" but is already served by node \"", job.members.OwnerOf(r)->node_id,
                             "\"; check RANK of the processes on both nodes"),
                job.job_id);
      err.add_ranks(r);
      fx.SendError(s.sink, std::move(err));
    }
    return;
  }
  // The rank left: any pending step that still needs it can never complete.
  // Its cause goes into errors as is: bounded, so a sender cannot make them
  // arbitrarily long.
  constexpr size_t kMaxCause = 256;
  std::string cause = e.cause().substr(0, kMaxCause);
  if (!job.members.LeaveRank(node, r, e.last_step(), cause)) return;
  if (job.failed()) return;
  // The lowest (group, step) that needs it names the failure.
  GroupState* culprit = nullptr;
  int64_t culprit_step = 0;
  PendingStep* culprit_pending = nullptr;
  for (auto& [gid, g] : job.groups) {
    if (culprit != nullptr && g.group_id > culprit->group_id) continue;
    if (!g.IsMember(r)) continue;  // its steps never wait for the rank
    for (auto& [step, p] : g.pending) {
      if (!p.clock.started()) continue;  // nobody waits for it
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
  v1::DecisionError err = job.MissingRanksError(*culprit, culprit_step, *culprit_pending,
                                                JobCore::LeftWhy(r, node.node_id, cause));
  job.Fail(culprit, culprit_step, std::move(err), fx);
}

bool Job::FailForAWaitGivenUp(int leaving, bool all_gone, absl::Time now, JobEffects& fx) {
  JobCore& job = core_;
  if (job.failed() || !job.options.waits_cut) return false;
  if (leaving < 0 && !all_gone && job.members.all_connected() && job.members.left_count() == 0) {
    return false;  // nobody is gone
  }
  for (const auto& [r, words] : job.options.waits_cut(job.job_id, job.run_id)) {
    if (r < 0 || r >= job.world_size) continue;
    const NodeState* owner = job.members.OwnerOf(r);
    const bool gone = all_gone || r == leaving || job.members.Left(r) ||
                      (owner != nullptr && owner->lost() &&
                       now >= owner->disconnected_at + job.options.node_reconnect_grace);
    if (!gone) continue;
    ACCORD_LOG(WARNING) << "job " << job.job_id << ": rank " << r
                        << " is gone after its key-value wait was cut at the deadline; the run "
                           "fails with the words that wait ended with";
    job.Fail(nullptr, -1, wire::MakeError(v1::MISSING_RANKS, words), fx);
    return true;
  }
  return false;
}

void Job::HandleProgress(NodeStream& s, const v1::NodeProgress& progress, absl::Time now,
                         JobEffects& fx) {
  DeadlineMonitor deadlines(core_);
  if (progress.partial()) {
    deadlines.HandlePartialProgress(*s.node, progress, now, fx);
  } else {
    deadlines.HandleProgress(*s.node, progress, now, fx);
  }
}

absl::Time Job::CheckDeadlines(absl::Time now, JobEffects& fx) {
  absl::Time next = absl::InfiniteFuture();
  // With several domains, what the monitor does about one domain's steps
  // (a failure, a progress ask) may concern another's held repeats: they
  // become pending steps first.
  if (!core_.member_sets.empty() && waves_.holding() && MonitorMayAct()) BreakWave(now, fx);
  for (int e = 0; e < waves_.elements(); ++e) {
    const RepeatWaves& w = waves_.at(e);
    if (!w.holding()) continue;
    // A wave still waiting at its stall or deadline check becomes pending
    // steps, which the monitor checks.
    if (w.wake() <= now) {
      BreakDomain(e, now, fx);
    } else {
      next = std::min(next, w.wake());
    }
  }
  return std::min(next, DeadlineMonitor(core_).Check(now, fx));
}

bool Job::MonitorMayAct() const {
  if (!core_.members.all_connected()) return true;
  for (const auto& [id, g] : core_.groups) {
    if (!g.pending.empty()) return true;
    if (g.registration.state() == GroupRegistration::State::kCollecting &&
        g.registration_due != absl::InfiniteFuture()) {
      return true;
    }
  }
  return false;
}

void Job::HandleRegistration(NodeStream& s, const v1::NodeRegistration& nr, absl::Time now,
                             JobEffects& fx) {
  const JobCore& job = core_;
  const v1::GroupRegistration& reg = nr.registration();
  auto reply = [&](v1::DecisionError err) {
    // About this registration only: name its ranks so the sidecar answers
    // just them, not every local rank of the group.
    for (int r : nr.ranks()) err.add_ranks(r);
    fx.SendRegistrationError(s.sink, reg.group_id(), std::move(err));
  };
  absl::StatusOr<GroupSpec> spec = wire::GroupSpecFromProto(reg, job.world_size);
  if (!spec.ok()) {
    reply(ErrorFrom(v1::INVALID_REQUEST, spec.status(), absl::StrCat("job ", job.job_id, ": "),
                    job.job_id, reg.group_id()));
    return;
  }
  const bool one_domain = core_.member_sets.empty();
  spec->members = core_.member_sets.Intern(std::move(spec->members), core_.members);
  waves_.Changed();
  // The first member set: the job's waves run per domain from now on.
  if (one_domain && !core_.member_sets.empty()) waves_.world().Reset();
  absl::StatusOr<Policy> policy = wire::PolicyFromProto(reg.policy());
  if (!policy.ok()) {
    reply(ErrorFrom(v1::INVALID_REQUEST, policy.status(),
                    absl::StrCat("job ", job.job_id, " group \"", reg.group_id(), "\": "),
                    job.job_id, reg.group_id()));
    return;
  }
  absl::StatusOr<std::vector<int>> ranks = CheckRegistration(*s.node, nr, *spec);
  absl::StatusOr<GroupState*> group =
      ranks.ok() ? FindOrCreateGroup(reg.group_id()) : ranks.status();
  if (!group.ok()) {
    reply(ErrorFrom(v1::ERROR_KIND_UNSPECIFIED, group.status(), "", job.job_id, reg.group_id()));
    return;
  }
  Register(s, **group, *spec, *policy, *ranks, now, fx);
}

absl::StatusOr<std::vector<int>> Job::CheckRegistration(const NodeState& node,
                                                        const v1::NodeRegistration& nr,
                                                        const GroupSpec& spec) const {
  const JobCore& job = core_;
  const std::string& group_id = nr.registration().group_id();
  const int64_t max_params = job.options.max_params_per_group;
  if (static_cast<int64_t>(spec.params.size()) > max_params) {
    return wire::KindError(
        v1::LIMIT_EXCEEDED,
        absl::StrCat("job ", job.job_id, " group \"", group_id, "\": ", spec.params.size(),
                     " parameters exceed --max_params_per_group=", max_params));
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
    if (spec.members != nullptr && !spec.members->Contains(r)) {
      return wire::KindError(
          v1::INVALID_REQUEST,
          absl::StrCat("job ", job.job_id, " group \"", group_id, "\": rank ", r,
                       " is not among the members it registered (", spec.members->Describe(),
                       "); a rank registers only the groups it reduces"));
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

absl::StatusOr<GroupState*> Job::FindOrCreateGroup(const std::string& group_id) {
  JobCore& job = core_;
  auto git = job.groups.find(group_id);
  if (git != job.groups.end()) return &git->second;
  if (static_cast<int>(job.groups.size()) >= job.options.max_groups_per_job) {
    return wire::KindError(
        v1::LIMIT_EXCEEDED,
        absl::StrCat("job ", job.job_id, ": group \"", group_id,
                     "\" would exceed --max_groups_per_job=", job.options.max_groups_per_job));
  }
  GroupState& g =
      job.groups.try_emplace(group_id, job.world_size, job.job_id, group_id).first->second;
  if (job.observer != nullptr) g.observer = job.observer->ForGroup(group_id);
  return &g;
}

namespace {

// A registration result carrying a failure already counted.
v1::CoordinatorMessage RegistrationFailure(const std::string& group_id,
                                           const v1::DecisionError& error) {
  v1::CoordinatorMessage msg;
  msg.mutable_registration()->set_group_id(group_id);
  *msg.mutable_registration()->mutable_error() = error;
  return msg;
}

}  // namespace

void Job::Register(NodeStream& s, GroupState& g, const GroupSpec& spec, const Policy& policy,
                   const std::vector<int>& ranks, absl::Time now, JobEffects& fx) {
  JobCore& job = core_;
  NodeState& node = *s.node;
  const GroupRegistration::State before = g.registration.state();
  if (job.failed() && before == GroupRegistration::State::kCollecting) {
    // A group first registered after the job failed can never complete
    // (every group collecting at the failure was failed with it): the job's
    // failure again (counted when it happened).
    v1::CoordinatorMessage msg = RegistrationFailure(g.group_id, job.failure);
    msg.mutable_registration()->mutable_error()->set_kind(v1::JOB_FAILED);
    fx.Send(s.sink, std::move(msg));
    return;
  }
  const GroupRegistration::Added added = g.registration.Add(spec, policy, ranks);
  auto [ngit, created] = node.groups.try_emplace(g.group_id);
  if (created) ngit->second.waves_counted = g.waves;  // waves before it are not its
  ngit->second.variant = added.variant;
  if (added.completed) {
    BroadcastRegistration(g, fx);
    return;
  }
  if (before == GroupRegistration::State::kCollecting) {
    // The first registration starts the group's clock (docs/ARCHITECTURE.md,
    // "Every wait names who is missing").
    if (g.registration_due == absl::InfiniteFuture()) {
      g.registration_due = now + job.options.deadline;
      fx.WakeAt(g.registration_due);
    }
    return;
  }
  if (before == GroupRegistration::State::kFailed) {
    // The group's failure again (counted when it happened).
    fx.Send(s.sink, RegistrationFailure(g.group_id, g.registration.error()));
    return;
  }
  if (!g.registration.IsAgreed(added.variant)) {
    fx.SendRegistrationError(
        s.sink, g.group_id,
        Error(v1::REGISTRATION_MISMATCH,
              absl::StrCat("job ", job.job_id, " group \"", g.group_id, "\": ranks ",
                           FormatRanks(ranks), " on node \"", node.node_id,
                           "\" registered a spec or policy different from the one every rank "
                           "agreed on; check the model definition on those ranks"),
              job.job_id, g.group_id));
    return;
  }
  v1::CoordinatorMessage msg;
  msg.mutable_registration()->set_group_id(g.group_id);
  msg.mutable_registration()->set_spec_fingerprint(g.registration.fingerprint());
  fx.Send(s.sink, std::move(msg));
}

void Job::BroadcastRegistration(GroupState& g, JobEffects& fx) {
  v1::CoordinatorMessage msg;
  msg.mutable_registration()->set_group_id(g.group_id);
  if (g.registration.state() == GroupRegistration::State::kAgreed) {
    msg.mutable_registration()->set_spec_fingerprint(g.registration.fingerprint());
    core_.SendToRegistrants(g, std::move(msg), fx);
    return;
  }
  const v1::DecisionError& error = g.registration.error();
  *msg.mutable_registration()->mutable_error() = error;
  fx.NoteError(error);
  ACCORD_LOG(WARNING) << error.message();
  // Pending steps of the group can never be decided.
  v1::DecisionBatch& batch = fx.Decisions();
  for (auto& [step, p] : g.pending) {
    if (!p.clock.started()) continue;  // its nodes hold its decision
    v1::Decision* d = batch.add_decisions();
    d->set_group_id(g.group_id);
    d->set_step(step);
    *d->mutable_error() = error;
    d->mutable_error()->set_step(step);
  }
  g.pending.clear();
  core_.SendToRegistrants(g, std::move(msg), fx);
}

}  // namespace accord::daemon
