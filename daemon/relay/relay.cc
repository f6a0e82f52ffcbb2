#include "daemon/relay/relay.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/hash.h"
#include "core/log.h"
#include "core/manifest.h"
#include "daemon/common/decision_errors.h"
#include "daemon/common/node_hello.h"
#include "daemon/common/upstream_node.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

constexpr char kRelayVersion[] = "accord-relay/1";

// The used bits of each rank in `m` (a sidecar's node manifest covering
// `ranks`): rank_detail where given, else the manifest's own used bits.
void RankUsageOf(const v1::Manifest& m, const std::vector<int>& ranks,
                 std::map<int, std::string>* out) {
  for (int r : ranks) (*out)[r] = m.used_bits();
  for (const v1::RankUsage& u : m.rank_detail()) {
    auto it = out->find(u.rank());
    if (it != out->end()) it->second = u.used_bits();
  }
}

// What besides the cache key tells two merged manifests apart: the ranks
// they name and the per-rank detail (the key covers dtypes and ranks only).
std::string ShapeOf(const v1::Manifest& m) {
  std::string shape = m.rank_bits();
  for (const v1::RankUsage& u : m.rank_detail()) {
    absl::StrAppend(&shape, "|", u.rank(), ":", u.used_bits());
  }
  return shape;
}

}  // namespace

Relay::Relay(RelayOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : RealClock::Get()),
      node_(options_.relay_id) {
  if (options_.start_timer_thread) timer_ = std::thread([this] { TimerLoop(); });
}

Relay::~Relay() { Stop(); }

void Relay::Stop() {
  {
    accord::MutexLock l(&mu_);
    stopping_ = true;
    timer_cv_.SignalAll();
  }
  if (timer_.joinable()) timer_.join();
}

void Relay::SetUpstream(UpstreamSink* upstream) {
  accord::MutexLock l(&mu_);
  node_.SetSink(upstream);
}

RelayStats Relay::stats() {
  accord::MutexLock l(&mu_);
  RelayStats s = stats_;
  s.job_id = node_.job_id();
  s.nodes = 0;
  for (const auto& [id, n] : nodes_) s.nodes += n.session != 0 ? 1 : 0;
  return s;
}

// ---------------------------------------------------------------------------
// Downstream sessions.

Relay::SessionId Relay::OpenSession(NodeSink* sink) {
  accord::MutexLock l(&mu_);
  const SessionId id = next_session_++;
  sessions_[id].sink = sink;
  return id;
}

