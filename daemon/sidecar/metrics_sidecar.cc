#include "daemon/sidecar/metrics_sidecar.h"

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
  decisions_ignored_ = &registry->AddCounter(
      "accord_sidecar_decisions_ignored_total",
      "Decisions received for groups no rank of this node registered (another member set's, "
      "in a batch shared by several nodes).",
      {"job"});
  local_decisions_ = &registry->AddCounter(
      "accord_sidecar_local_decisions_total",
      "Steps decided by this sidecar for a single-node job (--local_decisions), by outcome: "
      "made, confirmed by the coordinator, or mismatched (the job failed).",
      {"job", "outcome"});
  speculated_ = &registry->AddCounter(
      "accord_speculated_reduces_total",
      "Group reduce-scatters this node's ranks issued on a speculative decision (reported by "
      "accord.torch; summed over the node's ranks).",
      {"job"});
  repairs_ = &registry->AddCounter(
      "accord_repairs_total",
      "Speculative reduce-scatters whose real decision differed, repaired exactly on every "
      "rank, by kind: trim (parameters used nowhere set back) or redo (reduce-scattered again); "
      "summed over the node's ranks.",
      {"job", "kind"});
  rank_streams_ =
      &registry->AddGauge("accord_sidecar_rank_streams", "Rank streams open on this sidecar.");
}

void SidecarMetrics::Refresh(const SidecarJobsStats& stats) {
  accord::MutexLock l(&mu_);
  std::set<std::string> shown;
  for (const SidecarStats& j : stats.jobs) {
    const std::string& job = j.job_id;
    shown.insert(job);
    connected_ranks_->WithLabels({job}).Set(j.ranks);
    rank_manifests_->WithLabels({job}).SetTotal(static_cast<double>(j.rank_manifests));
    node_manifests_->WithLabels({job, "full"}).SetTotal(static_cast<double>(j.node_manifests_full));
    node_manifests_->WithLabels({job, "repeat"})
        .SetTotal(static_cast<double>(j.node_manifests_repeat));
    decisions_->WithLabels({job}).SetTotal(static_cast<double>(j.decisions_in));
    decisions_ignored_->WithLabels({job}).SetTotal(static_cast<double>(j.decisions_ignored));
    local_decisions_->WithLabels({job, "made"}).SetTotal(static_cast<double>(j.local_decisions));
    local_decisions_->WithLabels({job, "confirmed"})
        .SetTotal(static_cast<double>(j.local_confirmed));
    local_decisions_->WithLabels({job, "mismatched"})
        .SetTotal(static_cast<double>(j.local_mismatches));
    speculated_->WithLabels({job}).SetTotal(static_cast<double>(j.adapter_speculated));
    repairs_->WithLabels({job, "trim"})
        .SetTotal(static_cast<double>(j.adapter_repaired - j.adapter_redone));
    repairs_->WithLabels({job, "redo"}).SetTotal(static_cast<double>(j.adapter_redone));
  }
  for (const std::string& old : jobs_) {
    if (shown.count(old)) continue;
    connected_ranks_->RemoveByFirstLabel(old);
    rank_manifests_->RemoveByFirstLabel(old);
    node_manifests_->RemoveByFirstLabel(old);
    decisions_->RemoveByFirstLabel(old);
    decisions_ignored_->RemoveByFirstLabel(old);
    local_decisions_->RemoveByFirstLabel(old);
    speculated_->RemoveByFirstLabel(old);
    repairs_->RemoveByFirstLabel(old);
  }
  jobs_ = std::move(shown);
  rank_streams_->Get().Set(stats.sessions);
}

}  // namespace accord::daemon
