#include "daemon/coordinator/metrics_coordinator.h"

#include <map>
#include <vector>

#include "absl/strings/str_cat.h"

namespace accord::daemon {

namespace {

class GroupMetrics final : public GroupObserver {
 public:
  GroupMetrics(Counter* decisions, Counter* zero_fills, Counter* skips, Histogram* wait)
      : decisions_(decisions), zero_fills_(zero_fills), skips_(skips), wait_(wait) {}

  void OnDecision(const DecisionSummary& d) override {
    decisions_->Increment();
    if (d.ok) {
      if (d.zero_fills > 0) zero_fills_->Increment(static_cast<double>(d.zero_fills));
      if (d.skipped > 0) skips_->Increment(d.skipped);
    }
    wait_->Observe(absl::ToDoubleSeconds(d.wait));
  }

 private:
  Counter* const decisions_;
  Counter* const zero_fills_;
  Counter* const skips_;
  Histogram* const wait_;
};

}  // namespace

class JobMetrics final : public JobObserver {
 public:
  JobMetrics(CoordinatorMetrics* parent, std::string job_id)
      : parent_(parent),
        job_id_(std::move(job_id)),
        hits_(&parent->f_.cache_hits->WithLabels({job_id_})),
        misses_(&parent->f_.cache_misses->WithLabels({job_id_})),
        wait_(&parent->f_.wait->WithLabels({job_id_})) {}
  ~JobMetrics() override { parent_->JobObserverGone(job_id_); }

  void OnManifests(bool cache_hit, int64_t count) override {
    (cache_hit ? hits_ : misses_)->Increment(static_cast<double>(count));
  }

  std::unique_ptr<GroupObserver> ForGroup(const std::string& group_id) override {
    parent_->NoteGroup(job_id_, group_id);
    const CoordinatorMetrics::Families& f = parent_->f_;
    return std::make_unique<GroupMetrics>(&f.decisions->WithLabels({job_id_, group_id}),
                                          &f.zero_fills->WithLabels({job_id_, group_id}),
                                          &f.skips->WithLabels({job_id_, group_id}), wait_);
  }

