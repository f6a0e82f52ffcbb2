#include "daemon/coordinator/job_core.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/log.h"
#include "daemon/coordinator/located_errors.h"

namespace accord::daemon {

using located::Error;

void JobEffects::SendError(NodeSink* sink, v1::DecisionError error) {
  NoteError(error);
  v1::CoordinatorMessage reply;
  *reply.mutable_error() = std::move(error);
  Send(sink, std::move(reply));
}

void JobEffects::SendRegistrationError(NodeSink* sink, const std::string& group_id,
                                       v1::DecisionError error) {
  NoteError(error);
  v1::CoordinatorMessage reply;
  reply.mutable_registration()->set_group_id(group_id);
  *reply.mutable_registration()->mutable_error() = std::move(error);
  Send(sink, std::move(reply));
}

void JobEffects::SendDecisionError(NodeSink* sink, absl::string_view group_id, int64_t step,
                                   v1::DecisionError error) {
  NoteError(error);
  v1::Decision* d = ReplyBatch(sink)->add_decisions();
  d->set_group_id(std::string(group_id));
  d->set_step(step);
  *d->mutable_error() = std::move(error);
}

namespace {

// The groups of `job` that `pick` selects, in group id order, so every
// coordinator sends the same message.
template <typename Pick>
std::vector<GroupState*> GroupsInOrder(JobCore& job, Pick pick) {
  std::vector<GroupState*> out;
  for (auto& [gid, g] : job.groups) {
    if (pick(g)) out.push_back(&g);
  }
  std::sort(out.begin(), out.end(),
            [](const GroupState* a, const GroupState* b) { return a->group_id < b->group_id; });
  return out;
}

}  // namespace

void JobCore::Fail(GroupState* culprit, int64_t culprit_step, v1::DecisionError error,
                   JobEffects& fx) {
  ACCORD_LOG(ERROR) << error.message();
  error.set_job_failed(true);
  state = JobState::kFailed;
  failure = error;
  fx.NoteError(error);
  // The run's key-value entries (bootstrap keys) are of no use any more:
  // dropped now. Keys set after the failure (e.g. a coordinated shutdown) go
  // to a fresh scope, which the run's end drops; a late drop of the old
  // scope can never take them.
  fx.RunFailed(error);
  v1::DecisionBatch& batch = fx.Decisions();
  for (GroupState* g :
       GroupsInOrder(*this, [](const GroupState& g) { return !g.pending.empty(); })) {
    for (auto& [step, p] : g->pending) {
      if (!p.clock.started()) continue;  // its nodes hold its decision
      v1::Decision* d = batch.add_decisions();
      d->set_group_id(g->group_id);
      d->set_step(step);
      *d->mutable_error() = error;
      if (g != culprit || step != culprit_step) d->mutable_error()->set_kind(v1::JOB_FAILED);
    }
    g->pending.clear();
  }
  // Registrations still collecting can never complete now: every rank that
  // registered one (and any that registers it later) gets the failure, in
  // group id order.
  for (GroupState* g : GroupsInOrder(*this, [](const GroupState& g) {
         return g.registration.state() == GroupRegistration::State::kCollecting;
       })) {
    v1::DecisionError e = error;
    if (g != culprit || culprit_step != -1) e.set_kind(v1::JOB_FAILED);
    g->registration.Fail(e);
    v1::CoordinatorMessage msg;
    msg.mutable_registration()->set_group_id(g->group_id);
    *msg.mutable_registration()->mutable_error() = std::move(e);
    fx.Broadcast(std::move(msg));
  }
  // The verdict to every node, after the answers above: ranks that wait for
  // nothing (another member set's, or between steps) learn it too
  // (docs/MEMBERS.md 2.13).
  v1::CoordinatorMessage verdict;
  *verdict.mutable_error() = std::move(error);
  verdict.mutable_error()->set_kind(v1::JOB_FAILED);
  fx.BroadcastLast(std::move(verdict));
}

void JobCore::SendToRegistrants(const GroupState& g, v1::CoordinatorMessage msg,
                                JobEffects& fx) const {
  const GroupRegistration& reg = g.registration;
  if (reg.members() == nullptr) {
    fx.Broadcast(std::move(msg));
    return;
  }
  RankSet scope = reg.members()->rank_set();
  for (int i = 0; !reg.empty() && i < reg.variant_count(); ++i) scope.Union(reg.variant(i).ranks);
  for (const auto& [id, node] : members.nodes()) {
    if (!node.connected()) continue;
    const std::vector<uint64_t>& words = node.rank_set->words();
    bool serves = false;
    for (int w = node.word_lo; w < node.word_hi && !serves; ++w) {
      serves = (words[w] & scope.words()[w]) != 0;
    }
    if (serves) fx.Send(node.sink, msg);
  }
}

StepFacts::StepFacts(const JobCore& job, const GroupState& g, const PendingStep& at)
    : job_(job),
      at_(at),
      members_(g.members()),
      last_decided_(g.last_decided_step()),
      submitted_(job.world_size) {
  auto submitted = [&](const PendingStep& p) {
    RankSet set(job.world_size);
    for (const Contribution& c : p.contributions) set.Union(*c.content->ranks);
    for (int r : p.clock.reported()) {
      if (r >= 0 && r < job.world_size) set.Add(r);
    }
    return set;
  };
  submitted_ = submitted(at);
  for (auto it = g.pending.rbegin(); it != g.pending.rend() && it->first > last_decided_; ++it) {
    if (&it->second == &at) continue;
    later_.emplace_back(it->first, submitted(it->second));
  }
}

int64_t StepFacts::LastStep(int rank) const {
  // Every rank submitted every decided step of the group.
  int64_t last = last_decided_;
  for (const auto& [step, ranks] : later_) {
    if (step > last && ranks.Contains(rank)) {
      last = step;
      break;  // newest first
    }
  }
  // Its sidecar's answer about this group (it holds steps not sent yet).
  for (const auto& [r, step] : at_.clock.last_steps()) {
    if (r == rank) last = std::max(last, step);
  }
  return last;
}

StepFacts::Missing StepFacts::AtFault() const {
  Missing out;
  for (int r : submitted_.Missing()) {
    if (members_ != nullptr && !members_->Contains(r)) continue;  // never waited for
    (job_.members.Gone(r) ? out.named : out.waiting).push_back(r);
  }
  if (out.named.empty()) std::swap(out.named, out.waiting);
  return out;
}

v1::DecisionError JobCore::MissingRanksError(const GroupState& g, int64_t step,
                                             const PendingStep& p, absl::string_view why) const {
  const StepFacts facts(*this, g, p);
  const StepFacts::Missing missing = facts.AtFault();
  std::vector<std::string> parts;
  v1::DecisionError err;
  for (int r : missing.named) {
    const int64_t last = facts.LastStep(r);
    err.add_ranks(r);
    err.add_last_steps(last);
    if (parts.size() < 32) {
      const NodeState* owner = members.OwnerOf(r);
      std::string node = owner ? owner->node_id : std::string();
      for (const auto& [pr, pn] : p.clock.rank_nodes()) {
        if (pr == r) node = pn;  // the sidecar behind a relay
      }
      parts.push_back(
          absl::StrCat("rank ", r, " (last step ", last, ", node ",
                       node.empty() ? std::string("unknown") : absl::StrCat("\"", node, "\""),
                       // Only a rank known to have submitted a later step of
                       // this group skipped this one (e.g. its step counter
                       // moved on across a restart): it will never submit it.
                       last > step ? ", past this step: it skipped it" : "", ")"));
    }
  }
  if (missing.named.size() > parts.size()) {
    parts.push_back(absl::StrCat("and ", missing.named.size() - parts.size(), " more"));
  }
  std::vector<int> submitted;
  for (int r = 0; r < world_size; ++r) {
    if (facts.Submitted(r)) submitted.push_back(r);
  }
  std::string msg = absl::StrCat(
      "job ", job_id, " group \"", g.group_id, "\" step ", step, ": ", why, "; missing ranks ",
      FormatRanks(missing.named), ": ", absl::StrJoin(parts, ", "), "; ",
      submitted.empty() ? std::string("no rank submitted it")
                        : absl::StrCat("ranks ", FormatRanks(submitted), " submitted it"),
      missing.waiting.empty()
          ? std::string()
          : absl::StrCat("; not yet heard from ranks ", FormatRanks(missing.waiting),
                         ", which are still connected"),
      ". Check the missing ranks' processes and their sidecars' logs; the job is failed");
  v1::DecisionError e = Error(v1::MISSING_RANKS, std::move(msg), job_id, g.group_id, step);
  *e.mutable_ranks() = err.ranks();
  *e.mutable_last_steps() = err.last_steps();
  return e;
}

std::string JobCore::LeftWhy(int rank, absl::string_view node_id, absl::string_view cause) {
  if (!cause.empty()) return absl::StrCat("rank ", rank, " left (", cause, ")");
  return absl::StrCat("rank ", rank, " left (its stream to the sidecar on node \"", node_id,
                      "\" ended)");
}

bool JobCore::FailIfALeftRankMisses(GroupState& g, int64_t step, const PendingStep& p,
                                    JobEffects& fx) {
  if (failed() || !p.clock.started()) return false;  // not started: nobody waits for it
  const int r = members.LeftBefore(step, g.members());
  if (r < 0) return false;
  const NodeState* owner = members.OwnerOf(r);
  Fail(&g, step,
       MissingRanksError(g, step, p,
                         LeftWhy(r, owner ? owner->node_id : "unknown", members.LeftCause(r))),
       fx);
  return true;
}

std::pair<std::map<int64_t, PendingStep>::iterator, absl::Time> JobCore::StartStep(
    GroupState& g, int64_t step, absl::Time first_seen) const {
  auto pit = g.pending.try_emplace(step, first_seen, options.deadline).first;
  PendingStep& p = pit->second;
  p.contributions.reserve(members.connected());
  if (!p.clock.started()) return {pit, absl::InfiniteFuture()};
  return {pit, StartClock(p, first_seen)};
}

absl::Time JobCore::StartClock(PendingStep& p, absl::Time first_seen) const {
  p.clock = StepDeadline(first_seen, options.deadline);
  // With an observer the timer also wakes at half the deadline (stall event).
  absl::Time wake = observing() ? p.clock.stall_at() : p.clock.deadline();
  // A node gone (sidecar restarted?) may already be past its grace.
  if (!members.all_connected()) {
    for (const auto& [node_id, node] : members.nodes()) {
      if (node.lost()) wake = std::min(wake, node.disconnected_at + options.node_reconnect_grace);
    }
  }
  return wake;
}

void JobCore::PruneContributions(const GroupState& g, NodeGroupState& ng, JobEffects& fx) {
  const int64_t pruned = ng.contents.Prune(g.last_decided_step());
  fx.stats().retained_contents -= pruned;
  retained -= pruned;
}

namespace {

// Zero-fills: (included parameter, rank) pairs without a local gradient.
// O(nodes x params).
int64_t ZeroFills(const PendingStep& p, const Decision& decided) {
  int64_t zero_fills = 0;
  for (const Contribution& c : p.contributions) {
    const Content& content = *c.content;
    const size_t n = std::min(content.dtypes.size(), decided.included.size());
    for (size_t i = 0; i < n; ++i) {
      if (!decided.included[i]) continue;
      if (content.dtypes[i] == 0) {
        zero_fills += content.rank_count;
        continue;
      }
      for (const RankDetail& r : content.detail) zero_fills += r.used[i] ? 0 : 1;
    }
  }
  return zero_fills;
}

// A computed decision's shape (the group's DecisionShape); returns the
// decision-changed event when the shape changed and an observer is set.
std::optional<ObserveEvent> NoteDecided(const JobCore& job, GroupState& g, int64_t step,
                                        const PendingStep& p, const Decision& decided) {
  DecisionShape& shape = g.shape;
  // Only the metrics need the zero-fills.
  const int64_t zero_fills = g.observer != nullptr ? ZeroFills(p, decided) : 0;
  int skipped = 0;
  for (bool in : decided.included) skipped += in ? 0 : 1;
  const bool changed = !shape.have_last_ok || shape.last_wire != decided.wire_dtype ||
                       shape.last_included != decided.included;
  shape.have_last_ok = true;
  shape.last_wire = decided.wire_dtype;
  shape.last_included = decided.included;
  shape.last_num_skipped = skipped;
  shape.last_zero_fills = zero_fills;
  if (!changed || !job.observing()) return std::nullopt;
  ObserveEvent e;
  e.type = ObserveEvent::Type::kDecisionChanged;
  e.job_id = job.job_id;
  e.group_id = g.group_id;
  e.step = step;
  e.wire = std::string(DTypeName(decided.wire_dtype));
  e.included = static_cast<int>(decided.included.size()) - skipped;
  e.skipped = skipped;
  const GroupSpec& spec = g.registration.reference().spec;
  for (size_t i = 0; i < decided.included.size() && i < spec.params.size(); ++i) {
    if (decided.included[i]) continue;
    if (static_cast<int>(e.skipped_names.size()) >= ObserveEvent::kMaxSkippedNames) break;
    e.skipped_names.push_back(spec.params[i].name);
  }
  return e;
}

}  // namespace

void JobCore::ObserveDecision(GroupState& g, int64_t step, const PendingStep* p,
                              const v1::Decision& d, const Decision* decided, StepContents contents,
                              JobEffects& fx) {
  ++g.counters.decisions;
  const bool same = d.same_as_previous();
  const bool ok = same || d.has_ok();
  if (decided != nullptr && p != nullptr) {
    if (std::optional<ObserveEvent> e = NoteDecided(*this, g, step, *p, *decided)) {
      fx.Event(*std::move(e));
    }
  } else if (!ok) {
    g.shape.have_last_ok = false;
  }
  if (g.observer != nullptr) {
    DecisionSummary s;
    s.step = step;
    s.ok = ok;
    s.same_as_previous = same;
    if (ok) {
      s.wire = g.shape.last_wire;
      s.included = static_cast<int>(g.shape.last_included.size()) - g.shape.last_num_skipped;
      s.skipped = g.shape.last_num_skipped;
      s.zero_fills = g.shape.last_zero_fills;
    }
    s.wait = absl::Microseconds(d.wait_us());
    g.observer->OnDecision(s);
  }
  // Usage window: extend the last run when the contents repeat the previous
  // step; otherwise start a run with this step's contents.
  if (options.usage_window_steps > 0) fx.RecordUsage(g.usage, step, same, contents);
}

void JobCore::ObserveNode(const NodeState& node, bool connected, JobEffects& fx) const {
  if (!observing()) return;
  ObserveEvent e;
  e.type = connected ? ObserveEvent::Type::kNodeConnected : ObserveEvent::Type::kNodeDisconnected;
  e.job_id = job_id;
  e.node_id = node.node_id;
  e.ranks = node.ranks;
  e.connected_nodes = members.connected();
  fx.Event(std::move(e));
}

}  // namespace accord::daemon
