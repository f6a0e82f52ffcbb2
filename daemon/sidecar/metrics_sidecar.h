// Prometheus metrics of the sidecar, read from SidecarJobs::stats() at scrape
// time (the sidecar's hot path is not touched). Counters carry the job id:
// one series per job served now (several at once) and per job among the
// last SidecarJobs::kEndedJobsKept that ended, with their final values; a
// job id's counters add up over its launches on this node. Older jobs'
// series are removed, so a node serving many short jobs does not grow its
// registry.
//
// Thread-safe.
#ifndef ACCORD_DAEMON_SIDECAR_METRICS_SIDECAR_H_
#define ACCORD_DAEMON_SIDECAR_METRICS_SIDECAR_H_

#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "core/sync.h"
#include "daemon/sidecar/sidecar_jobs.h"
#include "observe/metrics.h"

namespace accord::daemon {

class SidecarMetrics {
 public:
  explicit SidecarMetrics(MetricsRegistry* registry);
  // Mirrors `stats` into the registry; call before rendering.
  void Refresh(const SidecarJobsStats& stats);

 private:
  Family<Gauge>* connected_ranks_;
  Family<Counter>* rank_manifests_;
  Family<Counter>* node_manifests_;
  Family<Counter>* decisions_;
  Family<Counter>* decisions_ignored_;
  Family<Counter>* local_decisions_;
  Family<Counter>* speculated_;
  Family<Counter>* repairs_;
  Family<Gauge>* rank_streams_;
  accord::Mutex mu_;
  std::set<std::string> jobs_ ABSL_GUARDED_BY(mu_);  // with series
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_SIDECAR_METRICS_SIDECAR_H_
