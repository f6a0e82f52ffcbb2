#include "daemon/relay/relay_job.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/manifest.h"
#include "daemon/common/decision_errors.h"
#include "daemon/common/node_hello.h"
#include "daemon/common/upstream_node.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

constexpr char kRelayVersion[] = "accord-relay/1";

}  // namespace

RelayJob::RelayJob(const RelayOptions& options, RelayEffects& effects)
    : options_(options), effects_(effects), node_(options.relay_id) {}

std::optional<std::string> RelayJob::CurrentRun(const std::string& job_id) const {
  if (!node_.has_job() || node_.job_id() != job_id) return std::nullopt;
  return node_.run_id();
}

RelayStats RelayJob::stats() const {
  RelayStats s = stats_;
  s.job_id = node_.job_id();
  s.nodes = 0;
  for (const auto& [id, n] : nodes_) s.nodes += n.session != 0 ? 1 : 0;
  return s;
}

// ---------------------------------------------------------------------------
// Downstream sessions.

RelayJob::SessionId RelayJob::OpenSession() {
  const SessionId id = next_session_++;
  sessions_[id];
  return id;
}

void RelayJob::CloseSession(absl::Time now, SessionId id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  const std::string node_id = it->second.node_id;
  sessions_.erase(it);
  auto nit = nodes_.find(node_id);
  if (node_id.empty() || nit == nodes_.end() || nit->second.session != id) return;
  Node& node = nit->second;
  node.session = 0;
  node.welcomed = false;
  if (node.ranks.empty()) {
    // Every rank of the node left already: nothing waits for it.
    DropNode(node_id);
    return;
  }
  const bool any_connected = std::any_of(nodes_.begin(), nodes_.end(),
                                         [](const auto& n) { return n.second.session != 0; });
  if (!any_connected) {
    // The last sidecar left (a sidecar closes its stream when its last rank
    // leaves, without rank events): the job is over here, as it is at the
    // coordinator when its last node leaves. Sidecars that only lost their
    // connection resume it (RESUME with the run id) on a fresh stream.
    ResetJob();
    return;
  }
  node.lost_at = now;
  ACCORD_LOG(WARNING) << "job " << node_.job_id() << ": the stream of node \"" << node_id
                      << "\" ended; its steps wait "
                      << absl::FormatDuration(options_.node_reconnect_grace)
                      << " for it to reconnect";
  effects_.ArmTimer(node.lost_at + options_.node_reconnect_grace);
}

void RelayJob::HandleMessage(absl::Time now, SessionId id, const v1::NodeMessage& message) {
  auto sit = sessions_.find(id);
  if (sit == sessions_.end()) return;
  Session& s = sit->second;
  if (message.has_hello()) {
    HandleHello(now, id, s, message.hello());
    return;
  }
  auto nit = nodes_.find(s.node_id);
  if (s.node_id.empty() || nit == nodes_.end() || nit->second.session != id) {
    Refuse(id, OutOfOrderError(v1::INVALID_REQUEST,
                               "the relay got a message before this stream's NodeHello "
                               "was accepted; send NodeHello first"));
    return;
  }
  Node& node = nit->second;
  switch (message.body_case()) {
    case v1::NodeMessage::kRegistration:
      HandleRegistration(node, message.registration());
      break;
    case v1::NodeMessage::kRankEvent:
      HandleRankEvent(node, message.rank_event());
      break;
    case v1::NodeMessage::kManifests:
      HandleManifests(now, node, message.manifests());
      break;
    case v1::NodeMessage::kProgress:
      HandleProgress(now, node, message.progress());
      break;
    default:
      break;
  }
}

void RelayJob::Refuse(SessionId session, v1::DecisionError error, std::vector<int> ranks) {
  v1::CoordinatorMessage reply;
  error.set_job_id(node_.job_id());
  for (int r : ranks) error.add_ranks(r);
  ACCORD_LOG(WARNING) << error.message();
  *reply.mutable_error() = std::move(error);
  SendTo(session, std::move(reply));
}