void Relay::CloseSession(SessionId id) {
  accord::MutexLock l(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  const std::string node_id = it->second.node_id;
  sessions_.erase(it);
  auto nit = nodes_.find(node_id);
  if (node_id.empty() || nit == nodes_.end() || nit->second.session != id) return;
  Node& node = nit->second;
  node.session = 0;
  node.sink = nullptr;
  node.welcomed = false;
  if (node.ranks.empty()) {
    // Every rank of the node left already: nothing waits for it.
    DropNodeLocked(node_id);
    return;
  }
  const bool any_connected = std::any_of(nodes_.begin(), nodes_.end(),
                                         [](const auto& n) { return n.second.session != 0; });
  if (!any_connected) {
    // The last sidecar left (a sidecar closes its stream when its last rank
    // leaves, without rank events): the job is over here, as it is at the
    // coordinator when its last node leaves. Sidecars that only lost their
    // connection resume it (RESUME with the run id) on a fresh stream.
    ResetJobLocked();
    return;
  }
  node.lost_at = clock_->Now();
  ACCORD_LOG(WARNING) << "job " << node_.job_id() << ": the stream of node \"" << node_id
                      << "\" ended; its steps wait "
                      << absl::FormatDuration(options_.node_reconnect_grace)
                      << " for it to reconnect";
  ArmTimerLocked(node.lost_at + options_.node_reconnect_grace);
}

void Relay::HandleMessage(SessionId id, const v1::NodeMessage& message) {
  accord::MutexLock l(&mu_);
  auto sit = sessions_.find(id);
  if (sit == sessions_.end()) return;
  Session& s = sit->second;
  if (message.has_hello()) {
    HandleHelloLocked(id, s, message.hello());
    return;
  }
  auto nit = nodes_.find(s.node_id);
  if (s.node_id.empty() || nit == nodes_.end() || nit->second.session != id) {
    RefuseLocked(s.sink, OutOfOrderError(v1::INVALID_REQUEST,
                                         "the relay got a message before this stream's NodeHello "
                                         "was accepted; send NodeHello first"));
    return;
  }
  Node& node = nit->second;
  switch (message.body_case()) {
    case v1::NodeMessage::kRegistration:
      HandleRegistrationLocked(node, message.registration());
      break;
    case v1::NodeMessage::kRankEvent:
      HandleRankEventLocked(node, message.rank_event());
      break;
    case v1::NodeMessage::kManifests:
      HandleManifestsLocked(node, message.manifests());
      break;
    case v1::NodeMessage::kProgress:
      HandleProgressLocked(node, message.progress());
      break;
    default:
      break;
  }
}

void Relay::RefuseLocked(NodeSink* sink, v1::DecisionError error, std::vector<int> ranks) {
  v1::CoordinatorMessage reply;
  error.set_job_id(node_.job_id());
  for (int r : ranks) error.add_ranks(r);
  ACCORD_LOG(WARNING) << error.message();
  *reply.mutable_error() = std::move(error);
  SendToLocked(sink, std::move(reply));
}

void Relay::SendToLocked(NodeSink* sink, v1::CoordinatorMessage message) {
  if (sink != nullptr)
    sink->Send(std::make_shared<const v1::CoordinatorMessage>(std::move(message)));
}

void Relay::HandleHelloLocked(SessionId id, Session& s, const v1::NodeHello& hello) {
  absl::StatusOr<std::vector<int>> checked =
      CheckNodeHello(hello, options_.max_world_size, "relay");
  if (!checked.ok()) {
    RefuseLocked(s.sink, ErrorFromStatus(v1::ERROR_KIND_UNSPECIFIED, checked.status()));
    return;
  }
  const std::vector<int>& ranks = *checked;
  if (node_.has_job() && hello.job_id() != node_.job_id()) {
    RefuseLocked(s.sink, KindedError(v1::LIMIT_EXCEEDED,
                                     absl::StrCat("relay \"", options_.relay_id, "\" serves job ",
                                                  node_.job_id(), " now; node \"", hello.node_id(),
                                                  "\" asked for job ", hello.job_id(),
                                                  ". A relay serves one job at a time: give each "
                                                  "job its own relays")));
    return;
  }
  if (node_.has_job()) {
    // As the coordinator checks a node joining a job (the same checks).
    const RankHeldElsewhere held = HeldElsewhereLocked(hello.node_id(), ranks);
    if (absl::Status joins = CheckNodeJoins(node_.job_id(), node_.world_size(), hello, held);
        !joins.ok()) {
      std::vector<int> at_fault;
      if (held.rank >= 0 && wire::KindOf(joins) == v1::DUPLICATE_RANK)
        at_fault.push_back(held.rank);
      RefuseLocked(s.sink, ErrorFromStatus(v1::ERROR_KIND_UNSPECIFIED, joins), at_fault);
      return;
    }
  }
  if (node_.has_job() && RanksRestartedLocked(hello)) {
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
      RefuseLocked(other.sink, KindedError(v1::RUN_ENDED, msg));
      other.node_id.clear();
    }
    ResetJobLocked();
  }
  if (!node_.has_job()) {
    // A resuming sidecar names its run: a restarted relay rejoins it.
    node_.StartJob(hello.job_id(), hello.world_size(),
                   options_.token.empty() ? hello.token() : options_.token,
                   hello.run_start() == v1::NodeHello::RUN_START_RESUME ? hello.run_id() : "");
    ACCORD_LOG(INFO) << "job " << node_.job_id() << ": first node \"" << hello.node_id()
                     << "\" arrived; relaying as node \"" << options_.relay_id << "\"";
  }
  Node& node = nodes_[hello.node_id()];
  if (node.session != 0 && node.session != id) {
    // The same node reconnected before its old stream was noticed as gone.
    auto old = sessions_.find(node.session);
    if (old != sessions_.end()) old->second.node_id.clear();
  }
  node.node_id = hello.node_id();
  node.session = id;
  node.sink = s.sink;
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
  // Ranks not yet announced upstream join the relay's node there.
  node_.AnnounceRanks(ranks);
  if (node_.welcomed()) WelcomeLocked(node);
}

