// Prometheus metrics of the sidecar, read from Sidecar::stats() at scrape
// time (the sidecar's hot path is not touched). Counters carry the job
// served; when the sidecar moves to another job, that job's series start
// from zero and the previous job's keep their final values. Only the series
// of the last kKeptJobs jobs are kept (older ones are removed), so a node
// serving many short jobs does not grow its registry.
//
// Thread-safe.
#ifndef ACCORD_DAEMON_SIDECAR_METRICS_SIDECAR_H_
#define ACCORD_DAEMON_SIDECAR_METRICS_SIDECAR_H_

#include <deque>
#include <string>

#include "absl/base/thread_annotations.h"
#include "core/sync.h"
#include "daemon/sidecar/sidecar.h"
#include "observe/metrics.h"

namespace accord::daemon {

class SidecarMetrics {
 public:
  explicit SidecarMetrics(MetricsRegistry* registry);
  // Mirrors `stats` into the registry; call before rendering.
  void Refresh(const SidecarStats& stats);

  static constexpr int kKeptJobs = 8;

 private:
  Family<Gauge>* connected_ranks_;
  Family<Counter>* rank_manifests_;
  Family<Counter>* node_manifests_;
  Family<Counter>* decisions_;
  Family<Counter>* local_decisions_;
  Family<Gauge>* rank_streams_;
  accord::Mutex mu_;
  std::deque<std::string> jobs_ ABSL_GUARDED_BY(mu_);  // with series, oldest first
  std::string job_ ABSL_GUARDED_BY(mu_);
  SidecarStats base_ ABSL_GUARDED_BY(mu_);  // totals when `job_` began
  SidecarStats last_ ABSL_GUARDED_BY(mu_);  // totals at the previous Refresh
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_SIDECAR_METRICS_SIDECAR_H_