 private:
  CoordinatorMetrics* const parent_;
  const std::string job_id_;
  Counter* const hits_;
  Counter* const misses_;
  Histogram* const wait_;
};

CoordinatorMetrics::CoordinatorMetrics(MetricsRegistry* registry, CoordinatorMetricsOptions options)
    : options_(options), clock_(options.clock != nullptr ? options.clock : RealClock::Get()) {
  MetricsRegistry& r = *registry;
  f_.decisions = &r.AddCounter("accord_decisions_total", "Decisions made (one per group and step).",
                               {"job", "group"});
  f_.zero_fills =
      &r.AddCounter("accord_zero_fills_total",
                    "Parameter-rank zero-fills: included parameters a rank had no gradient for.",
                    {"job", "group"});
  f_.skips = &r.AddCounter("accord_skips_total",
                           "Parameters left out of the reduce-scatter (used on no rank), summed "
                           "over decided steps.",
                           {"job", "group"});
  f_.param_skips =
      &r.AddCounter("accord_param_skips_total",
                    "Steps at which a rank had no gradient for a parameter (--param_skip_metrics).",
                    {"job", "group", "param", "rank"});
  f_.wait = &r.AddHistogram("accord_negotiation_wait_seconds",
                            "Time from a group step's first manifest to its decision.", {"job"},
                            MetricsRegistry::LatencyBuckets());
  f_.cache_hits = &r.AddCounter("accord_cache_hits_total",
                                "Node manifests in repeat form, answered from the cache.", {"job"});
  f_.cache_misses = &r.AddCounter("accord_cache_misses_total",
                                  "Node manifests in full form (parsed afresh).", {"job"});
  f_.missing_rank_events =
      &r.AddCounter("accord_missing_rank_events_total",
                    "Ranks that had not reported when a group step's deadline passed.", {"job"});
  f_.errors =
      &r.AddCounter("accord_errors_total", "Errors sent to nodes, by kind.", {"job", "kind"});
  f_.stalls = &r.AddCounter("accord_stalls_total",
                            "Group steps that waited longer than half their deadline.", {"job"});
  f_.connected_sidecars =
      &r.AddGauge("accord_connected_sidecars", "Sidecars connected to the coordinator.", {"job"});
  f_.stalled_groups =
      &r.AddGauge("accord_stalled_groups",
                  "Groups with a step waiting longer than half the deadline.", {"job"});
}

std::unique_ptr<JobObserver> CoordinatorMetrics::ForJob(const std::string& job_id, int world_size) {
  // The JobMetrics takes its series under mu_, so a prune never removes
  // series a live observer points at.
  accord::MutexLock l(&mu_);
  PruneEndedJobsLocked();
  jobs_seen_.insert(job_id);
  ++live_[job_id];
  ended_.erase(job_id);
  return std::make_unique<JobMetrics>(this, job_id);
}

void CoordinatorMetrics::JobObserverGone(const std::string& job_id) {
  accord::MutexLock l(&mu_);
  auto it = live_.find(job_id);
  if (it == live_.end() || --it->second > 0) return;
  live_.erase(it);
  ended_[job_id] = clock_->Now();
}

void CoordinatorMetrics::PruneEndedJobs() {
  accord::MutexLock l(&mu_);
  PruneEndedJobsLocked();
}

void CoordinatorMetrics::PruneEndedJobsLocked() {
  const absl::Time now = clock_->Now();
  for (auto it = ended_.begin(); it != ended_.end();) {
    const std::string& job = it->first;
    if (now - it->second < options_.series_grace || live_.contains(job)) {
      ++it;
      continue;
    }
    f_.decisions->RemoveByFirstLabel(job);
    f_.zero_fills->RemoveByFirstLabel(job);
    f_.skips->RemoveByFirstLabel(job);
    f_.param_skips->RemoveByFirstLabel(job);
    f_.wait->RemoveByFirstLabel(job);
    f_.cache_hits->RemoveByFirstLabel(job);
    f_.cache_misses->RemoveByFirstLabel(job);
    f_.missing_rank_events->RemoveByFirstLabel(job);
    f_.errors->RemoveByFirstLabel(job);
    f_.stalls->RemoveByFirstLabel(job);
    f_.connected_sidecars->RemoveByFirstLabel(job);
    f_.stalled_groups->RemoveByFirstLabel(job);
    jobs_seen_.erase(job);
    for (auto g = groups_.lower_bound({job, ""}); g != groups_.end() && g->first == job;) {
      g = groups_.erase(g);
    }
    it = ended_.erase(it);
  }
}

size_t CoordinatorMetrics::NumJobsWithSeries() {
  accord::MutexLock l(&mu_);
  return jobs_seen_.size();
}

void CoordinatorMetrics::NoteGroup(const std::string& job_id, const std::string& group_id) {
  accord::MutexLock l(&mu_);
  groups_.emplace(job_id, group_id);
}

std::pair<std::string, JsonObject> CoordinatorMetrics::EventRecord(const ObserveEvent& e) {
  using Type = ObserveEvent::Type;
  JsonObject o;
  o.Add("job", e.job_id);
  auto add_ranks = [&] {
    o.Add("ranks", e.ranks);
    if (!e.last_steps.empty()) {
      std::string list = "[";
      for (size_t i = 0; i < e.last_steps.size(); ++i) {
        absl::StrAppend(&list, i ? "," : "", e.last_steps[i]);
      }
      o.AddRaw("last_steps", list + "]");
    }
  };
  switch (e.type) {
    case Type::kDecisionChanged: {
      o.Add("group", e.group_id).Add("step", e.step).Add("wire", e.wire);
      o.Add("included", e.included).Add("skipped", e.skipped);
      std::string names = "[";
      for (size_t i = 0; i < e.skipped_names.size(); ++i) {
        absl::StrAppend(&names, i ? "," : "", "\"", JsonEscape(e.skipped_names[i]), "\"");
      }
      o.AddRaw("skipped_params", names + "]");
      o.Add("skipped_params_truncated", e.skipped > static_cast<int>(e.skipped_names.size()));
      return {"decision_changed", o};
    }
    case Type::kError:
      if (!e.group_id.empty()) o.Add("group", e.group_id);
      if (e.step >= 0) o.Add("step", e.step);
      o.Add("kind", v1::ErrorKind_Name(e.kind)).Add("message", e.message);
      add_ranks();
      return {"error", o};
    case Type::kStall:
      o.Add("group", e.group_id).Add("step", e.step).Add("waiting_ms", e.waiting_ms);
      o.Add("deadline_in_ms", e.deadline_in_ms);
      add_ranks();
      return {"stall", o};
    case Type::kDeadlineFailure:
      o.Add("group", e.group_id).Add("step", e.step).Add("waiting_ms", e.waiting_ms);
      o.Add("message", e.message);
      add_ranks();
      return {"deadline_failure", o};
    case Type::kNodeConnected:
    case Type::kNodeDisconnected:
      o.Add("node", e.node_id).Add("ranks", e.ranks).Add("connected_nodes", e.connected_nodes);
      return {e.type == Type::kNodeConnected ? "node_connected" : "node_disconnected", o};
  }
  return {"unknown", o};
}

void CoordinatorMetrics::OnEvent(const ObserveEvent& e) {
  if (!e.job_id.empty()) {
    // An event of a job without a live run (e.g. a refused hello) creates
    // series too: they age out like an ended job's.
    accord::MutexLock l(&mu_);
    if (!live_.contains(e.job_id) && !ended_.contains(e.job_id)) {
      jobs_seen_.insert(e.job_id);
      ended_[e.job_id] = clock_->Now();
    }
  }
  switch (e.type) {
    case ObserveEvent::Type::kError:
      f_.errors->WithLabels({e.job_id, v1::ErrorKind_Name(e.kind)}).Increment();
      break;
    case ObserveEvent::Type::kDeadlineFailure:
      f_.missing_rank_events->WithLabels({e.job_id}).Increment(static_cast<double>(e.ranks.size()));
      break;
    case ObserveEvent::Type::kStall:
      f_.stalls->WithLabels({e.job_id}).Increment();
      break;
    default:
      break;
  }
  if (options_.event_log != nullptr) {
    auto [type, fields] = EventRecord(e);
    options_.event_log->Write(type, fields);
  }
}

void CoordinatorMetrics::Refresh(Coordinator& coordinator) {
  PruneEndedJobs();
  const std::vector<Coordinator::JobGauges> gauges = coordinator.Gauges();
  std::set<std::pair<std::string, std::string>> groups;
  std::map<std::string, const Coordinator::JobGauges*> live;
  for (const auto& g : gauges) live[g.job_id] = &g;
  {
    // Under mu_, so a concurrent prune cannot be undone by a late Set.
    accord::MutexLock l(&mu_);
    if (options_.param_skip_metrics) groups = groups_;
    for (const std::string& job : jobs_seen_) {
      auto it = live.find(job);
      f_.connected_sidecars->WithLabels({job}).Set(it == live.end() ? 0
                                                                    : it->second->connected_nodes);
      f_.stalled_groups->WithLabels({job}).Set(it == live.end() ? 0 : it->second->stalled_groups);
    }
  }
  std::vector<std::pair<std::string, std::string>> gone;
  for (const auto& [job, group] : groups) {
    absl::StatusOr<SkipMatrix> m = coordinator.SkipCounts(job, group);
    if (!m.ok()) {
      if (!live.contains(job)) gone.emplace_back(job, group);
      continue;
    }
    for (const auto& [rank, row] : m->skips) {
      const std::string rank_label = absl::StrCat(rank);
      for (size_t i = 0; i < row.size() && i < m->param_names.size(); ++i) {
        f_.param_skips->WithLabels({job, group, m->param_names[i], rank_label})
            .SetTotal(static_cast<double>(row[i]));
      }
    }
  }
  if (!gone.empty()) {
    accord::MutexLock l(&mu_);
    for (const auto& g : gone) groups_.erase(g);
  }
}

}  // namespace accord::daemon