void RelayJob::SendTo(SessionId session, v1::CoordinatorMessage message) {
  if (session == 0) return;
  effects_.SendToSession(session,
                         std::make_shared<const v1::CoordinatorMessage>(std::move(message)));
}

void RelayJob::HandleHello(absl::Time now, SessionId id, Session& s, const v1::NodeHello& hello) {
  absl::StatusOr<std::vector<int>> checked =
      CheckNodeHello(hello, options_.max_world_size, "relay");
  if (!checked.ok()) {
    Refuse(id, ErrorFromStatus(v1::ERROR_KIND_UNSPECIFIED, checked.status()));
    return;
  }
  const std::vector<int>& ranks = *checked;
  if (node_.has_job() && hello.job_id() != node_.job_id()) {
    Refuse(id, KindedError(v1::LIMIT_EXCEEDED,
                           absl::StrCat("relay \"", options_.relay_id, "\" serves job ",
                                        node_.job_id(), " now; node \"", hello.node_id(),
                                        "\" asked for job ", hello.job_id(),
                                        ". A relay serves one job at a time: give each "
                                        "job its own relays")));
    return;
  }
  if (node_.has_job()) {
    // As the coordinator checks a node joining a job (the same checks).
    RankHeldElsewhere held;
    absl::Status joins = CheckNodeJoins(node_.job_id(), node_.world_size(), hello, [&]() {
      return held = HeldElsewhere(hello.node_id(), ranks);
    });
    if (!joins.ok()) {
      std::vector<int> at_fault;
      if (held.rank >= 0) at_fault.push_back(held.rank);
      Refuse(id, ErrorFromStatus(v1::ERROR_KIND_UNSPECIFIED, joins), at_fault);
      return;
    }
  }
  if (node_.has_job() && RanksRestarted(hello)) EndRun(id, hello);
  if (!node_.has_job()) {
    // A resuming sidecar names its run: a restarted relay rejoins it.
    node_.StartJob(hello.job_id(), hello.world_size(),
                   options_.token.empty() ? hello.token() : options_.token,
                   hello.run_start() == v1::NodeHello::RUN_START_RESUME ? hello.run_id() : "");
    ACCORD_LOG(INFO) << "job " << node_.job_id() << ": first node \"" << hello.node_id()
                     << "\" arrived; relaying as node \"" << options_.relay_id << "\"";
    if (!node_.welcomed()) StartUnanswered(now);
  }
  Node& node = PlaceNode(id, s, hello, ranks);
  // Ranks not yet announced upstream join the relay's node there.
  node_.AnnounceRanks(ranks);
  if (node_.welcomed()) Welcome(node);
}

void RelayJob::EndRun(SessionId id, const v1::NodeHello& hello) {
  // As the coordinator does for a node (docs/ARCHITECTURE.md, "Runs"): the
  // current run is over for every sidecar here; the hello then starts a
  // new one, and the relay's NEW hello with a fresh epoch ends the run at
  // the coordinator for every other node too.
  const std::string msg = absl::StrCat(
      "job ", node_.job_id(), " run ", node_.run_id(), " ended: node \"", hello.node_id(),
      "\" started a new run of the same job id (its ranks were restarted), so this run gets "
      "no more decisions; stop the ranks of the old run");
  ACCORD_LOG(WARNING) << msg;
  for (auto& [sid, other] : sessions_) {
    if (sid == id || other.node_id.empty()) continue;
    Refuse(sid, KindedError(v1::RUN_ENDED, msg));
    other.node_id.clear();
  }
  ResetJob();
}

