// Local decisions: a sidecar that holds every member of a group (every rank
// of its job, for a group without members) decides each complete step
// itself, answers its ranks at once and still sends the node manifest
// upstream; the coordinator's decision for the step, when it arrives, must
// be the same or the job fails on this node
// (docs/ARCHITECTURE.md, "Local decisions").
//
// Decide (core/decide.h) is a function of the registration and the merged
// manifest, which the sidecar holds for a single-node job, so the result is
// the coordinator's. What the coordinator alone can say (a missing rank past
// the deadline, a registration mismatch, a run that ended, any error
// decision) still comes from it: a step is decided here only when Decide
// succeeds, the group's registration was accepted, and fewer than
// --local_decision_lag steps of the group wait for confirmation.
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "daemon/common/decision_errors.h"
#include "daemon/sidecar/sidecar_job.h"
#include "proto/wire.h"

namespace accord::daemon {

bool SidecarJob::LocalDecisionAllowed(const LocalGroup& g) const {
  // Every member of the group (every rank of the job when it has none) is
  // connected here and registered it, with one registration the coordinator
  // accepted: g.ranks are connected ranks, each a member (others are
  // refused), distinct and in range.
  const int world = node_.world_size();
  const int members = g.members() != nullptr ? g.members()->count() : world;
  const bool all_here =
      g.members() != nullptr || static_cast<int>(ranks_.connected.size()) == world;
  return options_.local_decisions && !node_.run_id().empty() && world > 0 && all_here &&
         static_cast<int>(g.ranks.size()) == members && g.registrations.size() == 1 &&
         g.result.has_value() && !g.result->has_error();
}

void SidecarJob::DecideLocally(absl::Time now, LocalGroup& g, const LocalStep& st) {
  if (!LocalDecisionAllowed(g) ||
      static_cast<int>(g.local.unconfirmed.size()) >= options_.local_decision_lag) {
    return;
  }
  // Steps of a group are decided in order: every earlier step still
  // without the coordinator's decision must have been decided here.
  if (g.inflight.CountBefore(st.step) != g.local.unconfirmed.size()) return;
  if (g.local.ok_bytes == nullptr || g.local.content_gen != g.form.content_gen) {
    absl::StatusOr<Policy> policy = wire::PolicyFromProto(g.registrations.first().policy());
    if (!policy.ok()) return;
    Manifest merged;
    merged.step = st.step;
    merged.dtypes = st.merged;
    merged.ranks = RankSet(node_.world_size());
    for (int r : st.ranks) merged.ranks.Add(r);
    absl::StatusOr<Decision> decision = Decide(g.spec, node_.world_size(), merged, *policy);
    if (!decision.ok()) return;  // error decisions are the coordinator's to send
    v1::DecisionOk ok;
    wire::DecisionToProto(*decision, &ok);
    g.local.ok_bytes = std::make_shared<const std::string>(ok.SerializeAsString());
    g.local.content_gen = g.form.content_gen;
  }
  v1::Decision* d = scratch_.local_batch.add_decisions();
  d->set_group_id(g.group_id);
  d->set_step(st.step);
  d->set_wait_us(absl::ToInt64Microseconds(now - st.first_seen));
  d->set_local(true);
  if (g.decided.ok.has_value() && g.local.delivered == g.local.ok_bytes) {
    d->set_same_as_previous(true);  // the ranks' last decision of the group
  } else {
    d->mutable_ok()->ParseFromString(*g.local.ok_bytes);
    g.local.delivered = g.local.ok_bytes;
  }
  g.local.unconfirmed.push_back(LocalDecisionState::Unconfirmed{st.step, g.local.ok_bytes});
  ++stats_.local_decisions;
}

void SidecarJob::DeliverLocalDecisions() {
  if (scratch_.local_batch.decisions_size() == 0) return;
  HandleDecisions(scratch_.local_batch, &scratch_.local_batch, /*local=*/true);
  scratch_.local_batch.Clear();
}

bool SidecarJob::ConfirmLocal(LocalGroup& g, const v1::Decision& d) {
  if (g.local.unconfirmed.empty() || d.step() < g.local.unconfirmed.front().step) return false;
  // Decisions come in step order: earlier local steps without one were
  // decided by the coordinator in a batch this one belongs to.
  while (!g.local.unconfirmed.empty() && g.local.unconfirmed.front().step < d.step()) {
    g.local.unconfirmed.pop_front();
  }
  if (g.local.unconfirmed.empty() || g.local.unconfirmed.front().step != d.step()) return false;
  const std::shared_ptr<const std::string> mine = std::move(g.local.unconfirmed.front().ok_bytes);
  g.local.unconfirmed.pop_front();
  g.collect.DropUpTo(d.step());
  g.inflight.DropUpTo(d.step());  // no resend needed any more
  std::string theirs;
  if (d.has_ok()) {
    theirs = d.ok().SerializeAsString();
  } else if (d.same_as_previous() && g.local.coordinator_ok_bytes.has_value()) {
    theirs = *g.local.coordinator_ok_bytes;
  }
  if (!d.has_error() && !theirs.empty() && theirs == *mine) {
    g.local.coordinator_ok_bytes = std::move(theirs);
    ++stats_.local_confirmed;
    return true;
  }
  ++stats_.local_mismatches;
  v1::DecisionError e;
  if (d.has_error()) {
    // The coordinator refused a step this node's ranks already applied: its
    // own error, for every rank.
    e = d.error();
  } else {
    // A broken invariant of accord's own (Decide is deterministic): INTERNAL.
    e = ErrorFromStatus(
        v1::JOB_FAILED,
        absl::InternalError(absl::StrCat(
            "job ", node_.job_id(), " group \"", g.group_id, "\" step ", d.step(), ": node \"",
            options_.node_id,
            "\" decided the step locally (--local_decisions) but the "
            "coordinator decided otherwise; the ranks may have reduced differently, so the job "
            "is failed. Report this as a bug, and run the sidecar with --local_decisions=false "
            "meanwhile")));
    e.set_job_id(node_.job_id());
    e.set_group_id(g.group_id);
    e.set_step(d.step());
  }
  ACCORD_LOG(ERROR) << e.message();
  FailRanks(e);
  return true;
}

void SidecarJob::FailRanks(const v1::DecisionError& e) {
  for (auto& [r, rs] : ranks_.connected) {
    SendErrorAndClose(rs.session, e);
  }
}

}  // namespace accord::daemon