RankHeldElsewhere Relay::HeldElsewhereLocked(const std::string& node_id,
                                             const std::vector<int>& ranks) const {
  for (int r : ranks) {
    for (const auto& [other_id, other] : nodes_) {
      if (other_id == node_id || other.session == 0) continue;
      if (std::binary_search(other.ranks.begin(), other.ranks.end(), r)) return {r, other_id};
    }
  }
  return {};
}

bool Relay::RanksRestartedLocked(const v1::NodeHello& hello) const {
  if (hello.run_start() != v1::NodeHello::RUN_START_NEW || hello.node_epoch() == 0) return false;
  auto nit = nodes_.find(hello.node_id());
  return nit != nodes_.end() && nit->second.epoch != 0 && nit->second.epoch != hello.node_epoch();
}

void Relay::WelcomeLocked(Node& node) {
  if (node.welcomed || node.session == 0) return;
  node.welcomed = true;
  v1::CoordinatorMessage reply;
  v1::Welcome& w = *reply.mutable_welcome();
  w.set_node_id(node.node_id);
  w.set_server_version(kRelayVersion);
  w.set_batch_repeat(true);  // HandleManifestsLocked expands them
  w.set_deadline_ms(node_.deadline_ms());
  w.set_run_id(node_.run_id());
  SendToLocked(node.sink, std::move(reply));
}

void Relay::HandleRegistrationLocked(Node& node, const v1::NodeRegistration& nr) {
  const std::string& gid = nr.registration().group_id();
  Group& g = groups_[gid];
  g.group_id = gid;
  if (absl::StatusOr<GroupSpec> spec = wire::GroupSpecFromProto(nr.registration()); spec.ok()) {
    g.num_params = spec->params.size();
  }
  g.nodes.insert(node.node_id);
  g.registrations.Add(nr.registration(), {nr.ranks().begin(), nr.ranks().end()});
  v1::NodeMessage up;
  *up.mutable_registration() = nr;
  node_.Send(std::move(up));
}

void Relay::HandleRankEventLocked(Node& node, const v1::RankEvent& e) {
  if (!e.joined()) {
    node.ranks.erase(std::remove(node.ranks.begin(), node.ranks.end(), e.rank()), node.ranks.end());
  } else if (!std::binary_search(node.ranks.begin(), node.ranks.end(), e.rank())) {
    node.ranks.insert(std::lower_bound(node.ranks.begin(), node.ranks.end(), e.rank()), e.rank());
  }
  node.rank_set = RankSet(node_.world_size());
  for (int r : node.ranks) node.rank_set.Add(r);
  ++membership_epoch_;
  node_.ForwardRankEvent(e);
}

// ---------------------------------------------------------------------------
// Manifests.

void Relay::HandleManifestsLocked(Node& node, const v1::ManifestBatch& batch) {
  if (batch.repeat_batch_key() == 0) {
    if (batch.manifests_size() == 0) return;
    node.received.Record(batch);
    AddBatchLocked(node, batch);
    return;
  }
  if (batch.manifests_size() > 0 || node.received.key() != batch.repeat_batch_key()) {
    RefuseLocked(
        node.sink,
        OutOfOrderError(
            v1::INVALID_REQUEST,
            absl::StrCat("job ", node_.job_id(), " step ", batch.repeat_step(), ": node \"",
                         node.node_id, "\" sent relay \"", options_.relay_id,
                         "\" a batch repeat with key ", absl::Hex(batch.repeat_batch_key()),
                         batch.manifests_size() > 0
                             ? std::string(" together with manifests")
                             : absl::StrCat(" but the previous batch on this stream has key ",
                                            absl::Hex(node.received.key()), " (",
                                            node.received.size(), " manifests)"),
                         "; the sidecar and the relay disagree on the stream's history. Check the "
                         "sidecar's version; restarting it resends in full form")));
    return;
  }
  ++stats_.batch_repeats_in;
  AddBatchLocked(node, node.received.ExpandAt(batch.repeat_step()));
}

