// Prometheus metrics of the relay, read from Relay::stats() at scrape time
// (the relay's hot path is not touched). A relay serves one job at a time:
// its counters are totals over the process's life, and
// accord_relay_job{job="..."} names the job served now (absent when none).
//
// Thread-safe.
#ifndef ACCORD_DAEMON_RELAY_METRICS_RELAY_H_
#define ACCORD_DAEMON_RELAY_METRICS_RELAY_H_

#include <string>

#include "absl/base/thread_annotations.h"
#include "core/sync.h"
#include "daemon/relay/relay.h"
#include "observe/metrics.h"

namespace accord::daemon {

class RelayMetrics {
 public:
  explicit RelayMetrics(MetricsRegistry* registry);
  // Mirrors `stats` into the registry; call before rendering.
  void Refresh(const RelayStats& stats);

 private:
  Family<Gauge>* job_;
  Family<Gauge>* sidecars_;
  Family<Counter>* manifests_in_;
  Family<Counter>* batch_repeats_in_;
  Family<Counter>* manifests_up_;
  Family<Counter>* batch_repeats_up_;
  Family<Counter>* merges_reused_;
  Family<Counter>* decision_batches_;
  accord::Mutex mu_;
  std::string job_id_ ABSL_GUARDED_BY(mu_);  // the job labelled in job_
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_RELAY_METRICS_RELAY_H_
