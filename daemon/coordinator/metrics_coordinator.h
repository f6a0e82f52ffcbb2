// Prometheus metrics and the structured event log of the coordinator, fed by
// the logic's observer hooks (observe_hooks.h). Metric names are the ones
// deploy/README.md lists and the Grafana dashboard uses.
//
// Hot-path updates (per manifest, per decision) go to counters looked up once
// per job and group, so they are a few atomic adds under the coordinator's
// lock. Gauges, and the opt-in per-parameter skip counters, are read from the
// Coordinator at scrape time (Refresh). Series of a job that ended are kept
// for `series_grace` (counters hold their final values; gauges drop to 0),
// then removed, unless the job id came back (a new run) meanwhile; so the
// number of series is bounded by the live jobs plus those that ended within
// the grace (see docs/ARCHITECTURE.md, "Bounds").
//
// Thread-safe.
#ifndef ACCORD_DAEMON_COORDINATOR_METRICS_COORDINATOR_H_
#define ACCORD_DAEMON_COORDINATOR_METRICS_COORDINATOR_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "core/sync.h"
#include "daemon/common/clock.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/observe_hooks.h"
#include "observe/event_log.h"
#include "observe/metrics.h"

namespace accord::daemon {

struct CoordinatorMetricsOptions {
  // accord_param_skips_total{job,group,param,rank}: one series per parameter
  // and rank, so off by default (--param_skip_metrics).
  bool param_skip_metrics = false;
  EventLog* event_log = nullptr;  // not owned; null: no event log
  // How long a job's series outlive its last run (--metrics_series_grace).
  absl::Duration series_grace = absl::Minutes(10);
  Clock* clock = nullptr;  // not owned; null: the real clock
};

class CoordinatorMetrics final : public CoordinatorObserver {
 public:
  CoordinatorMetrics(MetricsRegistry* registry, CoordinatorMetricsOptions options);

  std::unique_ptr<JobObserver> ForJob(const std::string& job_id, int world_size) override;
  void OnEvent(const ObserveEvent& event) override;

  // Reads gauges (and per-parameter skips when enabled) from `coordinator`;
  // call before rendering the registry.
  void Refresh(Coordinator& coordinator);

  // Removes the series of jobs that ended at least series_grace ago (Refresh
  // and ForJob call it too).
  void PruneEndedJobs();
  // Jobs whose series are kept (live, or ended within the grace).
  size_t NumJobsWithSeries();

  // The event as one event-log record (type and fields); for tests.
  static std::pair<std::string, JsonObject> EventRecord(const ObserveEvent& event);

  struct Families {
    Family<Counter>* decisions;
    Family<Counter>* zero_fills;
    Family<Counter>* skips;
    Family<Counter>* param_skips;
    Family<Histogram>* wait;
    Family<Counter>* cache_hits;
    Family<Counter>* cache_misses;
    Family<Counter>* missing_rank_events;
    Family<Counter>* errors;
    Family<Counter>* stalls;
    Family<Gauge>* connected_sidecars;
    Family<Gauge>* stalled_groups;
  };

 private:
  void NoteGroup(const std::string& job_id, const std::string& group_id);
  void JobObserverGone(const std::string& job_id);
  void PruneEndedJobsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CoordinatorMetricsOptions options_;
  Families f_;
  accord::Mutex mu_;
  std::set<std::string> jobs_seen_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<std::string, std::string>> groups_ ABSL_GUARDED_BY(mu_);  // (job, group)
  Clock* const clock_;
  // Live JobMetrics per job id, and when each job without one ended.
  std::map<std::string, int> live_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, absl::Time> ended_ ABSL_GUARDED_BY(mu_);

  friend class JobMetrics;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_METRICS_COORDINATOR_H_
