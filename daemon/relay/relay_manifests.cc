// The RelayJob's manifests (docs/ARCHITECTURE.md, "Relays"): a sidecar's batch
// (or batch repeat) resolved into full-form contributions, collected per
// (group, step), merged once every sidecar that registered the group
// contributed, and sent upstream in repeat form when unchanged.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/hash.h"
#include "core/manifest.h"
#include "daemon/common/decision_errors.h"
#include "daemon/relay/relay_job.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

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

// A sidecar's ranks that a manifest of its without rank_bits stands for: its
// announced ranks among `members` (null: every rank).
RankSet AnnouncedMembers(const RankSet& announced, const MemberSet* members) {
  if (members == nullptr) return announced;
  RankSet out(announced.world_size());
  for (int r : announced.Members()) {
    if (members->Contains(r)) out.Add(r);
  }
  return out;
}

ManifestShape ShapeOf(const v1::Manifest& m) {
  ManifestShape shape;
  shape.rank_bits = m.rank_bits();
  shape.detail.reserve(m.rank_detail_size());
  for (const v1::RankUsage& u : m.rank_detail()) {
    shape.detail.push_back(RankUsageBits{u.rank(), u.used_bits()});
  }
  return shape;
}

}  // namespace

void RelayJob::HandleManifests(absl::Time now, Node& node, const v1::ManifestBatch& batch) {
  if (batch.repeat_batch_key() == 0) {
    if (batch.manifests_size() == 0) return;
    node.received.Record(batch);
    AddBatch(now, node, batch);
    return;
  }
  if (batch.manifests_size() > 0 || node.received.key() != batch.repeat_batch_key()) {
    Refuse(
        node.session,
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
  AddBatch(now, node, node.received.ExpandAt(batch.repeat_step()));
}

void RelayJob::AddBatch(absl::Time now, Node& node, const v1::ManifestBatch& batch) {
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
        SendTo(node.session, std::move(reply));
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
    // A step its sidecar already holds the decision of (a new stream's
    // resend): its content is the sidecar's previous manifest (kept above).
    // For a step this relay saw decided it goes no further: the relay sends
    // its own (docs/ARCHITECTURE.md, "Decisions across a coordinator
    // restart"). A step it never saw decided (it restarted since) takes it
    // as that sidecar's contribution, flagged: it is the only copy of what
    // those ranks submitted, which the sidecars that lost the decision wait
    // on.
    if (m.decided() && m.step() <= g.last_decided) continue;
    if (!m.decided()) ++stats_.node_manifests_in;
    AddManifest(now, node, g, std::move(full), m.repeat(), m.decided(), &out);
  }
  SendBatch(std::move(out));
}

void RelayJob::AddManifest(absl::Time now, Node& node, Group& g, v1::Manifest m, bool repeat,
                           bool decided, v1::ManifestBatch* out) {
  const int64_t step = m.step();
  if (step <= g.last_decided) {
    AnswerDecidedStep(node, g, step);
    return;
  }
  LocalStep& st = g.steps[step];
  if (st.contributed.count(node.node_id) != 0) return;  // a resend: sent or queued already
  if (!decided && !st.waited) {
    st.waited = true;
    st.first_seen = now;
  }
  // Explicit ranks when the sidecar named them; none: every rank it
  // announced among the group's members.
  absl::StatusOr<RankSet> ranks =
      m.rank_bits().empty() ? AnnouncedMembers(node.rank_set, g.members.get())
                            : wire::RankSetFromBits(m.rank_bits(), node_.world_size(), "rank_bits");
  st.contributed[node.node_id] = ranks.ok() ? ranks->Members() : std::vector<int>();
  st.unsent.push_back(Part{node.node_id, std::move(m), repeat, std::move(ranks), decided});
  if (st.waited && node_.deadline_ms() > 0) {
    effects_.ArmTimer(st.first_seen + absl::Milliseconds(node_.deadline_ms()) / 2);
  }
  MaybeSendStep(g, step, out);
}

void RelayJob::AnswerDecidedStep(Node& node, const Group& g, int64_t step) {
  // Every manifest gets an answer, as the coordinator gives it
  // (docs/ARCHITECTURE.md, "Relays"): without one, the ranks of a sidecar
  // that came back past the grace would wait for ever.
  v1::CoordinatorMessage reply;
  v1::Decision* d = reply.mutable_decisions()->add_decisions();
  if (g.last_decision.has_value() && (step == g.last_decided || g.last_decision->has_error())) {
    // A resend after a reconnect whose decision was lost: answer again. An
    // error (the job failed) answers every older step too: the ranks that
    // missed it end with the words the others got.
    *d = *g.last_decision;
  } else {
    d->set_group_id(g.group_id);
    *d->mutable_error() = KindedError(
        v1::STEP_REGRESSION,
        absl::StrCat("job ", node_.job_id(), " group \"", g.group_id, "\" step ", step, ": node \"",
                     node.node_id, "\" sent it to relay \"", options_.relay_id,
                     "\" after the group decided step ", g.last_decided,
                     " without it; its ranks missed this step (was their sidecar gone past "
                     "the relay's --node_reconnect_grace?)"));
    d->mutable_error()->set_job_id(node_.job_id());
    d->mutable_error()->set_group_id(g.group_id);
    d->mutable_error()->set_step(step);
  }
  d->set_step(step);
  SendTo(node.session, std::move(reply));
}

void RelayJob::MaybeSendStep(Group& g, int64_t step, v1::ManifestBatch* out) {
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
  const uint64_t signature = PartsSignature(parts);
  const bool all_repeat =
      std::all_of(parts.begin(), parts.end(), [](const Part& p) { return p.repeat; });
  // Only flagged parts: the merge speaks for ranks that hold the decision.
  const bool decided =
      std::all_of(parts.begin(), parts.end(), [](const Part& p) { return p.decided; });
  if (all_repeat && signature != 0 && g.repeat.held() &&
      signature == g.last_merge.parts_signature) {
    // The steady state: every sidecar repeated the content of the last merge,
    // and the ranks are the same, so the merge would be the last one again.
    g.inflight.Add(step, g.last_merge.merged, g.last_merge.announced, decided);
    v1::Manifest* r = out->add_manifests();
    r->set_group_id(g.group_id);
    r->set_step(step);
    r->set_cache_key(g.repeat.key());
    r->set_repeat(true);
    r->set_decided(decided);
    ++stats_.manifests_up_repeat;
    ++stats_.merges_reused;
    return;
  }
  absl::StatusOr<v1::Manifest> merged = Merge(g, step, parts);
  if (!merged.ok()) {
    // Malformed contributions: forward them as they are, so the coordinator
    // names the problem exactly as it would without a relay.
    for (Part& p : parts) *out->add_manifests() = std::move(p.manifest);
    g.repeat.Forget();
    g.last_merge.parts_signature = 0;
    return;
  }
  auto full = std::make_shared<v1::Manifest>(*merged);
  full->clear_step();
  g.last_merge = LastMerge{signature, full, node_.announced().size()};
  g.inflight.Add(step, std::move(full), g.last_merge.announced, decided);
  merged->set_decided(decided);
  const ManifestShape shape = ShapeOf(*merged);
  if (g.repeat.Repeats(merged->cache_key(), shape)) {
    v1::Manifest* r = out->add_manifests();
    r->set_group_id(g.group_id);
    r->set_step(step);
    r->set_cache_key(merged->cache_key());
    r->set_repeat(true);
    r->set_decided(decided);
    ++stats_.manifests_up_repeat;
    return;
  }
  g.repeat.Sent(merged->cache_key(), shape);
  *out->add_manifests() = *std::move(merged);
  ++stats_.manifests_up_full;
}

uint64_t RelayJob::PartsSignature(const std::vector<Part>& parts) const {
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

absl::StatusOr<v1::Manifest> RelayJob::Merge(const Group& g, int64_t step,
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
    if (!p.ranks.ok()) return p.ranks.status();
    merged.ranks.Union(*p.ranks);
  }
  // Without rank_bits only when the merge covers exactly what the
  // coordinator holds to be this relay's ranks among the group's members
  // (UpstreamNode::announced()).
  v1::Manifest out;
  wire::ManifestToProto(g.group_id, merged,
                        /*with_ranks=*/!node_.IsAnnounced(merged.ranks, g.members.get()), &out);
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
    RankUsageOf(p.manifest, p.ranks->Members(), &usage);
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

void RelayJob::SendBatch(v1::ManifestBatch batch) {
  // Every group of a step completed by one sidecar's batch, each identical
  // to the previous one sent: the coordinator can take it as one batch
  // repeat (and a repeat wave when every relay does the same).
  if (node_.SendBatch(std::move(batch))) ++stats_.batch_repeats_up;
}

}  // namespace accord::daemon
