// The coordinator's observe side: counters and the usage window kept per
// group, events for the observer, and the read-only views of observe.proto.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/coordinator.h"

namespace accord::daemon {
void Coordinator::QueueEventLocked(ObserveEvent event) {
  if (options_.observer == nullptr) return;
  events_.push_back(std::move(event));
  have_events_.store(true, std::memory_order_release);
}

void Coordinator::NoteErrorLocked(const v1::DecisionError& error) {
  ++stats_.errors;
  if (options_.observer == nullptr) return;
  ObserveEvent e;
  e.type = ObserveEvent::Type::kError;
  e.job_id = error.job_id();
  e.group_id = error.group_id();
  e.step = error.step();
  e.kind = error.kind();
  e.message = error.message();
  e.ranks.assign(error.ranks().begin(), error.ranks().end());
  e.last_steps.assign(error.last_steps().begin(), error.last_steps().end());
  QueueEventLocked(std::move(e));
}

void Coordinator::ObserveNodeLocked(const Job& job, const NodeState& node, bool connected) {
  if (options_.observer == nullptr) return;
  ObserveEvent e;
  e.type = connected ? ObserveEvent::Type::kNodeConnected : ObserveEvent::Type::kNodeDisconnected;
  e.job_id = job.job_id;
  e.node_id = node.node_id;
  e.ranks = node.ranks;
  e.connected_nodes = job.members.connected();
  QueueEventLocked(std::move(e));
}

void Coordinator::ObserveStallLocked(const Job& job, const GroupState& g, int64_t step,
                                     const PendingStep& p, absl::Time now) {
  ObserveEvent e;
  e.type = ObserveEvent::Type::kStall;
  e.job_id = job.job_id;
  e.group_id = g.group_id;
  e.step = step;
  e.waiting_ms = absl::ToInt64Milliseconds(now - p.clock.first_seen());
  e.deadline_in_ms = absl::ToInt64Milliseconds(p.clock.deadline() - now);
  // The ranks waited for, each with its last step of this group.
  const StepFacts facts(job, g, p);
  for (int r = 0; r < job.world_size; ++r) {
    if (facts.Submitted(r)) continue;
    e.ranks.push_back(r);
    e.last_steps.push_back(facts.LastStep(r));
  }
  QueueEventLocked(std::move(e));
}

void Coordinator::ObserveDeadlineFailureLocked(const Job& job, const GroupState& g, int64_t step,
                                               const PendingStep& p, const v1::DecisionError& error,
                                               absl::Time now) {
  if (options_.observer == nullptr) return;
  ObserveEvent e;
  e.type = ObserveEvent::Type::kDeadlineFailure;
  e.job_id = job.job_id;
  e.group_id = g.group_id;
  e.step = step;
  e.kind = error.kind();
  e.message = error.message();
  e.ranks.assign(error.ranks().begin(), error.ranks().end());
  e.last_steps.assign(error.last_steps().begin(), error.last_steps().end());
  e.waiting_ms = absl::ToInt64Milliseconds(now - p.clock.first_seen());
  QueueEventLocked(std::move(e));
}

void Coordinator::DeliverEvents() {
  if (options_.observer == nullptr || !have_events_.load(std::memory_order_acquire)) return;
  accord::MutexLock order(&deliver_mu_);
  std::vector<ObserveEvent> events;
  {
    accord::MutexLock l(&mu_);
    events.swap(events_);
    have_events_.store(false, std::memory_order_relaxed);
  }
  for (const ObserveEvent& e : events) options_.observer->OnEvent(e);
}

void Coordinator::ObserveDecisionLocked(Job& job, GroupState& g, int64_t step, PendingStep& p,
                                        const v1::Decision& d, const Decision* decided) {
  ObserveDecisionLocked(job, g, step, &p, d, decided, [&] {
    std::vector<std::shared_ptr<const Content>> contents;
    contents.reserve(p.contributions.size());
    for (const Contribution& c : p.contributions) contents.push_back(c.Owner());
    p.contributions.clear();
    return contents;
  });
}

void Coordinator::ObserveDecisionLocked(Job& job, GroupState& g, int64_t step, const PendingStep* p,
                                        const v1::Decision& d, const Decision* decided,
                                        StepContents contents) {
  ++g.decisions;
  const bool same = d.same_as_previous();
  const bool ok = same || d.has_ok();
  if (decided != nullptr && p != nullptr) {
    NoteDecidedLocked(job, g, step, *p, *decided);
  } else if (!ok) {
    g.have_last_ok = false;
  }
  if (g.observer != nullptr) {
    DecisionSummary s;
    s.step = step;
    s.ok = ok;
    s.same_as_previous = same;
    if (ok) {
      s.wire = g.last_wire;
      s.included = static_cast<int>(g.last_included.size()) - g.last_num_skipped;
      s.skipped = g.last_num_skipped;
      s.zero_fills = g.last_zero_fills;
    }
    s.wait = absl::Microseconds(d.wait_us());
    g.observer->OnDecision(s);
  }
  RecordUsageLocked(g, step, same, contents);
}

// Zero-fills: (included parameter, rank) pairs without a local gradient.
// O(nodes x params).
int64_t Coordinator::ZeroFills(const PendingStep& p, const Decision& decided) {
  int64_t zero_fills = 0;
  for (const Contribution& c : p.contributions) {
    const Content& content = *c.content;
    const size_t n = std::min(content.dtypes.size(), decided.included.size());
    for (size_t i = 0; i < n; ++i) {
      if (!decided.included[i]) continue;
      if (content.dtypes[i] == 0) {
        zero_fills += content.rank_count;
        continue;
      }
      for (const RankDetail& r : content.detail) zero_fills += r.used[i] ? 0 : 1;
    }
  }
  return zero_fills;
}

void Coordinator::NoteDecidedLocked(const Job& job, GroupState& g, int64_t step,
                                    const PendingStep& p, const Decision& decided) {
  // Only the metrics need the zero-fills.
  const int64_t zero_fills = g.observer != nullptr ? ZeroFills(p, decided) : 0;
  int skipped = 0;
  for (bool in : decided.included) skipped += in ? 0 : 1;
  const bool changed =
      !g.have_last_ok || g.last_wire != decided.wire_dtype || g.last_included != decided.included;
  g.have_last_ok = true;
  g.last_wire = decided.wire_dtype;
  g.last_included = decided.included;
  g.last_num_skipped = skipped;
  g.last_zero_fills = zero_fills;
  if (!changed || options_.observer == nullptr) return;
  ObserveEvent e;
  e.type = ObserveEvent::Type::kDecisionChanged;
  e.job_id = job.job_id;
  e.group_id = g.group_id;
  e.step = step;
  e.wire = std::string(DTypeName(decided.wire_dtype));
  e.included = static_cast<int>(decided.included.size()) - skipped;
  e.skipped = skipped;
  const GroupSpec& spec = g.registration.reference().spec;
  for (size_t i = 0; i < decided.included.size() && i < spec.params.size(); ++i) {
    if (decided.included[i]) continue;
    if (static_cast<int>(e.skipped_names.size()) >= ObserveEvent::kMaxSkippedNames) break;
    e.skipped_names.push_back(spec.params[i].name);
  }
  QueueEventLocked(std::move(e));
}

void Coordinator::RecordUsageLocked(GroupState& g, int64_t step, bool same, StepContents contents) {
  // Usage window: extend the last run when the contents repeat the previous
  // step; otherwise start a run with this step's contents.
  if (options_.usage_window_steps <= 0) return;
  stats_.usage_bytes += g.usage.Record(step, same, contents);
  // The global cap (usage_total_bytes): retired jobs' windows go first.
  while (stats_.usage_bytes > options_.usage_total_bytes && !retired_.empty()) {
    PopRetiredLocked();
  }
  g.usage.Trim(UsageLimits(), stats_.usage_bytes);
}

UsageWindow::Limits Coordinator::UsageLimits() const {
  UsageWindow::Limits limits;
  limits.steps = options_.usage_window_steps;
  limits.bytes = options_.usage_window_bytes;
  limits.total_bytes = options_.usage_total_bytes;
  return limits;
}

Coordinator::StatusSnapshot Coordinator::StatusSnapshotLocked(const Job& job) {
  StatusSnapshot snap;
  snap.job_id = job.job_id;
  snap.world_size = job.world_size;
  std::vector<const NodeState*> nodes;
  for (const auto& [id, node] : job.members.nodes()) nodes.push_back(&node);
  std::sort(nodes.begin(), nodes.end(),
            [](const NodeState* a, const NodeState* b) { return a->node_id < b->node_id; });
  absl::flat_hash_map<const NodeState*, int> index;
  for (const NodeState* node : nodes) {
    index[node] = static_cast<int>(snap.nodes.size());
    snap.nodes.push_back(StatusSnapshot::Node{node->node_id, node->connected(), node->ranks});
  }
  snap.rank_owner.assign(job.world_size, -1);
  snap.rank_connected.assign(job.world_size, false);
  snap.rank_last_step.resize(job.world_size);
  for (int r = 0; r < job.world_size; ++r) {
    const NodeState* owner = job.members.OwnerOf(r);
    if (owner != nullptr) snap.rank_owner[r] = index[owner];
    snap.rank_connected[r] = owner != nullptr && owner->connected() && !job.members.Left(r);
    snap.rank_last_step[r] = job.members.LastStep(r);
  }
  for (const auto& [id, g] : job.groups) snap.groups.push_back(GroupStatusOf(g));
  std::sort(snap.groups.begin(), snap.groups.end(),
            [](const StatusSnapshot::Group& a, const StatusSnapshot::Group& b) {
              return a.group_id < b.group_id;
            });
  snap.failed = job.failed();
  if (job.failed()) snap.error = job.failure.message();
  return snap;
}

Coordinator::StatusSnapshot::Group Coordinator::GroupStatusOf(const GroupState& g) {
  StatusSnapshot::Group s;
  s.group_id = g.group_id;
  if (!g.registration.empty()) {
    s.num_params = static_cast<int>(g.registration.reference().spec.params.size());
  }
  s.last_decided_step = g.last_decided_step;
  s.decisions = g.decisions;
  s.cache_hits = g.cache_hits;
  s.cache_misses = g.cache_misses;
  s.have_last_ok = g.have_last_ok;
  s.last_wire = g.last_wire;
  s.last_num_skipped = g.last_num_skipped;
  if (g.registration.state() == GroupRegistration::State::kFailed) {
    s.failed = true;
    s.error = g.registration.error().message();
  } else if (g.last_decision != nullptr && g.last_decision->has_error()) {
    s.failed = true;
    s.error = g.last_decision->error().message();
  }
  return s;
}

v1::JobStatus Coordinator::JobStatusOf(const StatusSnapshot& snap) {
  v1::JobStatus js;
  js.set_job_id(snap.job_id);
  js.set_world_size(snap.world_size);
  for (const StatusSnapshot::Node& node : snap.nodes) {
    v1::NodeStatus* ns = js.add_nodes();
    ns->set_node_id(node.node_id);
    ns->set_connected(node.connected);
    for (int r : node.ranks) ns->add_ranks(r);
  }
  for (int r = 0; r < snap.world_size; ++r) {
    v1::RankStatus* rs = js.add_ranks();
    rs->set_rank(r);
    if (snap.rank_owner[r] >= 0) rs->set_node_id(snap.nodes[snap.rank_owner[r]].node_id);
    rs->set_connected(snap.rank_connected[r]);
    rs->set_last_step(snap.rank_last_step[r]);
  }
  for (const StatusSnapshot::Group& g : snap.groups) {
    v1::GroupStatus* gs = js.add_groups();
    gs->set_group_id(g.group_id);
    if (g.num_params >= 0) gs->set_num_params(g.num_params);
    gs->set_last_decided_step(g.last_decided_step);
    gs->set_decisions(g.decisions);
    gs->set_cache_hits(g.cache_hits);
    gs->set_cache_misses(g.cache_misses);
    if (g.have_last_ok) gs->set_last_wire_dtype(std::string(DTypeName(g.last_wire)));
    gs->set_last_num_skipped(g.last_num_skipped);
    if (g.failed) {
      gs->set_failed(true);
      gs->set_error(g.error);
    }
  }
  js.set_failed(snap.failed);
  if (snap.failed) js.set_error(snap.error);
  return js;
}

void Coordinator::RetireJobLocked(Job& job) {
  if (options_.retired_jobs <= 0) return;  // RemoveJobLocked uncounts the windows
  RetiredJob r;
  r.status = JobStatusOf(StatusSnapshotLocked(job));
  for (auto& [id, g] : job.groups) {
    if (g.registration.empty()) continue;
    RetiredGroup& rg = r.groups[id];
    for (const ParamSpec& p : g.registration.reference().spec.params) {
      rg.param_names.push_back(p.name);
    }
    // Now counted as the retired job's (the group's window is left empty).
    rg.usage = g.usage.Take();
    r.usage_bytes += rg.usage.bytes();
  }
  for (auto it = retired_.begin(); it != retired_.end();) {
    if (it->status.job_id() == job.job_id) {
      stats_.usage_bytes -= it->usage_bytes;
      it = retired_.erase(it);
    } else {
      ++it;
    }
  }
  retired_.push_back(std::move(r));
  while (static_cast<int>(retired_.size()) > options_.retired_jobs) PopRetiredLocked();
}

void Coordinator::PopRetiredLocked() {
  stats_.usage_bytes -= retired_.front().usage_bytes;
  retired_.pop_front();
}

absl::StatusOr<v1::StatusResponse> Coordinator::ObserveStatus(const std::string& job_id) {
  // Snapshot under the lock (plain copies, no protos); the responses are
  // built outside it.
  std::vector<StatusSnapshot> live;
  std::vector<v1::JobStatus> retired;
  {
    accord::MutexLock l(&mu_);
    for (const auto& [id, job] : jobs_) {
      if (job_id.empty() || id == job_id) live.push_back(StatusSnapshotLocked(job));
    }
    for (auto it = retired_.rbegin(); it != retired_.rend(); ++it) {
      if (!job_id.empty() && it->status.job_id() != job_id) continue;
      if (jobs_.contains(it->status.job_id())) continue;
      retired.push_back(it->status);
    }
  }
  std::sort(live.begin(), live.end(),
            [](const StatusSnapshot& a, const StatusSnapshot& b) { return a.job_id < b.job_id; });
  v1::StatusResponse out;
  for (const StatusSnapshot& snap : live) *out.add_jobs() = JobStatusOf(snap);
  for (v1::JobStatus& status : retired) *out.add_jobs() = std::move(status);
  if (!job_id.empty() && out.jobs().empty()) {
    return absl::NotFoundError(absl::StrCat("job \"", job_id,
                                            "\" is unknown to this coordinator (not running "
                                            "and not among the recently ended jobs); check the "
                                            "job id with `accordctl status`"));
  }
  return out;
}

absl::StatusOr<v1::SkipMatrixResponse> Coordinator::ObserveSkipMatrix(const std::string& job_id,
                                                                      const std::string& group_id,
                                                                      int64_t window_steps) {
  if (job_id.empty()) {
    return absl::InvalidArgumentError("SkipMatrix needs a job_id (see `accordctl status`)");
  }
  if (window_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("window_steps ", window_steps, " is negative; use 0 for every kept step"));
  }
  // Snapshot under the lock (names and the usage runs in the window: shared,
  // immutable contents), build the groups x params x world matrix outside
  // it, so a large matrix never holds up the hot path.
  struct GroupSnapshot {
    std::string group_id;
    std::vector<std::string> names;
    std::deque<UsageRun> usage;
  };
  std::vector<GroupSnapshot> groups;
  int world = 0;
  v1::SkipMatrixResponse out;
  out.set_job_id(job_id);
  auto unknown_group = [&] {
    return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" has no registered group \"",
                                            group_id,
                                            "\"; check the group id with "
                                            "`accordctl status --job=",
                                            job_id, "`"));
  };
  {
    accord::MutexLock l(&mu_);
    bool found = false;
    if (auto it = jobs_.find(job_id); it != jobs_.end()) {
      found = true;
      const Job& job = it->second;
      world = job.world_size;
      std::vector<std::string> ids;
      for (const auto& [id, g] : job.groups) {
        if (!g.registration.empty() && (group_id.empty() || id == group_id)) ids.push_back(id);
      }
      if (!group_id.empty() && ids.empty()) return unknown_group();
      std::sort(ids.begin(), ids.end());
      for (const std::string& id : ids) {
        const GroupState& g = job.groups.find(id)->second;
        GroupSnapshot& snap = groups.emplace_back();
        snap.group_id = id;
        for (const ParamSpec& p : g.registration.reference().spec.params) {
          snap.names.push_back(p.name);
        }
        snap.usage = g.usage.Newest(window_steps);
      }
    } else {
      for (auto it = retired_.rbegin(); it != retired_.rend(); ++it) {
        if (it->status.job_id() != job_id) continue;
        found = true;
        world = it->status.world_size();
        if (!group_id.empty() && !it->groups.contains(group_id)) return unknown_group();
        for (const auto& [id, rg] : it->groups) {
          if (!group_id.empty() && id != group_id) continue;
          groups.push_back(GroupSnapshot{id, rg.param_names, rg.usage.Newest(window_steps)});
        }
        break;
      }
    }
    if (!found) {
      return absl::NotFoundError(absl::StrCat("job \"", job_id,
                                              "\" is unknown to this coordinator (not running and "
                                              "not among the recently ended jobs); check the job "
                                              "id with `accordctl status`"));
    }
  }
  out.set_world_size(world);
  for (const GroupSnapshot& g : groups) {
    *out.add_groups() = UsageWindow::MatrixOf(g.group_id, g.names, world, g.usage, window_steps);
  }
  return out;
}

