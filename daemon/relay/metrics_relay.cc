#include "daemon/relay/metrics_relay.h"

namespace accord::daemon {

RelayMetrics::RelayMetrics(MetricsRegistry* registry) {
  job_ = &registry->AddGauge("accord_relay_job", "1 for the job this relay serves now.", {"job"});
  sidecars_ = &registry->AddGauge("accord_relay_sidecars", "Sidecars connected to this relay.");
  manifests_in_ = &registry->AddCounter("accord_relay_manifests_in_total",
                                        "Node manifests received from sidecars.");
  batch_repeats_in_ = &registry->AddCounter(
      "accord_relay_batch_repeats_in_total",
      "Sidecar batches received as one batch repeat record (each stands for the sidecar's "
      "previous batch).");
  manifests_up_ = &registry->AddCounter(
      "accord_relay_manifests_up_total",
      "Merged manifests sent to the coordinator, by form (full or repeat).", {"form"});
  batch_repeats_up_ = &registry->AddCounter(
      "accord_relay_batch_repeats_up_total",
      "Upstream batches sent as one batch repeat record (docs/ARCHITECTURE.md, \"Repeat "
      "waves\").");
  merges_reused_ = &registry->AddCounter(
      "accord_relay_merges_reused_total",
      "Steps sent as the group's previous merge because every sidecar repeated its content.");
  decision_batches_ = &registry->AddCounter("accord_relay_decision_batches_total",
                                            "Decision batches fanned out to the sidecars.");
}

void RelayMetrics::Refresh(const RelayStats& stats) {
  accord::MutexLock l(&mu_);
  if (stats.job_id != job_id_) {
    if (!job_id_.empty()) job_->RemoveByFirstLabel(job_id_);
    job_id_ = stats.job_id;
    if (!job_id_.empty()) job_->WithLabels({job_id_}).Set(1);
  }
  sidecars_->Get().Set(stats.nodes);
  manifests_in_->Get().SetTotal(static_cast<double>(stats.node_manifests_in));
  batch_repeats_in_->Get().SetTotal(static_cast<double>(stats.batch_repeats_in));
  manifests_up_->WithLabels({"full"}).SetTotal(static_cast<double>(stats.manifests_up_full));
  manifests_up_->WithLabels({"repeat"}).SetTotal(static_cast<double>(stats.manifests_up_repeat));
  batch_repeats_up_->Get().SetTotal(static_cast<double>(stats.batch_repeats_up));
  merges_reused_->Get().SetTotal(static_cast<double>(stats.merges_reused));
  decision_batches_->Get().SetTotal(static_cast<double>(stats.decision_batches));
}

}  // namespace accord::daemon
