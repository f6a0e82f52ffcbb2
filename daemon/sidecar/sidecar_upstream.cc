// The SidecarJob's upstream side (docs/ARCHITECTURE.md, "The protocol on one
// page"): the node manifests and batch repeats it sends, what a new stream
// resends (through its UpstreamNode), partial-step reports and progress
// answers, and the coordinator's messages: the Welcome, errors,
// registration results and decisions, fanned out to the ranks.
#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "daemon/sidecar/sidecar_job.h"
#include "proto/wire.h"

namespace accord::daemon {

void SidecarJob::NoteStepStarted(absl::Time now, LocalStep& st) {
  st.first_seen = now;
  st.partial_reported = false;
  if (upstream_.report_after > absl::ZeroDuration() && !effects_.TimerArmed()) {
    effects_.ArmTimer(st.first_seen + upstream_.report_after);
  }
}

absl::Time SidecarJob::CheckTimers(absl::Time now) {
  const absl::Time detached = ExpireDetached(now);
  const absl::Time lost = CheckUpstreamLoss(now);
  std::vector<ReleaseCoalescer::Batch> expired;
  const absl::Time held = upstream_.releases.CheckHolds(now, &expired);
  SendBatches(expired);
  return std::min({detached, lost, held, CheckPartialSteps(now)});
}

void SidecarJob::SendCompleted(absl::Time now, const ReleaseCoalescer::Release& release) {
  std::vector<ReleaseCoalescer::Batch> batches;
  const absl::Time due = upstream_.releases.Complete(now, release, scratch_.outgoing, &batches);
  if (due != absl::InfiniteFuture()) effects_.ArmTimer(due);
  SendBatches(batches);
}

void SidecarJob::SendBatches(std::vector<ReleaseCoalescer::Batch>& batches) {
  for (ReleaseCoalescer::Batch& b : batches) SendOutgoing(b);
  batches.clear();
}

void SidecarJob::StartUnanswered(absl::Time now) {
  const absl::Time due = upstream_.loss.Start(now);
  if (due != absl::InfiniteFuture()) effects_.ArmTimer(due);
}

absl::Time SidecarJob::CheckUpstreamLoss(absl::Time now) {
  absl::Time next;
  std::optional<v1::DecisionError> lost =
      upstream_.loss.Check(now, node_.has_job(), node_.job_id(), &next);
  if (lost.has_value()) {
    ACCORD_LOG(ERROR) << lost->message();
    FailRanks(*lost);
  }
  return next;
}

absl::Time SidecarJob::CheckPartialSteps(absl::Time now) {
  absl::Time next = absl::InfiniteFuture();
  if (upstream_.report_after <= absl::ZeroDuration() || node_.sink() == nullptr) return next;
  for (LocalGroup* g : groups_.ordered()) {
    for (LocalStep& st : g->collect.steps) {
      if (st.sent || st.ranks.empty() || st.partial_reported) continue;
      const absl::Time due = st.first_seen + upstream_.report_after;
      if (due > now) {
        next = std::min(next, due);
        continue;
      }
      // Some local ranks submitted this step long ago and the node manifest
      // still waits for the others: tell the coordinator, so that its
      // deadline runs even when no node sends a manifest for the step.
      st.partial_reported = true;
      v1::NodeMessage up = PartialReport(g->group_id, st.step, now - st.first_seen, st.ranks);
      v1::NodeProgress* p = up.mutable_progress();
      for (const auto& [r, rs] : ranks_.connected) {
        p->add_ranks(r);
        p->add_last_steps(rs.SubmittedOf(g->index));
      }
      ACCORD_LOG(WARNING) << "job " << node_.job_id() << " group \"" << g->group_id << "\" step "
                          << st.step << ": " << st.ranks.size() << " of " << g->ranks.size()
                          << " local ranks submitted it "
                          << absl::FormatDuration(now - st.first_seen)
                          << " ago; reporting the partial step to the coordinator";
      node_.Send(std::move(up));
    }
  }
  return next;
}

void SidecarJob::SendBatchRepeat(int64_t step) {
  ++stats_.node_batch_repeats;
  node_.SendBatchRepeat(step);
}

void SidecarJob::SendOutgoing(std::vector<Outgoing>& items) {
  if (items.empty()) return;
  const int64_t step = items[0].step;
  const wire::StreamBatchRecord& previous = node_.previous_batch();
  bool same = node_.batch_repeat() && items.size() == previous.size();
  for (size_t i = 0; same && i < items.size(); ++i) {
    const Outgoing& o = items[i];
    same = o.repeat && o.step == step && previous.Matches(i, o.group->group_id, o.key);
  }
  if (same) {
    SendBatchRepeat(step);
    items.clear();
    return;
  }
  v1::NodeMessage up;
  v1::ManifestBatch* batch = up.mutable_manifests();
  batch->mutable_manifests()->Reserve(static_cast<int>(items.size()));
  for (const Outgoing& o : items) {
    v1::Manifest* m = batch->add_manifests();
    if (o.repeat) {
      m->set_group_id(o.group->group_id);
      m->set_repeat(true);
      m->set_cache_key(o.key);
    } else {
      *m = *o.full;
    }
    m->set_step(o.step);
  }
  items.clear();
  node_.SendNewBatch(std::move(up));
}

void SidecarJob::OnUpstreamConnected(absl::Time now) {
  std::vector<v1::NodeMessage> registrations;
  v1::ManifestBatch inflight;
  for (LocalGroup* g : groups_.ordered()) {
    g->registrations.AppendResend([this](int r) { return ranks_.connected.count(r) != 0; },
                                  &registrations);
    g->inflight.AppendAll(node_, g->members(), &inflight);
    // The coordinator may have lost its cache: the next manifest goes in full.
    g->form.repeat.Forget();
    // ... and its pending steps: partial steps are reported again.
    for (LocalStep& st : g->collect.steps) st.partial_reported = false;
  }
  upstream_.report_after = absl::ZeroDuration();  // until the new stream's Welcome says
  // Held node manifests are among the resends; nothing is held until the
  // Welcome says the deadline.
  upstream_.releases.DropHolds();
  upstream_.releases.SetHoldLimit(absl::ZeroDuration());
  // A new stream: the previous one ended, or this is the first. Unanswered
  // until its Welcome; the loss limit counts while a job is served.
  upstream_.welcomed = false;
  if (node_.has_job()) StartUnanswered(now);
  node_.Connected(std::move(registrations), std::move(inflight));
}

void SidecarJob::HandleCoordinatorMessage(absl::Time now, v1::CoordinatorMessage* message) {
  if (message->has_decisions()) {
    HandleDecisions(message->decisions(), message->mutable_decisions());
    return;
  }
  HandleCoordinatorMessage(now, *message);
}

void SidecarJob::HandleWelcome(absl::Time now, const v1::Welcome& welcome) {
  const std::string before = node_.run_id();
  node_.OnWelcome(welcome);
  if (node_.has_job() && node_.run_id() != before) {
    // The ranks that reconnect learn their run (they name it when they
    // resume); others never see a second Welcome.
    const std::shared_ptr<const v1::RankReply> shared = RankWelcome();
    for (auto& [r, rs] : ranks_.connected) {
      if (rs.reconnects) effects_.SendToSession(rs.session, shared);
    }
  }
  upstream_.welcomed = true;
  upstream_.loss.Answered();
  if (!upstream_.held.empty()) ReleaseHeldRegistrations();
  upstream_.report_after = absl::Milliseconds(welcome.deadline_ms()) / 2;
  upstream_.releases.SetHoldLimit(upstream_.report_after);
  // Steps that began before this stream are checked now.
  if (upstream_.report_after > absl::ZeroDuration()) effects_.ArmTimer(now);
}

void SidecarJob::HandleCoordinatorMessage(absl::Time now, const v1::CoordinatorMessage& message) {
  switch (message.body_case()) {
    case v1::CoordinatorMessage::kWelcome:
      HandleWelcome(now, message.welcome());
      return;
    case v1::CoordinatorMessage::kError: {
      const v1::DecisionError& e = message.error();
      ACCORD_LOG(ERROR) << "coordinator: " << e.message();
      // The job's verdict: steps waiting here are answered first, as when it
      // arrives in a decision.
      if (e.job_failed() && !job_failure_.has_value()) NoteJobFailed(e);
      if (e.job_failed() && e.kind() == v1::JOB_FAILED) {
        // Pushed to every node (docs/MEMBERS.md 2.13): every rank gets it and
        // keeps its stream, so it does not leave, and its key-value waits,
        // which go through this sidecar, end with the run's own words.
        v1::RankReply reply;
        *reply.mutable_error() = e;
        const auto shared = std::make_shared<const v1::RankReply>(std::move(reply));
        for (const auto& [r, rs] : ranks_.connected) effects_.SendToSession(rs.session, shared);
        return;
      }
      std::vector<int> targets;
      if (e.kind() == v1::DUPLICATE_RANK && e.ranks_size() > 0) {
        targets.assign(e.ranks().begin(), e.ranks().end());
      } else {
        for (const auto& [r, rs] : ranks_.connected) targets.push_back(r);
      }
      for (int r : targets) {
        auto it = ranks_.connected.find(r);
        if (it == ranks_.connected.end()) continue;
        SendErrorAndClose(it->second.session, e);
      }
      return;
    }
    case v1::CoordinatorMessage::kRegistration: {
      const v1::RegistrationResult& res = message.registration();
      LocalGroup* g = groups_.Find(res.group_id());
      if (g == nullptr) return;
      // An error about one node registration names its ranks and goes to
      // them only. The group's or the job's failure (a mismatch across ranks,
      // ranks that did not register it within the deadline, the job failed)
      // goes to every rank that registered the group; its ranks are the
      // ranks at fault.
      const v1::ErrorKind kind = res.error().kind();
      const bool group_wide =
          kind == v1::REGISTRATION_MISMATCH || kind == v1::MISSING_RANKS || kind == v1::JOB_FAILED;
      const bool targeted = res.has_error() && !group_wide && res.error().ranks_size() > 0;
      if (!targeted) g->result = res;
      for (int r : g->ranks) {
        if (targeted && std::find(res.error().ranks().begin(), res.error().ranks().end(), r) ==
                            res.error().ranks().end()) {
          continue;
        }
        auto it = ranks_.connected.find(r);
        if (it == ranks_.connected.end() || it->second.got_result[res.group_id()]) continue;
        it->second.got_result[res.group_id()] = true;
        v1::RankReply reply;
        *reply.mutable_registration() = res;
        SendToRank(r, std::move(reply));
      }
      return;
    }
    case v1::CoordinatorMessage::kDecisions:
      HandleDecisions(message.decisions(), nullptr);
      return;
    case v1::CoordinatorMessage::kProgressQuery:
      AnswerProgress(message.progress_query());
      return;
    default:
      return;
  }
}

void SidecarJob::AnswerProgress(const v1::ProgressQuery& query) {
  v1::NodeMessage up;
  v1::NodeProgress* p = up.mutable_progress();
  p->set_group_id(query.group_id());
  p->set_step(query.step());
  // Each rank's last step of the asked group (-1: none, or a group not
  // registered here), never its last step of another group.
  int index = -1;
  if (const LocalGroup* g = groups_.Find(query.group_id()); g != nullptr) {
    index = g->index;
    for (const LocalStep& ls : g->collect.steps) {
      if (ls.step != query.step()) continue;
      for (int r : ls.ranks) p->add_reported(r);
    }
  }
  for (const auto& [r, rs] : ranks_.connected) {
    p->add_ranks(r);
    p->add_last_steps(index < 0 ? -1 : rs.SubmittedOf(index));
  }
  ACCORD_LOG(INFO) << "coordinator asked about group \"" << query.group_id() << "\" step "
                   << query.step() << ": " << p->reported_size() << " of "
                   << ranks_.connected.size() << " local ranks submitted it";
  node_.Send(std::move(up));
}

void SidecarJob::HandleDecisions(const v1::DecisionBatch& batch, v1::DecisionBatch* take,
                                 bool local) {
  // The job's verdict, read before the batch may be moved out below.
  std::optional<v1::DecisionError> verdict;
  if (!local && !job_failure_.has_value()) {
    for (const v1::Decision& d : batch.decisions()) {
      if (d.has_error() && d.error().job_failed()) {
        verdict = d.error();
        break;
      }
    }
  }
  // Pass 1: group state, and per decision which ranks need the full body
  // instead of the coordinator's `same_as_previous`.
  std::vector<RoutedDecision> routed;
  routed.reserve(batch.decisions_size());
  bool uniform = true;  // every connected rank gets every routed decision as is
  v1::ManifestBatch resend;
  for (const v1::Decision& d : batch.decisions()) {
    if (!local) ++stats_.decisions_in;
    LocalGroup* found = groups_.Find(d.group_id());
    if (found == nullptr) {
      // Another member set's group, in a batch shared with other nodes.
      if (!local) ++stats_.decisions_ignored;
      continue;
    }
    LocalGroup& g = *found;
    if (d.has_error() && d.error().resend_full_form() &&
        g.inflight.AppendStep(d.step(), node_, g.members(), &resend)) {
      // A repeat the coordinator could not resolve: resend in full form.
      g.form.repeat.Forget();
      continue;
    }
    if (!local) {
      // Already delivered (decided here): only compared.
      if (ConfirmLocal(g, d)) continue;
      // What the coordinator's next `same_as_previous` stands for, kept
      // when local decisions are on (a new body is rare in the steady state).
      if (d.has_ok() || d.has_error()) g.local.delivered.reset();
      if (d.has_error()) {
        g.local.coordinator_ok_bytes.reset();
      } else if (d.has_ok() && options_.local_decisions) {
        g.local.coordinator_ok_bytes = d.ok().SerializeAsString();
      }
    }
    if (!RecordDecision(g, d, local, routed.emplace_back(RoutedDecision{&d, &g, {}, {}}))) {
      uniform = false;
    }
  }
  DeliverDecisions(batch, take, routed, uniform);
  // Full-form manifests never compact, but the resend is the stream's
  // previous batch from now on.
  if (!local && node_.SendBatch(std::move(resend))) ++stats_.node_batch_repeats;
  if (verdict.has_value()) NoteJobFailed(*verdict);
}

void SidecarJob::NoteJobFailed(const v1::DecisionError& verdict) {
  job_failure_ = verdict;
  // The coordinator answered the steps it held; a step it never saw (its
  // node manifest waits here for a rank, or is on its way) is answered here,
  // the same for every rank that waits for it.
  v1::DecisionBatch answers;
  for (LocalGroup* g : groups_.ordered()) {
    for (const LocalStep& st : g->collect.steps) {
      if (st.step > g->decided.step && !st.ranks.empty()) {
        *answers.add_decisions() = JobFailureAt(*g, st.step);
      }
    }
  }
  if (answers.decisions_size() > 0) HandleDecisions(answers, &answers, /*local=*/true);
}

v1::Decision SidecarJob::JobFailureAt(const LocalGroup& g, int64_t step) const {
  v1::Decision d;
  d.set_group_id(g.group_id);
  d.set_step(step);
  v1::DecisionError* e = d.mutable_error();
  *e = *job_failure_;
  e->set_kind(v1::JOB_FAILED);
  e->set_group_id(g.group_id);
  e->set_step(step);
  return d;
}

bool SidecarJob::RecordDecision(LocalGroup& g, const v1::Decision& d, bool local,
                                RoutedDecision& out) {
  const int64_t previous = g.decided.Record(d);
  g.collect.DropUpTo(d.step());
  // A local decision's node manifest is resent until the coordinator
  // decided it.
  if (!local) g.inflight.DropUpTo(d.step());
  size_t connected = 0;
  for (int r : g.ranks) {
    auto rit = ranks_.connected.find(r);
    if (rit == ranks_.connected.end()) continue;
    ++connected;
    int64_t& last = rit->second.DeliveredSlot(g.index, groups_.size());
    if (d.same_as_previous() && (last != previous || previous < 0) && g.decided.ok.has_value()) {
      if (out.expand.empty()) out.expand_ok = *g.decided.ok;
      out.expand.push_back(r);
    }
    last = std::max(last, d.step());
  }
  return connected == ranks_.connected.size() && out.expand.empty();
}

void SidecarJob::DeliverDecisions(const v1::DecisionBatch& batch, v1::DecisionBatch* take,
                                  const std::vector<RoutedDecision>& routed, bool uniform) {
  // Pass 2: one shared reply when every rank gets the same decisions (the
  // common case), else one reply per rank.
  if (!routed.empty() && uniform) {
    auto reply = std::make_shared<v1::RankReply>();
    v1::DecisionBatch* b = reply->mutable_decisions();
    if (take != nullptr && static_cast<int>(routed.size()) == batch.decisions_size()) {
      b->Swap(take);  // every decision, unchanged: forward the batch itself
    } else {
      b->mutable_decisions()->Reserve(static_cast<int>(routed.size()));
      for (const RoutedDecision& x : routed) *b->add_decisions() = *x.decision;
    }
    std::shared_ptr<const v1::RankReply> shared = std::move(reply);
    for (auto& [r, rs] : ranks_.connected) {
      effects_.SendToSession(rs.session, shared);
    }
  } else if (!routed.empty()) {
    for (auto& [r, rs] : ranks_.connected) {
      v1::RankReply reply;
      for (const RoutedDecision& x : routed) {
        if (!std::binary_search(x.group->ranks.begin(), x.group->ranks.end(), r)) continue;
        v1::Decision* rd = reply.mutable_decisions()->add_decisions();
        *rd = *x.decision;
        if (std::find(x.expand.begin(), x.expand.end(), r) != x.expand.end()) {
          rd->set_same_as_previous(false);
          *rd->mutable_ok() = x.expand_ok;
        }
      }
      if (reply.has_decisions()) SendToRank(r, std::move(reply));
    }
  }
}

}  // namespace accord::daemon