struct Coordinator::StallsSnapshot {
  struct Step {
    std::string group_id;
    int64_t step;
    absl::Time first_seen;
    absl::Time deadline;
    int64_t last_decided;  // the group's
    std::vector<std::shared_ptr<const RankSet>> covered;
  };
  std::string job_id;
  int world_size = 0;
  std::vector<Step> steps;  // by group id, then step
};

Coordinator::StallsSnapshot Coordinator::StallsSnapshotLocked(const Job& job) {
  StallsSnapshot snap;
  snap.job_id = job.job_id;
  snap.world_size = job.world_size;
  std::vector<const GroupState*> groups;
  for (const auto& [gid, g] : job.groups) {
    if (!g.pending.empty()) groups.push_back(&g);
  }
  if (groups.empty()) return snap;
  std::sort(groups.begin(), groups.end(),
            [](const GroupState* a, const GroupState* b) { return a->group_id < b->group_id; });
  for (const GroupState* g : groups) {
    for (const auto& [step, p] : g->pending) {
      StallsSnapshot::Step& s = snap.steps.emplace_back();
      s.group_id = g->group_id;
      s.step = step;
      s.first_seen = p.clock.first_seen();
      s.deadline = p.clock.deadline();
      s.last_decided = g->last_decided_step;
      for (const Contribution& c : p.contributions) s.covered.push_back(c.content->ranks);
    }
  }
  return snap;
}

