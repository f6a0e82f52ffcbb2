#include "daemon/sidecar/metrics_sidecar.h"

#include <algorithm>

namespace accord::daemon {

SidecarMetrics::SidecarMetrics(MetricsRegistry* registry) {
  connected_ranks_ =
      &registry->AddGauge("accord_connected_ranks", "Ranks connected to their sidecars.", {"job"});
  rank_manifests_ = &registry->AddCounter("accord_sidecar_rank_manifests_total",
                                          "Manifests received from local ranks.", {"job"});
  node_manifests_ = &registry->AddCounter(
      "accord_sidecar_node_manifests_total",
      "Merged node manifests sent to the coordinator, by form (full or repeat).", {"job", "form"});
  decisions_ = &registry->AddCounter("accord_sidecar_decisions_total",
                                     "Decisions received from the coordinator.", {"job"});
  local_decisions_ = &registry->AddCounter(
      "accord_sidecar_local_decisions_total",
      "Steps decided by this sidecar for a single-node job (--local_decisions), by outcome: "
      "made, confirmed by the coordinator, or mismatched (the job failed).",
      {"job", "outcome"});
  rank_streams_ =
      &registry->AddGauge("accord_sidecar_rank_streams", "Rank streams open on this sidecar.");
}

void SidecarMetrics::Refresh(const SidecarStats& stats) {
  accord::MutexLock l(&mu_);
  auto mirror = [&] {
    if (job_.empty()) return;
    rank_manifests_->WithLabels({job_}).SetTotal(
        static_cast<double>(stats.rank_manifests - base_.rank_manifests));
    node_manifests_->WithLabels({job_, "full"})
        .SetTotal(static_cast<double>(stats.node_manifests_full - base_.node_manifests_full));
    node_manifests_->WithLabels({job_, "repeat"})
        .SetTotal(static_cast<double>(stats.node_manifests_repeat - base_.node_manifests_repeat));
    decisions_->WithLabels({job_}).SetTotal(
        static_cast<double>(stats.decisions_in - base_.decisions_in));
    local_decisions_->WithLabels({job_, "made"})
        .SetTotal(static_cast<double>(stats.local_decisions - base_.local_decisions));
    local_decisions_->WithLabels({job_, "confirmed"})
        .SetTotal(static_cast<double>(stats.local_confirmed - base_.local_confirmed));
    local_decisions_->WithLabels({job_, "mismatched"})
        .SetTotal(static_cast<double>(stats.local_mismatches - base_.local_mismatches));
  };
  if (stats.job_id != job_) {
    // What happened since the last scrape belongs to the job that ended
    // (scrapes are far more frequent than job changes).
    // A job that starts after an idle period owns everything since the
    // previous scrape.
    mirror();
    base_ = job_.empty() ? last_ : stats;
    if (!job_.empty()) connected_ranks_->WithLabels({job_}).Set(0);
    job_ = stats.job_id;
    if (!job_.empty()) {
      jobs_.erase(std::remove(jobs_.begin(), jobs_.end(), job_), jobs_.end());
      jobs_.push_back(job_);
      while (static_cast<int>(jobs_.size()) > kKeptJobs) {
        const std::string& old = jobs_.front();
        connected_ranks_->RemoveByFirstLabel(old);
        rank_manifests_->RemoveByFirstLabel(old);
        node_manifests_->RemoveByFirstLabel(old);
        decisions_->RemoveByFirstLabel(old);
        local_decisions_->RemoveByFirstLabel(old);
        jobs_.pop_front();
      }
    }
  }
  rank_streams_->Get().Set(stats.sessions);
  last_ = stats;
  if (job_.empty()) return;
  connected_ranks_->WithLabels({job_}).Set(stats.ranks);
  mirror();
}

}  // namespace accord::daemon
