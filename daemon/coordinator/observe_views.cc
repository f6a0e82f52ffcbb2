// The coordinator's observe side: the read-only views of observe.proto and
// the skip counts, each built from a snapshot of a Job copied under the lock,
// and what is kept of a job after its last node left.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/job_core.h"

namespace accord::daemon {
namespace {

// The status view of a job: copied under the lock (StatusSnapshotOf), built
// into the proto outside it (JobStatusOf).
struct StatusSnapshot {
  struct Node {
    std::string node_id;
    bool connected = false;
    std::vector<int> ranks;
  };
  struct Group {
    std::string group_id;
    int num_params = -1;  // -1: not registered
    int64_t last_decided_step = -1;
    int64_t decisions = 0;
    int64_t cache_hits = 0;
    int64_t cache_misses = 0;
    bool have_last_ok = false;
    DType last_wire = DType::kFloat32;
    int last_num_skipped = 0;
    bool failed = false;
    std::string error;
  };
  std::string job_id;
  int world_size = 0;
  std::vector<Node> nodes;      // by node id
  std::vector<int> rank_owner;  // per rank: index into nodes, -1: none
  std::vector<bool> rank_connected;
  std::vector<int64_t> rank_last_step;
  std::vector<Group> groups;  // by group id
  bool failed = false;
  std::string error;
};

StatusSnapshot::Group GroupStatusOf(const GroupState& g);

StatusSnapshot StatusSnapshotOf(const JobCore& job) {
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

StatusSnapshot::Group GroupStatusOf(const GroupState& g) {
  StatusSnapshot::Group s;
  s.group_id = g.group_id;
  if (!g.registration.empty()) {
    s.num_params = static_cast<int>(g.registration.reference().spec.params.size());
  }
  s.last_decided_step = g.last_decided_step();
  s.decisions = g.counters.decisions;
  s.cache_hits = g.counters.cache_hits;
  s.cache_misses = g.counters.cache_misses;
  s.have_last_ok = g.shape.have_last_ok;
  s.last_wire = g.shape.last_wire;
  s.last_num_skipped = g.shape.last_num_skipped;
  if (g.registration.state() == GroupRegistration::State::kFailed) {
    s.failed = true;
    s.error = g.registration.error().message();
  } else if (g.last_decision() != nullptr && g.last_decision()->has_error()) {
    s.failed = true;
    s.error = g.last_decision()->error().message();
  }
  return s;
}

v1::JobStatus JobStatusOf(const StatusSnapshot& snap) {
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

}  // namespace

void Coordinator::RetireJobLocked(Job& job_engine) {
  JobCore& job = job_engine.core();
  if (options_.retired_jobs <= 0) return;  // RemoveJobLocked uncounts the windows
  RetiredJob r;
  StatusSnapshot snap = StatusSnapshotOf(job);
  // A retired run holds no stream, whatever its nodes held when it ended (a
  // run superseded by a restart, or failed, ends with nodes still connected;
  // their streams are detached from it): nothing of it is connected.
  for (StatusSnapshot::Node& node : snap.nodes) node.connected = false;
  snap.rank_connected.assign(snap.rank_connected.size(), false);
  r.status = JobStatusOf(snap);
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
  while (static_cast<int>(retired_.size()) > options_.retired_jobs) {
    stats_.usage_bytes -= retired_.front().usage_bytes;
    retired_.pop_front();
  }
}

absl::StatusOr<v1::StatusResponse> Coordinator::ObserveStatus(const std::string& job_id) {
  // Snapshot under the lock (plain copies, no protos); the responses are
  // built outside it.
  std::vector<StatusSnapshot> live;
  std::vector<v1::JobStatus> retired;
  {
    accord::MutexLock l(&mu_);
    for (const auto& [id, job] : jobs_) {
      if (job_id.empty() || id == job_id) live.push_back(StatusSnapshotOf(job.core()));
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
      const JobCore& job = it->second.core();
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

namespace {

// What ObserveStalls copies of one job under the lock.
struct StallsSnapshot {
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

StallsSnapshot StallsSnapshotOf(const JobCore& job) {
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
      if (!p.clock.started()) continue;  // nobody waits for it
      StallsSnapshot::Step& s = snap.steps.emplace_back();
      s.group_id = g->group_id;
      s.step = step;
      s.first_seen = p.clock.first_seen();
      s.deadline = p.clock.deadline();
      s.last_decided = g->last_decided_step();
      for (const Contribution& c : p.contributions) s.covered.push_back(c.content->ranks);
    }
  }
  return snap;
}

}  // namespace

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
    now = timer_.Now();
    for (const auto& [id, job] : jobs_) {
      if (!job_id.empty() && id != job_id) continue;
      jobs.push_back(StallsSnapshotOf(job.core()));
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
  const absl::Time now = timer_.Now();
  std::vector<JobGauges> out;
  for (const auto& [id, job_engine] : jobs_) {
    const JobCore& job = job_engine.core();
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

absl::StatusOr<std::vector<int64_t>> Coordinator::RankLastSteps(const std::string& job_id) {
  accord::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job ", job_id));
  const JobCore& job = it->second.core();
  std::vector<int64_t> out(job.world_size);
  for (int r = 0; r < job.world_size; ++r) out[r] = job.members.LastStep(r);
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
    JobCore& job = it->second.core();
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