absl::StatusOr<v1::StallsResponse> Coordinator::ObserveStalls(const std::string& job_id) {
  // Snapshot under the lock (per pending step its times and the rank sets
  // of its contributions, shared and immutable); the unions, the missing
  // ranks and their last steps of the group (O(world) per step) are built
  // outside it.
  using JobSnapshot = StallsSnapshot;
  std::vector<JobSnapshot> jobs;
  absl::Time now;
  {
    accord::MutexLock l(&mu_);
    if (!job_id.empty() && !jobs_.contains(job_id)) {
      return absl::NotFoundError(
          absl::StrCat("job \"", job_id,
                       "\" is not running on this coordinator; check the job id with "
                       "`accordctl status`"));
    }
    now = clock_->Now();
    for (const auto& [id, job] : jobs_) {
      if (!job_id.empty() && id != job_id) continue;
      jobs.push_back(StallsSnapshotLocked(job));
    }
  }
  std::sort(jobs.begin(), jobs.end(),
            [](const JobSnapshot& a, const JobSnapshot& b) { return a.job_id < b.job_id; });
  v1::StallsResponse out;
  for (const JobSnapshot& job : jobs) {
    std::vector<RankSet> covered_at;  // per step of job.steps
    covered_at.reserve(job.steps.size());
    for (const StallsSnapshot::Step& p : job.steps) {
      RankSet& covered = covered_at.emplace_back(job.world_size);
      for (const auto& ranks : p.covered) covered.Union(*ranks);
    }
    for (size_t i = 0; i < job.steps.size(); ++i) {
      const StallsSnapshot::Step& p = job.steps[i];
      const RankSet& covered = covered_at[i];
      // A missing rank's last step of this group: the last decided one, or a
      // later pending step of the group that it submitted.
      auto last_step = [&](int r) {
        for (size_t k = job.steps.size(); k-- > i + 1;) {
          if (job.steps[k].group_id == p.group_id && covered_at[k].Contains(r)) {
            return job.steps[k].step;
          }
        }
        return p.last_decided;
      };
      v1::Stall* s = out.add_stalls();
      s->set_job_id(job.job_id);
      s->set_group_id(p.group_id);
      s->set_step(p.step);
      s->set_waiting_ms(absl::ToInt64Milliseconds(now - p.first_seen));
      s->set_deadline_in_ms(absl::ToInt64Milliseconds(p.deadline - now));
      for (int r : covered.Missing()) {
        s->add_missing_ranks(r);
        s->add_missing_last_steps(last_step(r));
      }
      s->set_reported_ranks(covered.Count());
    }
  }
  return out;
}

std::vector<Coordinator::JobGauges> Coordinator::Gauges() {
  accord::MutexLock l(&mu_);
  const absl::Time now = clock_->Now();
  std::vector<JobGauges> out;
  for (const auto& [id, job] : jobs_) {
    JobGauges g;
    g.job_id = id;
    g.connected_nodes = job.members.connected();
    for (const auto& [gid, group] : job.groups) {
      for (const auto& [step, p] : group.pending) {
        if (now - p.clock.first_seen() > options_.deadline / 2) {
          ++g.stalled_groups;
          break;
        }
      }
    }
    out.push_back(std::move(g));
  }
  return out;
}

}  // namespace accord::daemon
