#include "daemon/sidecar/sidecar_job.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "daemon/common/auth_tokens.h"
#include "daemon/common/decision_errors.h"
#include "proto/wire.h"

namespace accord::daemon {
SidecarJob::SidecarJob(const SidecarOptions& options, SidecarEffects& effects)
    : options_(options), effects_(effects), node_(options.node_id) {}

void SidecarJob::ContinueIncarnation(std::string run_id, uint64_t node_epoch) {
  resume_.continued_run = std::move(run_id);
  resume_.continued_epoch = node_epoch;
}

SidecarStats SidecarJob::stats() const {
  SidecarStats s = stats_;
  s.release_held = static_cast<int64_t>(upstream_.releases.held_manifests());
  s.release_holds_expired = upstream_.releases.expired();
  s.ranks = static_cast<int>(ranks_.connected.size());
  s.sessions = static_cast<int>(ranks_.sessions.size());
  return s;
}

SidecarJob::SessionId SidecarJob::OpenSession() {
  const SessionId id = ranks_.next_session++;
  ranks_.sessions[id];
  return id;
}

std::shared_ptr<const v1::RankReply> SidecarJob::RankWelcome() const {
  auto reply = std::make_shared<v1::RankReply>();
  v1::Welcome* w = reply->mutable_welcome();
  w->set_node_id(options_.node_id);
  w->set_server_version(kServerVersion);
  w->set_run_id(node_.run_id());
  w->set_node_epoch(node_.epoch());
  // This sidecar takes groups with members; it holds them until the node
  // above says it does too (HandleRegistration).
  w->set_members(true);
  return reply;
}

void SidecarJob::SendToRank(int rank, v1::RankReply reply) {
  auto it = ranks_.connected.find(rank);
  if (it == ranks_.connected.end()) return;
  effects_.SendToSession(it->second.session,
                         std::make_shared<const v1::RankReply>(std::move(reply)));
}

void SidecarJob::SendErrorAndClose(SessionId session, const v1::DecisionError& e) {
  v1::RankReply reply;
  *reply.mutable_error() = e;
  effects_.SendToSession(session, std::make_shared<const v1::RankReply>(std::move(reply)));
  effects_.CloseSession(session, wire::ErrorToStatus(e));
}

void SidecarJob::HandleRankMessage(absl::Time now, SessionId id, const v1::RankMessage& message) {
  auto it = ranks_.sessions.find(id);
  if (it == ranks_.sessions.end()) return;
  Session& s = it->second;
  if (message.has_hello()) {
    HandleHello(now, id, s, message.hello());
    return;
  }
  if (s.rank < 0) {
    SendErrorAndClose(id, OutOfOrderError(v1::INVALID_REQUEST, "send RankHello first"));
    return;
  }
  if (message.has_registration()) {
    HandleRegistration(s.rank, message.registration());
  } else if (message.has_manifests()) {
    HandleManifests(now, s.rank, message.manifests());
  } else if (message.has_adapter_counts()) {
    HandleAdapterCounts(s.rank, message.adapter_counts());
  }
}

void SidecarJob::HandleAdapterCounts(int rank, const v1::AdapterCounts& counts) {
  if (counts.redone() < 0 || counts.redone() > counts.repaired() ||
      counts.repaired() > counts.speculated()) {
    ACCORD_LOG(WARNING) << "job " << node_.job_id() << " rank " << rank
                        << ": ignored adapter counts that do not hold 0 <= redone <= repaired "
                           "<= speculated ("
                        << counts.ShortDebugString() << ")";
    return;
  }
  v1::AdapterCounts& last = adapter_last_[rank];
  const bool same_process = counts.speculated() >= last.speculated() &&
                            counts.repaired() >= last.repaired() &&
                            counts.redone() >= last.redone();
  if (!same_process) last.Clear();
  stats_.adapter_speculated += counts.speculated() - last.speculated();
  stats_.adapter_repaired += counts.repaired() - last.repaired();
  stats_.adapter_redone += counts.redone() - last.redone();
  last = counts;
}

namespace {

// A RankHello token that is not `expected` (the job's), or missing where
// one is required: the refusal, else nullopt.
std::optional<v1::DecisionError> TokenRefusal(const v1::RankHello& hello,
                                              const std::string& expected, bool required) {
  if ((!hello.token().empty() && !expected.empty() && !TokensEqual(hello.token(), expected)) ||
      (hello.token().empty() && required)) {
    ACCORD_LOG(WARNING) << "permission denied: job " << hello.job_id() << " rank " << hello.rank()
                        << ": RankHello token "
                        << (hello.token().empty() ? "missing" : "differs from the job's");
    return KindedError(
        v1::PERMISSION_DENIED,
        absl::StrCat("job ", hello.job_id(), ": rank ", hello.rank(),
                     hello.token().empty()
                         ? " sent no token and this sidecar requires one (--require_rank_token)"
                         : " sent a token that is not the one this sidecar holds for the job",
                     "; check ACCORD_TOKEN / ClientOptions.token of the rank"));
  }
  return std::nullopt;
}

// Adds to `errors` (a rank's reply to its batch) the error decision for its
// manifest `about`.
void AddManifestError(v1::RankReply& errors, const std::string& job_id, int rank,
                      const v1::Manifest& about, v1::DecisionError error) {
  v1::Decision* d = errors.mutable_decisions()->add_decisions();
  d->set_group_id(about.group_id());
  d->set_step(about.step());
  *d->mutable_error() = std::move(error);
  d->mutable_error()->set_job_id(job_id);
  d->mutable_error()->set_group_id(about.group_id());
  d->mutable_error()->set_step(about.step());
  d->mutable_error()->add_ranks(rank);
}

}  // namespace

std::optional<v1::DecisionError> SidecarJob::CheckHello(const SidecarOptions& options,
                                                        const v1::RankHello& hello) {
  if (hello.job_id().empty()) {
    return KindedError(v1::INVALID_REQUEST, "RankHello without a job_id");
  }
  if (!options.job.empty() && hello.job_id() != options.job) {
    return KindedError(v1::PERMISSION_DENIED,
                       absl::StrCat("this sidecar serves job ", options.job, " (--job) only; rank ",
                                    hello.rank(), " belongs to job ", hello.job_id()));
  }
  if (!options.token.empty() || options.require_rank_token) {
    if (auto refused = TokenRefusal(hello, options.token, options.require_rank_token)) {
      return refused;
    }
  }
  if (hello.world_size() < 1) {
    return KindedError(v1::INVALID_REQUEST,
                       absl::StrCat("job ", hello.job_id(), ": world size ", hello.world_size()));
  }
  if (hello.rank() < 0 || hello.rank() >= hello.world_size()) {
    return KindedError(v1::INVALID_REQUEST,
                       absl::StrCat("job ", hello.job_id(), ": rank ", hello.rank(), " outside 0..",
                                    hello.world_size() - 1));
  }
  return std::nullopt;
}

std::vector<int> SidecarJob::ConnectedRanks() const {
  std::vector<int> out;
  for (const auto& [r, rs] : ranks_.connected) out.push_back(r);
  return out;
}

void SidecarJob::HandleHello(absl::Time now, SessionId id, Session& s, const v1::RankHello& hello) {
  if (std::optional<v1::DecisionError> refused = HelloRefusal(s, hello)) {
    refused->set_job_id(hello.job_id());
    refused->add_ranks(hello.rank());
    SendErrorAndClose(id, *refused);
    return;
  }
  AcceptRank(now, id, s, hello);
}

std::optional<v1::DecisionError> SidecarJob::HelloRefusal(const Session& s,
                                                          const v1::RankHello& hello) {
  if (s.rank >= 0) {
    return OutOfOrderError(v1::INVALID_REQUEST,
                           absl::StrCat("rank ", s.rank, " sent a second RankHello"));
  }
  if (std::optional<v1::DecisionError> refused = CheckHello(options_, hello)) return refused;
  if (node_.has_job() && hello.job_id() != node_.job_id()) {
    // SidecarJobs gives each job its own Sidecar; only a caller that drives
    // one Sidecar directly gets here.
    return OutOfOrderError(v1::INVALID_REQUEST,
                           absl::StrCat("this Sidecar holds the state of job ", node_.job_id(),
                                        "; rank ", hello.rank(), " of job ", hello.job_id(),
                                        " needs a Sidecar of its own (SidecarJobs)"));
  }
  if (options_.token.empty()) {
    // The job's token upstream is then the first rank's.
    if (auto refused = TokenRefusal(hello, node_.token(), /*required=*/false)) return refused;
  }
  if (std::optional<v1::DecisionError> refused = CheckResume(hello)) return refused;
  if (node_.has_job() && hello.world_size() != node_.world_size()) {
    return KindedError(
        v1::WORLD_SIZE_MISMATCH,
        absl::StrCat("job ", hello.job_id(), ": rank ", hello.rank(), " says world size ",
                     hello.world_size(), " but this node's other ranks say ", node_.world_size(),
                     "; check WORLD_SIZE of the launcher"));
  }
  if (ranks_.connected.count(hello.rank())) {
    return KindedError(
        v1::DUPLICATE_RANK,
        absl::StrCat("job ", hello.job_id(), ": rank ", hello.rank(),
                     " is already connected to this sidecar; check RANK of the local processes"));
  }
  if (static_cast<int>(ranks_.connected.size()) >= options_.max_ranks) {
    return KindedError(v1::LIMIT_EXCEEDED,
                       absl::StrCat("this sidecar already serves ", ranks_.connected.size(),
                                    " ranks (--max_ranks)"));
  }
  return std::nullopt;
}

void SidecarJob::AcceptRank(absl::Time now, SessionId id, Session& s, const v1::RankHello& hello) {
  if (!node_.has_job()) {
    // A rank that resumes a run creates this state: the sidecar was
    // restarted under the run, so it rejoins it (RESUME) as the same node
    // instead of starting a new run, and as the same incarnation of the
    // node's ranks (their epoch), so that even a sidecar restarted before it
    // learned the run is not taken for restarted ranks.
    // A late rank of a launch whose ranks have all left continues their
    // incarnation the same way (ContinueIncarnation).
    const bool continues = !hello.has_resume() && resume_.continued_epoch != 0;
    const std::string resume_run = hello.has_resume() ? hello.resume().run_id()
                                   : continues        ? resume_.continued_run
                                                      : "";
    const uint64_t resume_epoch = hello.has_resume() ? hello.resume().node_epoch()
                                  : continues        ? resume_.continued_epoch
                                                     : 0;
    node_.StartJob(hello.job_id(), hello.world_size(),
                   options_.token.empty() ? hello.token() : options_.token, resume_run,
                   resume_epoch);
    stats_.job_id = hello.job_id();
    resume_.fresh = !resume_run.empty();
    resume_.continued_run.clear();
    resume_.continued_epoch = 0;
    // The job's wait for the node above starts now, unless it answers.
    if (!upstream_.welcomed) StartUnanswered(now);
  }
  s.rank = hello.rank();
  RankState& rs = ranks_.connected[s.rank];
  rs.session = id;
  rs.key_scratch = Manifest();
  rs.key_scratch.ranks = RankSet(node_.world_size());
  rs.key_scratch.ranks.Add(s.rank);
  rs.resumed = hello.has_resume();
  rs.reconnects = hello.reconnects();
  ranks_.detached.erase(s.rank);
  rs.resume_decided.clear();
  for (const v1::GroupResume& g : hello.resume().groups()) {
    rs.resume_decided[g.group_id()] = g.decided_step();
  }
  if (rs.resumed) {
    ACCORD_LOG(INFO) << "job " << node_.job_id() << ": rank " << s.rank << " resumed run "
                     << hello.resume().run_id() << " (" << hello.resume().groups_size()
                     << " groups)" << (resume_.fresh ? " on this restarted sidecar" : "");
    std::vector<ReleaseCoalescer::Batch> flushed;
    upstream_.releases.RestartRank(s.rank, &flushed);
    SendBatches(flushed);
  }
  effects_.SendToSession(id, RankWelcome());
  if (rs.resumed && node_.announced().count(s.rank) != 0) {
    // A resumed rank this sidecar announced before left when its stream
    // ended: it joins again.
    v1::RankEvent joined;
    joined.set_rank(s.rank);
    joined.set_joined(true);
    node_.ForwardRankEvent(joined);
  } else {
    node_.AnnounceRanks({s.rank});
  }
}

void SidecarJob::HandleRegistration(int rank, const v1::GroupRegistration& reg) {
  GroupSpec spec;
  if (std::optional<v1::DecisionError> refused = RegistrationRefusal(rank, reg, &spec)) {
    RefuseRegistration(rank, reg.group_id(), *std::move(refused));
    return;
  }
  if (spec.members != nullptr && !node_.takes_members().has_value()) {
    upstream_.held.push_back(HeldRegistration{rank, reg});
    return;
  }
  RankState& rs = ranks_.connected[rank];
  LocalGroup& g = groups_.FindOrAdd(reg.group_id());
  // A later registration with other members goes up as is: the coordinator
  // words the mismatch for every rank.
  if (g.registrations.size() == 0) g.spec = std::move(spec);
  g.registrations.Add(reg, {rank});
  if (auto it = std::lower_bound(g.ranks.begin(), g.ranks.end(), rank);
      it == g.ranks.end() || *it != rank) {
    g.ranks.insert(it, rank);
  }
  rs.got_result[reg.group_id()] = false;
  if (auto d = rs.resume_decided.find(reg.group_id()); d != rs.resume_decided.end()) {
    // What this rank holds: a `same_as_previous` is passed to it as is.
    int64_t& delivered = rs.DeliveredSlot(g.index, groups_.size());
    delivered = std::max(delivered, d->second);
  }
  v1::NodeMessage up;
  *up.mutable_registration()->mutable_registration() = reg;
  up.mutable_registration()->add_ranks(rank);
  node_.Send(std::move(up));
}

std::optional<v1::DecisionError> SidecarJob::RegistrationRefusal(int rank,
                                                                 const v1::GroupRegistration& reg,
                                                                 GroupSpec* spec) const {
  const std::string who = absl::StrCat("job ", node_.job_id(), " rank ", rank);
  absl::StatusOr<GroupSpec> parsed = wire::GroupSpecFromProto(reg, node_.world_size());
  if (!parsed.ok()) {
    return ErrorFromStatus(v1::INVALID_REQUEST, parsed.status(), absl::StrCat(who, ": "));
  }
  if (absl::StatusOr<Policy> p = wire::PolicyFromProto(reg.policy()); !p.ok()) {
    return ErrorFromStatus(v1::INVALID_REQUEST, p.status(),
                           absl::StrCat(who, " group \"", reg.group_id(), "\": "));
  }
  if (const MemberSet* m = parsed->members.get(); m != nullptr) {
    if (!m->Contains(rank)) {
      return KindedError(v1::INVALID_REQUEST,
                         absl::StrCat(who, " group \"", reg.group_id(), "\": rank ", rank,
                                      " is not among its members (", m->Describe(),
                                      "); a rank registers only the groups it reduces"));
    }
    if (node_.takes_members() == false) {
      return ErrorFromStatus(
          v1::INVALID_REQUEST,
          absl::FailedPreconditionError(
              absl::StrCat("group \"", reg.group_id(), "\" has members (", m->Describe(),
                           ") but the coordinator or relay above sidecar \"", options_.node_id,
                           "\" is older than groups with members; upgrade it")),
          absl::StrCat(who, ": "));
    }
  }
  *spec = *std::move(parsed);
  return std::nullopt;
}

void SidecarJob::RefuseRegistration(int rank, const std::string& group_id, v1::DecisionError e) {
  v1::RankReply reply;
  reply.mutable_registration()->set_group_id(group_id);
  e.set_job_id(node_.job_id());
  e.set_group_id(group_id);
  *reply.mutable_registration()->mutable_error() = std::move(e);
  SendToRank(rank, std::move(reply));
}

void SidecarJob::ReleaseHeldRegistrations() {
  std::vector<HeldRegistration> held = std::move(upstream_.held);
  upstream_.held.clear();
  for (const HeldRegistration& h : held) {
    if (ranks_.connected.count(h.rank) != 0) HandleRegistration(h.rank, h.registration);
  }
}

void SidecarJob::HandleManifests(absl::Time now, int rank, const v1::ManifestBatch& batch) {
  RankState& rs = ranks_.connected[rank];
  v1::RankReply errors;
  if (batch.repeat_batch_key() != 0) {
    // Batch repeats are a sidecar -> coordinator form only.
    v1::RankReply reply;
    *reply.mutable_error() = KindedError(
        v1::INVALID_REQUEST,
        absl::StrCat("job ", node_.job_id(), " rank ", rank, " step ", batch.repeat_step(),
                     ": a rank must send manifests, not a batch repeat record; check "
                     "the client library's version"));
    reply.mutable_error()->add_ranks(rank);
    SendToRank(rank, std::move(reply));
    return;
  }
  const uint64_t epoch = ++scratch_.touch_epoch;
  scratch_.touched.clear();
  // A release batch counts in its sync class even when it completes nothing.
  const ReleaseCoalescer::Release release =
      upstream_.releases.NoteRelease(rank, job_failure_.has_value() ? 0 : batch.sync_key());
  for (const v1::Manifest& m : batch.manifests()) {
    HandleRankManifest(now, rank, rs, m, epoch, errors);
  }
  if (errors.decisions().decisions_size() > 0) SendToRank(rank, std::move(errors));
  SendLate();
  // Registration order: the same groups go up in the same order every step,
  // whichever rank completes them (what batch repeats match on).
  std::sort(scratch_.touched.begin(), scratch_.touched.end(),
            [](const LocalGroup* a, const LocalGroup* b) { return a->index < b->index; });
  // Collected as (group, step, key) first: a batch that repeats the previous
  // one goes up as a batch repeat without building its manifests.
  for (LocalGroup* g : scratch_.touched) CollectComplete(now, *g, &scratch_.outgoing);
  DeliverLocalDecisions();
  SendCompleted(now, release);
}

// One manifest of a rank's batch: added to its group's local step (the group
// noted in scratch_.touched once per batch, `epoch`), or an answer for the
// rank in `errors`.
void SidecarJob::HandleRankManifest(absl::Time now, int rank, RankState& rs, const v1::Manifest& m,
                                    uint64_t epoch, v1::RankReply& errors) {
  ++stats_.rank_manifests;
  LocalGroup* g = groups_.Find(m.group_id());
  if (g == nullptr || !std::binary_search(g->ranks.begin(), g->ranks.end(), rank)) {
    AddManifestError(
        errors, node_.job_id(), rank, m,
        KindedError(v1::UNKNOWN_GROUP,
                    absl::StrCat("job ", node_.job_id(), " rank ", rank, ": manifest for group \"",
                                 m.group_id(), "\" which this rank has not registered")));
    return;
  }
  if (m.step() <= g->decided.step) {
    AnswerDecidedStep(rank, rs, *g, m, errors);
    return;
  }
  if (job_failure_.has_value()) {
    *errors.mutable_decisions()->add_decisions() = JobFailureAt(*g, m.step());
    return;
  }
  uint64_t full_key = 0;
  v1::DecisionError refused;
  const std::vector<DTypeMask>* content = RankContent(rank, rs, *g, m, &full_key, &refused);
  if (content == nullptr) {
    AddManifestError(errors, node_.job_id(), rank, m, std::move(refused));
    return;
  }
  if (!AddRankRow(now, rank, *g, m, *content, errors)) return;
  if (!m.repeat()) g->collect.RememberFull(rank, full_key, *content);
  rs.last_step = std::max(rs.last_step, m.step());
  int64_t& submitted = rs.SubmittedSlot(g->index, groups_.size());
  submitted = std::max(submitted, m.step());
  if (g->collect.touched_epoch != epoch) {
    g->collect.touched_epoch = epoch;
    scratch_.touched.push_back(g);
  }
}

void SidecarJob::AnswerDecidedStep(int rank, RankState& rs, const LocalGroup& g,
                                   const v1::Manifest& m, v1::RankReply& errors) {
  if (m.step() == g.decided.step && g.decided.error.has_value()) {
    // The step already failed for the job (e.g. missing ranks) before this
    // rank submitted it: the same error every other rank got.
    *errors.mutable_decisions()->add_decisions() = *g.decided.error;
    return;
  }
  if (rs.resumed && m.step() == g.decided.step && g.decided.ok.has_value()) {
    // A resumed rank resends a step this sidecar saw decided (its decision
    // was lost with the rank's previous stream): the same decision.
    v1::Decision* d = errors.mutable_decisions()->add_decisions();
    d->set_group_id(g.group_id);
    d->set_step(m.step());
    *d->mutable_ok() = *g.decided.ok;
    int64_t& delivered = rs.DeliveredSlot(g.index, groups_.size());
    delivered = std::max(delivered, m.step());
    return;
  }
  AddManifestError(
      errors, node_.job_id(), rank, m,
      KindedError(v1::STEP_REGRESSION,
                  absl::StrCat("job ", node_.job_id(), " rank ", rank, " group \"", m.group_id(),
                               "\" step ", m.step(), ": older than the last decided step ",
                               g.decided.step)));
}

bool SidecarJob::AddRankRow(absl::Time now, int rank, LocalGroup& g, const v1::Manifest& m,
                            const std::vector<DTypeMask>& content, v1::RankReply& errors) {
  LocalStep& st = g.collect.StepFor(m.step());
  if (st.ranks.empty()) NoteStepStarted(now, st);
  switch (StepCollection::AddRow(st, rank, content)) {
    case StepCollection::Row::kAdded:
      if (st.sent) {
        // The step's node manifest went up without this rank (it resumed
        // after its node-mates): its part goes up alone (SendLate).
        scratch_.late.push_back(Late{&g, m.step(), rank, content});
      }
      return true;
    case StepCollection::Row::kSame:
      return false;  // a resend of the same content: a no-op
    case StepCollection::Row::kDiffers:
      AddManifestError(errors, node_.job_id(), rank, m,
                       OutOfOrderError(v1::INVALID_MANIFEST,
                                       absl::StrCat("job ", node_.job_id(), " rank ", rank,
                                                    " group \"", m.group_id(), "\" step ", m.step(),
                                                    ": a second, different manifest for the "
                                                    "same step")));
      return false;
  }
  return false;
}

const std::vector<DTypeMask>* SidecarJob::RankContent(int rank, RankState& rs, const LocalGroup& g,
                                                      const v1::Manifest& m, uint64_t* full_key,
                                                      v1::DecisionError* refused) {
  if (m.repeat()) {
    // A repeat names this rank's previous full manifest for the group by its
    // key (validated when it arrived).
    const LastFull* last = g.collect.LastFullOf(rank);
    if (last == nullptr || last->key != m.cache_key()) {
      *refused = OutOfOrderError(
          v1::INVALID_MANIFEST,
          absl::StrCat("job ", node_.job_id(), " rank ", rank, " group \"", m.group_id(),
                       "\" step ", m.step(), ": repeat of cache key ", m.cache_key(),
                       " which is not this rank's previous manifest; send the full form"));
      return nullptr;
    }
    return &last->dtypes;
  }
  std::vector<DTypeMask>& parsed = rs.key_scratch.dtypes;
  absl::Status valid = wire::ManifestDTypesFromProto(m, g.spec.params.size(), &parsed);
  if (valid.ok() && !m.rank_bits().empty()) {
    valid = absl::InvalidArgumentError(
        absl::StrCat("manifest for group \"", m.group_id(), "\" step ", m.step(),
                     ": a rank's manifest must not carry rank_bits"));
  }
  if (!valid.ok()) {
    const bool non_float = wire::KindOf(valid) == v1::NON_FLOAT_DTYPE;
    *refused =
        KindedError(non_float ? v1::NON_FLOAT_DTYPE : v1::INVALID_MANIFEST,
                    absl::StrCat("job ", node_.job_id(), " rank ", rank, ": ", valid.message()));
    return nullptr;
  }
  // The key covers content, not the step; recompute it so a client that did
  // not set one still gets repeats resolved correctly.
  *full_key = ManifestKey(rs.key_scratch);
  return &parsed;
}

void SidecarJob::CollectComplete(absl::Time now, LocalGroup& g, std::vector<Outgoing>* out) {
  const size_t num_params = g.spec.params.size();
  for (LocalStep& st : g.collect.steps) {
    if (st.sent || st.ranks.empty()) continue;
    bool complete = true;
    for (int r : g.ranks) {
      if (ranks_.connected.count(r) && !std::binary_search(st.ranks.begin(), st.ranks.end(), r) &&
          !HoldsDecision(r, g, st.step)) {
        complete = false;
        break;
      }
    }
    if (!complete) break;  // later steps wait for this one (per-stream order)
    st.sent = true;
    // Ranks whose usage differs from the node's merged usage travel as detail.
    UsageDetail& detail = scratch_.detail;
    UsageDetailOf(st, num_params, &detail);
    // Without rank_bits: the announced ranks among the group's members.
    const bool with_ranks = !node_.IsAnnounced(st.ranks, g.members());
    const bool same_content = g.form.full != nullptr && st.ranks == g.form.covered &&
                              st.merged == g.form.merged && detail == g.form.detail;
    if (!same_content || with_ranks != g.form.with_ranks) {
      // A new node manifest: build its full form once; later steps with the
      // same content share it.
      Manifest merged;
      merged.step = st.step;
      merged.dtypes = st.merged;
      merged.ranks = RankSet(node_.world_size());
      for (int r : st.ranks) merged.ranks.Add(r);
      auto full = std::make_shared<v1::Manifest>();
      wire::ManifestToProto(g.group_id, merged, with_ranks, full.get());
      full->clear_step();
      for (const RankUsageBits& d : detail) {
        v1::RankUsage* u = full->add_rank_detail();
        u->set_rank(d.rank);
        u->set_used_bits(d.used_bits);
      }
      g.form.key = full->cache_key();
      g.form.covered = st.ranks;
      g.form.merged = st.merged;
      g.form.detail = detail;
      g.form.with_ranks = with_ranks;
      g.form.full = std::move(full);
      ++g.form.content_gen;
    }
    g.inflight.Add(st.step, g.form.full, node_.announced().size());
    if (g.form.repeat.Repeats(g.form.key, detail)) {
      out->push_back(Outgoing{&g, st.step, /*repeat=*/true, g.form.key, nullptr});
      ++stats_.node_manifests_repeat;
    } else {
      out->push_back(Outgoing{&g, st.step, /*repeat=*/false, g.form.key, g.form.full});
      ++stats_.node_manifests_full;
    }
    g.form.repeat.Sent(g.form.key, detail);
    if (options_.local_decisions) DecideLocally(now, g, st);
  }
}

void SidecarJob::CloseSession(absl::Time now, SessionId id) {
  auto it = ranks_.sessions.find(id);
  if (it == ranks_.sessions.end()) return;
  const int rank = it->second.rank;
  ranks_.sessions.erase(it);
  auto rit = ranks_.connected.find(rank);
  if (rank < 0 || rit == ranks_.connected.end() || rit->second.session != id) return;
  const int64_t last_step = rit->second.last_step;
  const bool detach =
      rit->second.reconnects && options_.rank_reconnect_grace > absl::ZeroDuration();
  ranks_.connected.erase(rit);
  std::erase_if(upstream_.held, [rank](const HeldRegistration& h) { return h.rank == rank; });
  if (detach) {
    // It may come back (RankHello.resume) within the grace; its leave goes
    // upstream only then (ExpireDetached).
    const absl::Time until = now + options_.rank_reconnect_grace;
    ranks_.detached[rank] = Detached{until, last_step};
    effects_.ArmTimer(until);
    ACCORD_LOG(INFO) << "job " << node_.job_id() << ": rank " << rank
                     << "'s stream ended (last step " << last_step << "); it has "
                     << absl::FormatDuration(options_.rank_reconnect_grace)
                     << " (--rank_reconnect_grace) to come back";
  } else {
    ACCORD_LOG(INFO) << "job " << node_.job_id() << ": rank " << rank << " left (last step "
                     << last_step << ")";
  }
  if (ranks_.none()) {
    // The node's last rank: its leave goes up before the job's stream ends
    // (which writes what is queued first), so the coordinator names it at
    // once instead of waiting out the node's reconnect grace.
    std::vector<ReleaseCoalescer::Batch> flushed;
    upstream_.releases.RemoveRank(rank, &flushed);
    SendBatches(flushed);
    node_.LeaveRank(rank, last_step);
    ResetJob();
    return;
  }
  // Its class's held manifests go first (earlier steps), then the steps
  // that only waited for this rank, which are now complete: they go up
  // before the rank's leave, so that when the leave fails a step at the
  // coordinator, the node-mates that submitted it are known to have done so
  // and are not named as missing.
  std::vector<ReleaseCoalescer::Batch> flushed;
  if (detach) {
    upstream_.releases.FlushClassesOf(rank, &flushed);
  } else {
    upstream_.releases.RemoveRank(rank, &flushed);
  }
  SendBatches(flushed);
  for (LocalGroup* g : groups_.ordered()) {
    g->ranks.erase(std::remove(g->ranks.begin(), g->ranks.end(), rank), g->ranks.end());
    CollectComplete(now, *g, &scratch_.outgoing);
  }
  DeliverLocalDecisions();
  SendCompleted(now, ReleaseCoalescer::Release{});
  if (detach) return;
  node_.LeaveRank(rank, last_step);
}

void SidecarJob::ResetJob() {
  ACCORD_LOG(INFO) << "job " << node_.job_id() << ": no rank left on this node; resetting";
  node_.EndJob();
  upstream_.loss.EndJob();
  resume_ = ResumeState();
  job_failure_.reset();
  scratch_.late.clear();
  ranks_.detached.clear();
  upstream_.held.clear();
  upstream_.releases.Clear();
  adapter_last_.clear();  // the next ranks are new processes
  groups_.Clear();
  if (options_.reset_when_empty) node_.sink()->Reconnect();
}

absl::Time SidecarJob::ExpireDetached(absl::Time now) {
  absl::Time next = absl::InfiniteFuture();
  for (auto it = ranks_.detached.begin(); it != ranks_.detached.end();) {
    if (it->second.until > now) {
      next = std::min(next, it->second.until);
      ++it;
      continue;
    }
    ACCORD_LOG(WARNING) << "job " << node_.job_id() << ": rank " << it->first
                        << " did not come back within "
                        << absl::FormatDuration(options_.rank_reconnect_grace)
                        << " (--rank_reconnect_grace); it left";
    std::vector<ReleaseCoalescer::Batch> flushed;
    upstream_.releases.RemoveRank(it->first, &flushed);
    SendBatches(flushed);
    node_.LeaveRank(it->first, it->second.last_step);
    it = ranks_.detached.erase(it);
  }
  if (ranks_.none() && node_.has_job()) ResetJob();
  return next;
}

std::optional<v1::DecisionError> SidecarJob::CheckResume(const v1::RankHello& hello) {
  if (resume_.refusal.has_value()) return resume_.refusal;
  if (!hello.has_resume()) return std::nullopt;
  const v1::RankResume& resume = hello.resume();
  if (resume.holds_local_decisions() && (!node_.has_job() || resume_.fresh)) {
    // What this node decided alone died with the previous sidecar process:
    // nobody can tell which of those decisions the coordinator confirmed,
    // so ranks could end up with different decisions. The node's ranks all
    // get this one error instead (docs/RELIABILITY.md, "Sidecar restart").
    v1::DecisionError e = KindedError(
        v1::RUN_ENDED,
        absl::StrCat("job ", hello.job_id(), " run ", resume.run_id(), ": the sidecar of node \"",
                     options_.node_id,
                     "\" was restarted while it decided this single-node job's steps itself "
                     "(--local_decisions), and its ranks hold decisions the coordinator may not "
                     "have confirmed, so the run cannot resume without risking different "
                     "decisions on different ranks; restart the job (run the sidecar with "
                     "--local_decisions=false for single-node jobs that must survive a sidecar "
                     "restart)"));
    e.set_job_id(hello.job_id());
    ACCORD_LOG(ERROR) << e.message();
    resume_.refusal = e;
    FailRanks(e);
    return e;
  }
  if (!resume.run_id().empty() && !node_.run_id().empty() && resume.run_id() != node_.run_id()) {
    return KindedError(
        v1::RUN_ENDED,
        absl::StrCat("job ", hello.job_id(), ": rank ", hello.rank(), " resumes run ",
                     resume.run_id(), " but this sidecar serves run ", node_.run_id(),
                     " of the job (a newer launch); stop the ranks of the old run"));
  }
  return std::nullopt;
}

bool SidecarJob::HoldsDecision(int rank, const LocalGroup& g, int64_t step) const {
  auto it = ranks_.connected.find(rank);
  if (it == ranks_.connected.end() || !it->second.resumed) return false;
  auto d = it->second.resume_decided.find(g.group_id);
  return d != it->second.resume_decided.end() && d->second >= step;
}

void SidecarJob::SendLate() {
  if (scratch_.late.empty()) return;
  v1::NodeMessage up;
  for (Late& l : scratch_.late) {
    Manifest one;
    one.step = l.step;
    one.dtypes = std::move(l.content);
    one.ranks = RankSet(node_.world_size());
    one.ranks.Add(l.rank);
    v1::Manifest* m = up.mutable_manifests()->add_manifests();
    wire::ManifestToProto(l.group->group_id, one, /*with_ranks=*/true, m);
    // Kept until decided, like the node's manifests: a new stream sends it
    // again.
    auto kept = std::make_shared<v1::Manifest>(*m);
    l.group->inflight.Add(l.step, std::move(kept), node_.announced().size());
    m->set_step(l.step);
    // The coordinator's previous manifest of the node for the group is this
    // one now: the group's next node manifest goes in full form.
    l.group->form.repeat.Forget();
    ++stats_.node_manifests_full;
  }
  scratch_.late.clear();
  node_.SendNewBatch(std::move(up));
}

}  // namespace accord::daemon
