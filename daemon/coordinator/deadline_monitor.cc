#include "daemon/coordinator/deadline_monitor.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/log.h"
#include "daemon/coordinator/located_errors.h"

namespace accord::daemon {

using located::Error;

absl::Time DeadlineMonitor::Check(absl::Time now, JobEffects& fx) {
  absl::Time next = absl::InfiniteFuture();
  if (FailIfNodeLost(now, next, fx)) return next;
  CheckGroups(now, next, fx);
  return next;
}

bool DeadlineMonitor::FailIfNodeLost(absl::Time now, absl::Time& next, JobEffects& fx) {
  JobCore& job = job_;
  if (job.failed() || job.members.all_connected()) return false;
  const absl::Duration grace = job.options.node_reconnect_grace;
  std::vector<const NodeState*> lost;
  for (const auto& [node_id, node] : job.members.nodes()) {
    if (!node.lost()) continue;
    const absl::Time due = node.disconnected_at + grace;
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
      if (!p.clock.started()) continue;  // nobody waits for it
      RankSet covered(job.world_size);
      for (const Contribution& c : p.contributions) covered.Union(*c.content->ranks);
      for (const NodeState* node : lost) {
        std::vector<int> missing;
        for (int r : node->ranks) {
          if (job.members.OwnerOf(r) == node && !covered.Contains(r) && g.IsMember(r)) {
            missing.push_back(r);
          }
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
                   absl::FormatDuration(grace),
                   " (--node_reconnect_grace), so its ranks cannot take part: its sidecar did "
                   "not come back in time or its host is unreachable; restart the job"),
      job.job_id, culprit->group_id, culprit_step);
  for (int r : needed) err.add_ranks(r);
  job.Fail(culprit, culprit_step, err, fx);
  // Every rank gets it at once, also those not waiting for a decision: each
  // sidecar passes a job error to all its ranks and closes them.
  // Without group and step, so a client fails every call with it (the text
  // still names them).
  v1::CoordinatorMessage m;
  *m.mutable_error() = err;
  m.mutable_error()->clear_group_id();
  m.mutable_error()->set_step(-1);
  fx.Broadcast(std::move(m));
  return true;
}

bool DeadlineMonitor::CheckGroups(absl::Time now, absl::Time& next, JobEffects& fx) {
  JobCore& job = job_;
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
    FailRegistration(*unregistered, fx);
    return true;
  }
  std::sort(waiting.begin(), waiting.end(),
            [](const GroupState* a, const GroupState* b) { return a->group_id < b->group_id; });
  for (GroupState* g : waiting) {
    for (auto& [step, p] : g->pending) {
      if (CheckStep(*g, step, p, now, next, fx)) {
        // The group's oldest waiting step names the failure: a later step
        // is due first only when it arrived first, e.g. after a restart
        // where a rank skipped the older one (named "past this step"). A
        // step whose clock never started has nobody waiting for it.
        auto oldest = std::find_if(g->pending.begin(), g->pending.end(),
                                   [](const auto& e) { return e.second.clock.started(); });
        FailStep(*g, oldest->first, oldest->second, now, fx);
        return true;
      }
    }
  }
  return false;
}

bool DeadlineMonitor::CheckStep(GroupState& g, int64_t step, PendingStep& p, absl::Time now,
                                absl::Time& next, JobEffects& fx) {
  switch (p.clock.Check(now, job_.observing(), next)) {
    case StepDeadline::Due::kNothing:
      return false;
    case StepDeadline::Due::kStall:
      ObserveStall(g, step, p, now, fx);
      return false;
    case StepDeadline::Due::kAsk:
      if (AskProgress(g, step, p, now, fx)) {
        next = std::min(next, p.clock.grace_end());
        return false;
      }
      break;  // nobody to ask: the step fails now
    case StepDeadline::Due::kFail:
      break;
  }
  return true;
}

bool DeadlineMonitor::AskProgress(GroupState& g, int64_t step, PendingStep& p, absl::Time now,
                                  JobEffects& fx) {
  JobCore& job = job_;
  RankSet covered(job.world_size);
  for (const Contribution& c : p.contributions) covered.Union(*c.content->ranks);
  std::vector<const NodeState*> asked;
  for (int r : covered.Missing()) {
    if (!g.IsMember(r)) continue;
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
    fx.Send(node->sink, std::move(q));
  }
  ACCORD_LOG(WARNING) << "job " << job.job_id << " group \"" << g.group_id << "\" step " << step
                      << ": deadline passed; asking " << asked.size()
                      << " node(s) which of their ranks submitted";
  // A short grace past the deadline: a quarter of it, at most one second.
  p.clock.Ask(std::move(asked), now + std::min(absl::Seconds(1), job.options.deadline / 4));
  return true;
}

void DeadlineMonitor::FailStep(GroupState& g, int64_t step, PendingStep& p, absl::Time now,
                               JobEffects& fx) {
  // Ranks their sidecar saw submit are not missing (their node waits for a
  // node-mate); StepFacts names only the others.
  v1::DecisionError err = job_.MissingRanksError(
      g, step, p,
      absl::StrCat("not every rank reported within ", absl::FormatDuration(job_.options.deadline),
                   " of the step's first submission (--deadline)"));
  if (job_.observing()) {
    ObserveEvent e;
    e.type = ObserveEvent::Type::kDeadlineFailure;
    e.job_id = job_.job_id;
    e.group_id = g.group_id;
    e.step = step;
    e.kind = err.kind();
    e.message = err.message();
    e.ranks.assign(err.ranks().begin(), err.ranks().end());
    e.last_steps.assign(err.last_steps().begin(), err.last_steps().end());
    e.waiting_ms = absl::ToInt64Milliseconds(now - p.clock.first_seen());
    fx.Event(std::move(e));
  }
  job_.Fail(&g, step, std::move(err), fx);
}

void DeadlineMonitor::FailRegistration(GroupState& g, JobEffects& fx) {
  const JobCore& job = job_;
  const std::vector<int> missing = g.registration.Unregistered();
  std::vector<std::string> parts;
  for (int r : missing) {
    if (parts.size() == 32) {
      parts.push_back(absl::StrCat("and ", missing.size() - 32, " more"));
      break;
    }
    parts.push_back(job.members.Describe(r));
  }
  const std::vector<int> registered = g.registration.Registered();
  const MemberSet* members = g.registration.members().get();
  v1::DecisionError err = Error(
      v1::MISSING_RANKS,
      absl::StrCat("job ", job.job_id, " group \"", g.group_id, "\": not every ",
                   members ? absl::StrCat("member (", members->Describe(), ")") : "rank",
                   " registered the group within ", absl::FormatDuration(job.options.deadline),
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
  job_.Fail(&g, -1, std::move(err), fx);
}

void DeadlineMonitor::RecordProgress(const NodeState& node, const v1::NodeProgress& progress,
                                     PendingStep& p) {
  // Trust a node only about its own ranks.
  auto own = [&](int r) {
    return r >= 0 && r < job_.world_size && job_.members.OwnerOf(r) == &node;
  };
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

void DeadlineMonitor::HandleProgress(const NodeState& node, const v1::NodeProgress& progress,
                                     absl::Time now, JobEffects& fx) {
  auto git = job_.groups.find(progress.group_id());
  if (git == job_.groups.end()) return;
  auto pit = git->second.pending.find(progress.step());
  if (pit == git->second.pending.end()) return;
  PendingStep& p = pit->second;
  const StepDeadline::Answered answered = p.clock.Answer(&node, now);
  if (answered == StepDeadline::Answered::kIgnored) return;
  RecordProgress(node, progress, p);
  if (answered == StepDeadline::Answered::kAll) fx.WakeAt(p.clock.grace_end());
}

void DeadlineMonitor::HandlePartialProgress(const NodeState& node, const v1::NodeProgress& progress,
                                            absl::Time now, JobEffects& fx) {
  JobCore& job = job_;
  if (job.failed()) return;  // every rank already has the job's failure
  auto git = job.groups.find(progress.group_id());
  if (git == job.groups.end() ||
      git->second.registration.state() != GroupRegistration::State::kAgreed)
    return;
  GroupState& g = git->second;
  const int64_t step = progress.step();
  // Decided already (the decision is on its way) or nonsense: nothing to time.
  if (step < 0 || step <= g.last_decided_step()) return;
  auto pit = g.pending.find(step);
  // The step began when the node's first rank submitted it, not now.
  const absl::Duration waited = std::clamp(absl::Microseconds(progress.waited_us()),
                                           absl::ZeroDuration(), job.options.deadline);
  if (pit != g.pending.end() && !pit->second.clock.started()) {
    // Only `decided` manifests spoke for it; a rank of this node waits.
    fx.WakeAt(job.StartClock(pit->second, now - waited));
  } else if (pit == g.pending.end()) {
    if (static_cast<int>(g.pending.size()) >= job.options.max_pending_steps) return;
    absl::Time wake;
    std::tie(pit, wake) = job.StartStep(g, step, now - waited);
    fx.WakeAt(wake);
    ACCORD_LOG(INFO) << "job " << job.job_id << " group \"" << g.group_id << "\" step " << step
                     << ": node \"" << node.node_id << "\" reports " << progress.reported_size()
                     << " of its ranks submitted it " << absl::FormatDuration(waited)
                     << " ago and others not; the deadline clock runs";
  }
  RecordProgress(node, progress, pit->second);
  job.FailIfALeftRankMisses(g, step, pit->second, fx);
}

void DeadlineMonitor::ObserveStall(const GroupState& g, int64_t step, const PendingStep& p,
                                   absl::Time now, JobEffects& fx) const {
  ObserveEvent e;
  e.type = ObserveEvent::Type::kStall;
  e.job_id = job_.job_id;
  e.group_id = g.group_id;
  e.step = step;
  e.waiting_ms = absl::ToInt64Milliseconds(now - p.clock.first_seen());
  e.deadline_in_ms = absl::ToInt64Milliseconds(p.clock.deadline() - now);
  // The ranks waited for, each with its last step of this group.
  const StepFacts facts(job_, g, p);
  for (int r = 0; r < job_.world_size; ++r) {
    if (facts.Submitted(r) || !g.IsMember(r)) continue;
    e.ranks.push_back(r);
    e.last_steps.push_back(facts.LastStep(r));
  }
  fx.Event(std::move(e));
}

}  // namespace accord::daemon