void Relay::AddBatchLocked(Node& node, const v1::ManifestBatch& batch) {
  v1::ManifestBatch out;
  for (const v1::Manifest& m : batch.manifests()) {
    auto git = groups_.find(m.group_id());
    if (git == groups_.end() || git->second.num_params == 0) {
      // Unknown here: the coordinator gives the precise error.
      *out.add_manifests() = m;
      continue;
    }
    Group& g = git->second;
    v1::Manifest full;
    if (m.repeat()) {
      auto lit = node.last_full.find(g.group_id);
      if (lit == node.last_full.end() || lit->second.cache_key() != m.cache_key()) {
        v1::CoordinatorMessage reply;
        v1::Decision* d = reply.mutable_decisions()->add_decisions();
        d->set_group_id(g.group_id);
        d->set_step(m.step());
        *d->mutable_error() = OutOfOrderError(
            v1::INVALID_MANIFEST,
            absl::StrCat("job ", node_.job_id(), " group \"", g.group_id, "\" step ", m.step(),
                         ": repeat-form manifest from node \"", node.node_id,
                         "\" whose previous manifest relay \"", options_.relay_id,
                         "\" does not hold; resend this step in full form"));
        d->mutable_error()->set_job_id(node_.job_id());
        d->mutable_error()->set_group_id(g.group_id);
        d->mutable_error()->set_step(m.step());
        d->mutable_error()->set_resend_full_form(true);
        SendToLocked(node.sink, std::move(reply));
        continue;
      }
      full = lit->second;
      full.set_step(m.step());
    } else {
      full = m;
      v1::Manifest remembered = m;
      remembered.clear_step();
      node.last_full[g.group_id] = std::move(remembered);
    }
    ++stats_.node_manifests_in;
    AddManifestLocked(node, g, std::move(full), m.repeat(), &out);
  }
  SendBatchLocked(std::move(out));
}

void Relay::AddManifestLocked(Node& node, Group& g, v1::Manifest m, bool repeat,
                              v1::ManifestBatch* out) {
  const int64_t step = m.step();
  if (step <= g.last_decided) {
    if (step == g.last_decided && g.last_decision.has_value()) {
      // A resend after a reconnect whose decision was lost: answer again.
      v1::CoordinatorMessage reply;
      v1::Decision* d = reply.mutable_decisions()->add_decisions();
      *d = *g.last_decision;
      d->set_step(step);
      SendToLocked(node.sink, std::move(reply));
    }
    return;
  }
  LocalStep& st = g.steps[step];
  if (st.contributed.empty()) st.first_seen = clock_->Now();
  if (st.contributed.count(node.node_id) != 0) return;  // a resend: sent or queued already
  // Explicit ranks only when the sidecar named a subset; empty: all of its ranks.
  std::vector<int> covered;
  if (!m.rank_bits().empty()) {
    absl::StatusOr<RankSet> set =
        wire::RankSetFromBits(m.rank_bits(), node_.world_size(), "rank_bits");
    if (set.ok()) covered = set->Members();
  }
  st.contributed[node.node_id] = std::move(covered);
  st.unsent.push_back(Part{node.node_id, std::move(m), repeat});
  if (node_.deadline_ms() > 0) {
    ArmTimerLocked(st.first_seen + absl::Milliseconds(node_.deadline_ms()) / 2);
  }
  MaybeSendStepLocked(g, step, out);
}

void Relay::MaybeSendStepLocked(Group& g, int64_t step, v1::ManifestBatch* out) {
  auto sit = g.steps.find(step);
  if (sit == g.steps.end() || sit->second.unsent.empty()) return;
  LocalStep& st = sit->second;
  // Cheap test first: fewer contributions than registered sidecars cannot be
  // complete (the full check below runs about once per step).
  if (st.contributed.size() < g.nodes.size()) return;
  for (const std::string& n : g.nodes) {
    if (nodes_.count(n) != 0 && st.contributed.count(n) == 0) return;  // still waiting for n
  }
  std::vector<Part> parts = std::move(st.unsent);
  st.unsent.clear();
  const uint64_t signature = PartsSignatureLocked(parts);
  const bool all_repeat =
      std::all_of(parts.begin(), parts.end(), [](const Part& p) { return p.repeat; });
  if (all_repeat && signature != 0 && g.repeat.held() && signature == g.last_parts_signature) {
    // The steady state: every sidecar repeated the content of the last merge,
    // and the ranks are the same, so the merge would be the last one again.
    g.inflight.Add(step, g.last_merged);
    v1::Manifest* r = out->add_manifests();
    r->set_group_id(g.group_id);
    r->set_step(step);
    r->set_cache_key(g.repeat.key());
    r->set_repeat(true);
    ++stats_.manifests_up_repeat;
    ++stats_.merges_reused;
    return;
  }
  absl::StatusOr<v1::Manifest> merged = MergeLocked(g, step, parts);
  if (!merged.ok()) {
    // Malformed contributions: forward them as they are, so the coordinator
    // names the problem exactly as it would without a relay.
    for (Part& p : parts) *out->add_manifests() = std::move(p.manifest);
    g.repeat.Forget();
    g.last_parts_signature = 0;
    return;
  }
  g.last_parts_signature = signature;
  auto full = std::make_shared<v1::Manifest>(*merged);
  full->clear_step();
  g.last_merged = full;
  g.inflight.Add(step, std::move(full));
  const std::string shape = ShapeOf(*merged);
  if (g.repeat.Repeats(merged->cache_key(), shape)) {
    v1::Manifest* r = out->add_manifests();
    r->set_group_id(g.group_id);
    r->set_step(step);
    r->set_cache_key(merged->cache_key());
    r->set_repeat(true);
    ++stats_.manifests_up_repeat;
    return;
  }
  g.repeat.Sent(merged->cache_key(), shape);
  *out->add_manifests() = *std::move(merged);
  ++stats_.manifests_up_full;
}