RelayJob::Node& RelayJob::PlaceNode(SessionId id, Session& s, const v1::NodeHello& hello,
                                    const std::vector<int>& ranks) {
  Node& node = nodes_[hello.node_id()];
  if (node.session != 0 && node.session != id) {
    // The same node reconnected before its old stream was noticed as gone.
    auto old = sessions_.find(node.session);
    if (old != sessions_.end()) old->second.node_id.clear();
  }
  node.node_id = hello.node_id();
  node.session = id;
  node.answers_progress = hello.answers_progress();
  node.epoch = hello.node_epoch();
  node.lost_at = absl::InfiniteFuture();
  node.welcomed = false;
  node.last_full.clear();  // a new stream starts without a previous manifest
  node.received.Clear();   // ... and without a previous batch
  node.ranks = ranks;
  node.rank_set = RankSet(node_.world_size());
  for (int r : ranks) node.rank_set.Add(r);
  ++membership_epoch_;
  s.node_id = node.node_id;
  return node;
}

RankHeldElsewhere RelayJob::HeldElsewhere(const std::string& node_id,
                                          const std::vector<int>& ranks) const {
  for (int r : ranks) {
    for (const auto& [other_id, other] : nodes_) {
      if (other_id == node_id || other.session == 0) continue;
      if (std::binary_search(other.ranks.begin(), other.ranks.end(), r)) return {r, other_id};
    }
  }
  return {};
}

bool RelayJob::RanksRestarted(const v1::NodeHello& hello) const {
  if (hello.run_start() != v1::NodeHello::RUN_START_NEW || hello.node_epoch() == 0) return false;
  auto nit = nodes_.find(hello.node_id());
  if (nit != nodes_.end()) return nit->second.epoch != 0 && nit->second.epoch != hello.node_epoch();
  auto dit = dropped_epochs_.find(hello.node_id());
  return dit != dropped_epochs_.end() && dit->second != 0 && dit->second != hello.node_epoch();
}

void RelayJob::Welcome(Node& node) {
  if (node.welcomed || node.session == 0) return;
  node.welcomed = true;
  v1::CoordinatorMessage reply;
  v1::Welcome& w = *reply.mutable_welcome();
  w.set_node_id(node.node_id);
  w.set_server_version(kRelayVersion);
  w.set_batch_repeat(true);  // HandleManifests expands them
  w.set_deadline_ms(node_.deadline_ms());
  w.set_run_id(node_.run_id());
  w.set_members(node_.takes_members().value_or(false));
  SendTo(node.session, std::move(reply));
}

void RelayJob::HandleRegistration(Node& node, const v1::NodeRegistration& nr) {
  const std::string& gid = nr.registration().group_id();
  Group& g = groups_[gid];
  g.group_id = gid;
  absl::StatusOr<GroupSpec> spec = wire::GroupSpecFromProto(nr.registration(), node_.world_size());
  if (spec.ok()) {
    // The first valid registration's members; another member set under the
    // id goes up as is, and the coordinator fails the group for every rank.
    if (g.num_params == 0) g.members = spec->members;
    g.num_params = spec->params.size();
  }
  g.nodes.insert(node.node_id);
  g.registrations.Add(nr.registration(), {nr.ranks().begin(), nr.ranks().end()});
  v1::NodeMessage up;
  *up.mutable_registration() = nr;
  node_.Send(std::move(up));
}

void RelayJob::HandleRankEvent(Node& node, const v1::RankEvent& e) {
  if (!e.joined()) {
    // Still one of the ranks its manifests without rank_bits stand for.
    node.ranks.erase(std::remove(node.ranks.begin(), node.ranks.end(), e.rank()), node.ranks.end());
  } else {
    if (!std::binary_search(node.ranks.begin(), node.ranks.end(), e.rank())) {
      node.ranks.insert(std::lower_bound(node.ranks.begin(), node.ranks.end(), e.rank()), e.rank());
    }
    node.rank_set.Add(e.rank());
  }
  ++membership_epoch_;
  if (e.joined() || !e.cause().empty()) {
    node_.ForwardRankEvent(e);
    return;
  }
  // The coordinator knows the relay as the rank's node: name the sidecar.
  v1::RankEvent named = e;
  named.set_cause(absl::StrCat("its stream to the sidecar on node \"", node.node_id, "\" ended"));
  node_.ForwardRankEvent(named);
}