uint64_t Relay::PartsSignatureLocked(const std::vector<Part>& parts) const {
  // Order-independent: a step's parts arrive in any order.
  uint64_t sum = 0;
  for (const Part& p : parts) {
    if (p.manifest.cache_key() == 0) return 0;
    StableHasher h;
    h.AddBytes(p.node_id);
    h.AddU64(p.manifest.cache_key());
    sum += h.Finish();
  }
  StableHasher h;
  h.AddU64(sum);
  h.AddU64(parts.size());
  h.AddU64(membership_epoch_);
  const uint64_t signature = h.Finish();
  return signature != 0 ? signature : 1;
}

absl::StatusOr<v1::Manifest> Relay::MergeLocked(const Group& g, int64_t step,
                                                const std::vector<Part>& parts) {
  Manifest merged;
  merged.step = step;
  merged.dtypes.assign(g.num_params, 0);
  merged.ranks = RankSet(node_.world_size());
  std::vector<DTypeMask> dtypes;
  for (const Part& p : parts) {
    if (absl::Status s = wire::ManifestDTypesFromProto(p.manifest, g.num_params, &dtypes);
        !s.ok()) {
      return s;
    }
    for (size_t i = 0; i < g.num_params; ++i) merged.dtypes[i] |= dtypes[i];
    absl::StatusOr<RankSet> ranks = PartRanksLocked(p);
    if (!ranks.ok()) return ranks.status();
    merged.ranks.Union(*ranks);
  }
  // Every rank merged here was announced upstream, so equal counts mean the
  // manifest covers all of them (rank_bits may then be left out).
  const bool all_announced = merged.ranks.Count() == static_cast<int>(node_.announced().size());
  v1::Manifest out;
  wire::ManifestToProto(g.group_id, merged, /*with_ranks=*/!all_announced, &out);
  // Per-rank detail for the ranks whose usage differs from the merge: only
  // parts whose own usage differs, or that carry detail, need a look.
  const std::string used = out.used_bits();
  for (const Part& p : parts) {
    if (p.manifest.used_bits() == used) {
      for (const v1::RankUsage& u : p.manifest.rank_detail()) {
        if (u.used_bits() != used) *out.add_rank_detail() = u;
      }
      continue;
    }
    std::map<int, std::string> usage;
    absl::StatusOr<RankSet> ranks = PartRanksLocked(p);
    if (!ranks.ok()) return ranks.status();
    RankUsageOf(p.manifest, ranks->Members(), &usage);
    for (const auto& [rank, bits] : usage) {
      if (bits == used) continue;
      v1::RankUsage* u = out.add_rank_detail();
      u->set_rank(rank);
      u->set_used_bits(bits);
    }
  }
  std::sort(out.mutable_rank_detail()->begin(), out.mutable_rank_detail()->end(),
            [](const v1::RankUsage& a, const v1::RankUsage& b) { return a.rank() < b.rank(); });
  return out;
}

absl::StatusOr<RankSet> Relay::PartRanksLocked(const Part& p) {
  if (!p.manifest.rank_bits().empty()) {
    return wire::RankSetFromBits(p.manifest.rank_bits(), node_.world_size(), "rank_bits");
  }
  auto nit = nodes_.find(p.node_id);
  if (nit == nodes_.end()) return RankSet(node_.world_size());
  return nit->second.rank_set;
}