// ---------------------------------------------------------------------------
// Silent ranks.

std::vector<int> RelayJob::ContributedRanks(const Group& g, int64_t step) {
  std::vector<int> ranks;
  auto it = g.steps.find(step);
  if (it == g.steps.end()) return ranks;
  for (const auto& [node, covered] : it->second.contributed) {
    ranks.insert(ranks.end(), covered.begin(), covered.end());
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

void RelayJob::HandleProgress(absl::Time now, Node& node, const v1::NodeProgress& p) {
  auto git = groups_.find(p.group_id());
  if (p.partial()) {
    // Forward at once, with what the other sidecars already contributed.
    v1::NodeMessage up;
    *up.mutable_progress() = p;
    if (git != groups_.end() && p.step() > git->second.last_decided) {
      Group& g = git->second;
      LocalStep& st = g.steps[p.step()];
      if (!st.waited) {
        st.waited = true;
        st.first_seen = now - absl::Microseconds(p.waited_us());
      }
      st.partial_reported = true;
      for (int r : ContributedRanks(g, p.step())) up.mutable_progress()->add_reported(r);
      up.mutable_progress()->set_waited_us(
          std::max<int64_t>(p.waited_us(), absl::ToInt64Microseconds(now - st.first_seen)));
    }
    node_.Send(std::move(up));
    return;
  }
  if (git == groups_.end()) return;
  Group& g = git->second;
  auto qit = g.queries.find(p.step());
  if (qit == g.queries.end() || qit->second.waiting.erase(node.node_id) == 0) return;
  v1::NodeProgress& answer = qit->second.answer;
  for (int r : p.reported()) answer.add_reported(r);
  const int n = std::min(p.ranks_size(), p.last_steps_size());
  for (int i = 0; i < n; ++i) {
    answer.add_ranks(p.ranks(i));
    answer.add_last_steps(p.last_steps(i));
    // A relay below this one already named the sidecar.
    answer.add_rank_nodes(p.rank_nodes_size() == p.ranks_size() ? p.rank_nodes(i) : node.node_id);
  }
  if (qit->second.waiting.empty()) FinishQuery(g, p.step());
}

void RelayJob::HandleProgressQuery(const v1::ProgressQuery& q) {
  auto git = groups_.find(q.group_id());
  if (git == groups_.end()) {
    // Nothing registered here: no rank of the relay submitted it.
    v1::NodeMessage up;
    up.mutable_progress()->set_group_id(q.group_id());
    up.mutable_progress()->set_step(q.step());
    node_.Send(std::move(up));
    return;
  }
  Group& g = git->second;
  Query& query = g.queries[q.step()];
  query.waiting.clear();
  query.answer.Clear();
  query.answer.set_group_id(q.group_id());
  query.answer.set_step(q.step());
  for (int r : ContributedRanks(g, q.step())) query.answer.add_reported(r);
  auto st = g.steps.find(q.step());
  for (auto& [id, node] : nodes_) {
    const bool done = st != g.steps.end() && st->second.contributed.count(id) != 0;
    if (done || node.session == 0 || !node.answers_progress) continue;
    query.waiting.insert(id);
    v1::CoordinatorMessage ask;
    *ask.mutable_progress_query() = q;
    SendTo(node.session, std::move(ask));
  }
  if (query.waiting.empty()) FinishQuery(g, q.step());
}

void RelayJob::FinishQuery(Group& g, int64_t step) {
  auto it = g.queries.find(step);
  if (it == g.queries.end()) return;
  v1::NodeMessage up;
  *up.mutable_progress() = std::move(it->second.answer);
  g.queries.erase(it);
  node_.Send(std::move(up));
}

// ---------------------------------------------------------------------------
// Upstream.

void RelayJob::OnUpstreamConnected(absl::Time now) {
  std::vector<v1::NodeMessage> registrations;
  v1::ManifestBatch inflight;
  for (auto& [gid, g] : groups_) {
    g.repeat.Forget();  // a new stream holds no previous manifest
    g.registrations.AppendResend([](int) { return true; }, &registrations);
  }
  for (auto& [gid, g] : groups_) g.inflight.AppendAll(node_, g.members.get(), &inflight);
  // A new stream: unanswered until its Welcome.
  if (node_.has_job()) StartUnanswered(now);
  node_.Connected(std::move(registrations), std::move(inflight));
}

void RelayJob::HandleCoordinatorMessage(v1::CoordinatorMessage* message) {
  if (!node_.has_job()) return;
  switch (message->body_case()) {
    case v1::CoordinatorMessage::kWelcome:
      node_.OnWelcome(message->welcome());
      upstream_loss_.Answered();
      for (auto& [id, node] : nodes_) Welcome(node);
      return;
    case v1::CoordinatorMessage::kDecisions:
      HandleDecisions(message->mutable_decisions());
      if (message->decisions().decisions_size() == 0) return;
      ++stats_.decision_batches;
      break;
    case v1::CoordinatorMessage::kProgressQuery:
      HandleProgressQuery(message->progress_query());
      return;
    default:
      break;
  }
  if (message->has_error()) {
    // An error reaches every sidecar of the job, welcomed or not: a refused
    // hello (the run failed or ended while this relay's nodes were away) is
    // answered before any Welcome, and the sidecars waiting for one must get
    // the error their job's other ranks got (docs/RELIABILITY.md, "Chaos").
    auto shared = std::make_shared<const v1::CoordinatorMessage>(std::move(*message));
    for (auto& [id, node] : nodes_) {
      if (node.session != 0) effects_.SendToSession(node.session, shared);
    }
    return;
  }
  // Decisions and registration results: the same for every sidecar.
  Broadcast(std::make_shared<const v1::CoordinatorMessage>(std::move(*message)));
}

void RelayJob::HandleDecisions(v1::DecisionBatch* batch) {
  // A repeat-form manifest of the relay's own that the coordinator cannot
  // resolve (it restarted): resend that step in full form; the sidecars
  // never see this answer, it was about the relay's message.
  v1::ManifestBatch resend;
  auto own = std::remove_if(batch->mutable_decisions()->begin(), batch->mutable_decisions()->end(),
                            [&](const v1::Decision& d) {
                              if (!d.has_error() || !d.error().resend_full_form()) return false;
                              auto git = groups_.find(d.group_id());
                              if (git == groups_.end()) return true;
                              Group& g = git->second;
                              g.repeat.Forget();
                              g.inflight.AppendStep(d.step(), node_, g.members.get(), &resend);
                              return true;
                            });
  batch->mutable_decisions()->erase(own, batch->mutable_decisions()->end());
  SendBatch(std::move(resend));
  for (const v1::Decision& d : batch->decisions()) {
    auto git = groups_.find(d.group_id());
    if (git == groups_.end()) continue;
    Group& g = git->second;
    const int64_t step = d.step();
    // An older step decided again (a coordinator that lost the run's state
    // decides what some node had not got) changes nothing kept here.
    if (step < g.last_decided) continue;
    g.last_decided = step;
    if (d.has_ok() || d.has_error()) {
      g.last_decision = d;
    } else if (d.same_as_previous() && g.last_decision.has_value()) {
      g.last_decision->set_step(step);
    }
    g.steps.erase(g.steps.begin(), g.steps.upper_bound(step));
    g.inflight.DropUpTo(step);
    g.queries.erase(g.queries.begin(), g.queries.upper_bound(step));
  }
}

void RelayJob::Broadcast(std::shared_ptr<const v1::CoordinatorMessage> message) {
  for (auto& [id, node] : nodes_) {
    if (node.welcomed && node.session != 0) effects_.SendToSession(node.session, message);
  }
}

// ---------------------------------------------------------------------------
// Lifetimes and timers.

void RelayJob::DropNode(const std::string& node_id) {
  auto nit = nodes_.find(node_id);
  if (nit == nodes_.end()) return;
  const std::string cause = absl::StrCat(
      "its sidecar on node \"", node_id, "\" lost its stream to relay \"", options_.relay_id,
      "\" and did not come back within ", absl::FormatDuration(options_.node_reconnect_grace),
      " (the relay's --node_reconnect_grace)");
  for (int r : nit->second.ranks) {
    // Gone past the grace: a pending step that needs these ranks fails now.
    node_.LeaveRank(r, /*last_step=*/-1, cause);
  }
  // Bounded by the sidecars that ever joined the job, which the job's world
  // bounds in practice; cleared with the job.
  dropped_epochs_[node_id] = nit->second.epoch;
  nodes_.erase(nit);
  ++membership_epoch_;
  v1::ManifestBatch out;
  for (auto& [gid, g] : groups_) {
    g.nodes.erase(node_id);
    std::vector<int64_t> steps;
    for (const auto& [step, st] : g.steps) steps.push_back(step);
    for (int64_t step : steps) MaybeSendStep(g, step, &out);
  }
  SendBatch(std::move(out));
  if (nodes_.empty()) ResetJob();
}

void RelayJob::ResetJob() {
  ACCORD_LOG(INFO) << "job " << node_.job_id() << ": no node left on relay \"" << options_.relay_id
                   << "\"; its state is dropped";
  node_.EndJob();
  dropped_epochs_.clear();
  upstream_loss_.EndJob();
  ++membership_epoch_;
  nodes_.clear();
  groups_.clear();
  node_.sink()->Reset({});
  node_.sink()->Reconnect();
}

void RelayJob::StartUnanswered(absl::Time now) {
  const absl::Time due = upstream_loss_.Start(now);
  if (due != absl::InfiniteFuture()) effects_.ArmTimer(due);
}

absl::Time RelayJob::CheckUpstreamLoss(absl::Time now) {
  absl::Time next;
  std::optional<v1::DecisionError> lost =
      upstream_loss_.Check(now, node_.has_job(), node_.job_id(), &next);
  if (!lost.has_value()) return next;
  // Every wait of the sidecars here needs the coordinator, and they hear
  // from the relay, so their own limit never runs: the relay tells them,
  // in a sidecar's words, so every rank that lost the coordinator ends alike.
  ACCORD_LOG(ERROR) << lost->message();
  v1::CoordinatorMessage message;
  *message.mutable_error() = *std::move(lost);
  auto shared = std::make_shared<const v1::CoordinatorMessage>(std::move(message));
  for (auto& [id, node] : nodes_) {
    if (node.session != 0) effects_.SendToSession(node.session, shared);
  }
  return next;
}

absl::Time RelayJob::CheckTimers(absl::Time now) {
  absl::Time next = CheckUpstreamLoss(now);
  std::vector<std::string> lost;
  for (const auto& [id, node] : nodes_) {
    if (node.session != 0) continue;
    const absl::Time due = node.lost_at + options_.node_reconnect_grace;
    if (due <= now) {
      lost.push_back(id);
    } else {
      next = std::min(next, due);
    }
  }
  for (const std::string& id : lost) {
    ACCORD_LOG(WARNING) << "job " << node_.job_id() << ": node \"" << id
                        << "\" did not reconnect within "
                        << absl::FormatDuration(options_.node_reconnect_grace)
                        << "; its ranks are reported as left";
    DropNode(id);
  }
  if (node_.deadline_ms() > 0 && node_.welcomed()) {
    const absl::Duration half = absl::Milliseconds(node_.deadline_ms()) / 2;
    for (auto& [gid, g] : groups_) {
      for (auto& [step, st] : g.steps) {
        if (st.partial_reported || st.unsent.empty() || !st.waited) continue;
        const absl::Time due = st.first_seen + half;
        if (due > now) {
          next = std::min(next, due);
          continue;
        }
        st.partial_reported = true;
        node_.Send(PartialReport(gid, step, now - st.first_seen, ContributedRanks(g, step)));
      }
    }
  }
  return next;
}

}  // namespace accord::daemon