void Relay::SendBatchLocked(v1::ManifestBatch batch) {
  // Every group of a step completed by one sidecar's batch, each identical
  // to the previous one sent: the coordinator can take it as one batch
  // repeat (and a repeat wave when every relay does the same).
  if (node_.SendBatch(std::move(batch))) ++stats_.batch_repeats_up;
}

// ---------------------------------------------------------------------------
// Silent ranks.

std::vector<int> Relay::ContributedRanksLocked(const Group& g, int64_t step) {
  std::vector<int> ranks;
  auto it = g.steps.find(step);
  if (it == g.steps.end()) return ranks;
  for (const auto& [node, covered] : it->second.contributed) {
    auto nit = nodes_.find(node);
    const std::vector<int>& of =
        !covered.empty() || nit == nodes_.end() ? covered : nit->second.ranks;
    ranks.insert(ranks.end(), of.begin(), of.end());
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

void Relay::HandleProgressLocked(Node& node, const v1::NodeProgress& p) {
  auto git = groups_.find(p.group_id());
  if (p.partial()) {
    // Forward at once, with what the other sidecars already contributed.
    v1::NodeMessage up;
    *up.mutable_progress() = p;
    if (git != groups_.end() && p.step() > git->second.last_decided) {
      Group& g = git->second;
      LocalStep& st = g.steps[p.step()];
      if (st.contributed.empty() && st.unsent.empty()) {
        st.first_seen = clock_->Now() - absl::Microseconds(p.waited_us());
      }
      st.partial_reported = true;
      for (int r : ContributedRanksLocked(g, p.step())) up.mutable_progress()->add_reported(r);
      up.mutable_progress()->set_waited_us(std::max<int64_t>(
          p.waited_us(), absl::ToInt64Microseconds(clock_->Now() - st.first_seen)));
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
  if (qit->second.waiting.empty()) FinishQueryLocked(g, p.step());
}

void Relay::HandleProgressQueryLocked(const v1::ProgressQuery& q) {
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
  for (int r : ContributedRanksLocked(g, q.step())) query.answer.add_reported(r);
  auto st = g.steps.find(q.step());
  for (auto& [id, node] : nodes_) {
    const bool done = st != g.steps.end() && st->second.contributed.count(id) != 0;
    if (done || node.session == 0 || !node.answers_progress) continue;
    query.waiting.insert(id);
    v1::CoordinatorMessage ask;
    *ask.mutable_progress_query() = q;
    SendToLocked(node.sink, std::move(ask));
  }
  if (query.waiting.empty()) FinishQueryLocked(g, q.step());
}

void Relay::FinishQueryLocked(Group& g, int64_t step) {
  auto it = g.queries.find(step);
  if (it == g.queries.end()) return;
  v1::NodeMessage up;
  *up.mutable_progress() = std::move(it->second.answer);
  g.queries.erase(it);
  node_.Send(std::move(up));
}

// ---------------------------------------------------------------------------
// Upstream.

void Relay::OnUpstreamConnected() {
  accord::MutexLock l(&mu_);
  std::vector<v1::NodeMessage> registrations;
  v1::ManifestBatch inflight;
  for (auto& [gid, g] : groups_) {
    g.repeat.Forget();  // a new stream holds no previous manifest
    g.registrations.AppendResend([](int) { return true; }, &registrations);
  }
  for (auto& [gid, g] : groups_) g.inflight.AppendAll(&inflight);
  node_.Connected(std::move(registrations), std::move(inflight));
}

void Relay::HandleCoordinatorMessage(v1::CoordinatorMessage* message) {
  accord::MutexLock l(&mu_);
  if (!node_.has_job()) return;
  switch (message->body_case()) {
    case v1::CoordinatorMessage::kWelcome:
      node_.OnWelcome(message->welcome());
      for (auto& [id, node] : nodes_) WelcomeLocked(node);
      return;
    case v1::CoordinatorMessage::kDecisions:
      HandleDecisionsLocked(message->mutable_decisions());
      if (message->decisions().decisions_size() == 0) return;
      ++stats_.decision_batches;
      break;
    case v1::CoordinatorMessage::kProgressQuery:
      HandleProgressQueryLocked(message->progress_query());
      return;
    default:
      break;
  }
  // Decisions, registration results and errors: the same for every sidecar.
  BroadcastLocked(std::make_shared<const v1::CoordinatorMessage>(std::move(*message)));
}

void Relay::HandleDecisionsLocked(v1::DecisionBatch* batch) {
  // A repeat-form manifest of the relay's own that the coordinator cannot
  // resolve (it restarted): resend that step in full form; the sidecars
  // never see this answer, it was about the relay's message.
  v1::ManifestBatch resend;
  auto own = std::remove_if(batch->mutable_decisions()->begin(), batch->mutable_decisions()->end(),
                            [&](const v1::Decision& d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                              if (!d.has_error() || !d.error().resend_full_form()) return false;
                              auto git = groups_.find(d.group_id());
                              if (git == groups_.end()) return true;
                              git->second.repeat.Forget();
                              git->second.inflight.AppendStep(d.step(), &resend);
                              return true;
                            });
  batch->mutable_decisions()->erase(own, batch->mutable_decisions()->end());
  SendBatchLocked(std::move(resend));
  for (const v1::Decision& d : batch->decisions()) {
    auto git = groups_.find(d.group_id());
    if (git == groups_.end()) continue;
    Group& g = git->second;
    const int64_t step = d.step();
    if (step > g.last_decided) g.last_decided = step;
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

void Relay::BroadcastLocked(std::shared_ptr<const v1::CoordinatorMessage> message) {
  for (auto& [id, node] : nodes_) {
    if (node.welcomed && node.sink != nullptr) node.sink->Send(message);
  }
}

// ---------------------------------------------------------------------------
// Lifetimes and timers.

void Relay::DropNodeLocked(const std::string& node_id) {
  auto nit = nodes_.find(node_id);
  if (nit == nodes_.end()) return;
  for (int r : nit->second.ranks) {
    // Gone past the grace: a pending step that needs these ranks fails now.
    node_.LeaveRank(r, /*last_step=*/-1, /*forget=*/true);
  }
  nodes_.erase(nit);
  ++membership_epoch_;
  v1::ManifestBatch out;
  for (auto& [gid, g] : groups_) {
    g.nodes.erase(node_id);
    std::vector<int64_t> steps;
    for (const auto& [step, st] : g.steps) steps.push_back(step);
    for (int64_t step : steps) MaybeSendStepLocked(g, step, &out);
  }
  SendBatchLocked(std::move(out));
  if (nodes_.empty()) ResetJobLocked();
}

void Relay::ResetJobLocked() {
  ACCORD_LOG(INFO) << "job " << node_.job_id() << ": no node left on relay \"" << options_.relay_id
                   << "\"; its state is dropped";
  node_.EndJob();
  ++membership_epoch_;
  nodes_.clear();
  groups_.clear();
  node_.sink()->Reset({});
  node_.sink()->Reconnect();
}

void Relay::ArmTimerLocked(absl::Time at) {
  if (at >= timer_at_) return;
  timer_at_ = at;
  timer_cv_.SignalAll();
}

void Relay::TimerLoop() {
  accord::MutexLock l(&mu_);
  while (!stopping_) {
    if (clock_->Now() >= timer_at_) {
      CheckTimersLocked();
      continue;
    }
    clock_->WaitUntil(&timer_cv_, &mu_, timer_at_);
  }
}

void Relay::CheckTimers() {
  accord::MutexLock l(&mu_);
  CheckTimersLocked();
}

void Relay::CheckTimersLocked() {
  const absl::Time now = clock_->Now();
  absl::Time next = absl::InfiniteFuture();
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
    DropNodeLocked(id);
  }
  if (node_.deadline_ms() > 0 && node_.welcomed()) {
    const absl::Duration half = absl::Milliseconds(node_.deadline_ms()) / 2;
    for (auto& [gid, g] : groups_) {
      for (auto& [step, st] : g.steps) {
        if (st.partial_reported || st.unsent.empty()) continue;
        const absl::Time due = st.first_seen + half;
        if (due > now) {
          next = std::min(next, due);
          continue;
        }
        st.partial_reported = true;
        v1::NodeMessage up;
        v1::NodeProgress& p = *up.mutable_progress();
        p.set_group_id(gid);
        p.set_step(step);
        p.set_partial(true);
        p.set_waited_us(absl::ToInt64Microseconds(now - st.first_seen));
        for (int r : ContributedRanksLocked(g, step)) p.add_reported(r);
        node_.Send(std::move(up));
      }
    }
  }
  timer_at_ = next;
}

}  // namespace accord::daemon
