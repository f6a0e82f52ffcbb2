#include "daemon/sidecar/sidecar.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "daemon/common/auth_tokens.h"
#include "daemon/common/decision_errors.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

constexpr char kServerVersion[] = "accord-sidecar/0.1";

absl::Status ErrorStatus(const v1::DecisionError& e) { return wire::ErrorToStatus(e); }

}  // namespace

Sidecar::Sidecar(SidecarOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : RealClock::Get()),
      node_(options_.node_id) {
  if (options_.start_timer_thread) timer_ = std::thread([this] { TimerLoop(); });
}

Sidecar::~Sidecar() { Stop(); }

void Sidecar::Stop() {
  {
    accord::MutexLock l(&mu_);
    stopping_ = true;
    timer_cv_.SignalAll();
  }
  if (timer_.joinable()) timer_.join();
}

void Sidecar::TimerLoop() {
  accord::MutexLock l(&mu_);
  while (!stopping_) {
    if (timer_armed_ && clock_->Now() >= timer_at_) {
      CheckPartialStepsLocked();
      continue;
    }
    clock_->WaitUntil(&timer_cv_, &mu_, timer_armed_ ? timer_at_ : absl::InfiniteFuture());
  }
}

void Sidecar::ArmTimerLocked(absl::Time at) {
  if (timer_armed_ && timer_at_ <= at) return;
  timer_armed_ = true;
  timer_at_ = at;
  timer_cv_.SignalAll();
}

void Sidecar::NoteStepStartedLocked(LocalStep& st) {
  st.first_seen = clock_->Now();
  st.partial_reported = false;
  if (report_after_ > absl::ZeroDuration() && !timer_armed_) {
    ArmTimerLocked(st.first_seen + report_after_);
  }
}

void Sidecar::CheckPartialSteps() {
  accord::MutexLock l(&mu_);
  CheckPartialStepsLocked();
}

void Sidecar::CheckPartialStepsLocked() {
  timer_armed_ = false;
  timer_at_ = absl::InfiniteFuture();
  if (report_after_ <= absl::ZeroDuration() || node_.sink() == nullptr) return;
  const absl::Time now = clock_->Now();
  absl::Time next = absl::InfiniteFuture();
  for (LocalGroup* g : group_order_) {
    for (LocalStep& st : g->steps) {
      if (st.sent || st.ranks.empty() || st.partial_reported) continue;
      const absl::Time due = st.first_seen + report_after_;
      if (due > now) {
        next = std::min(next, due);
        continue;
      }
      // Some local ranks submitted this step long ago and the node manifest
      // still waits for the others: tell the coordinator, so that its
      // deadline runs even when no node sends a manifest for the step.
      st.partial_reported = true;
      v1::NodeMessage up;
      v1::NodeProgress* p = up.mutable_progress();
      p->set_group_id(g->group_id);
      p->set_step(st.step);
      p->set_partial(true);
      p->set_waited_us(absl::ToInt64Microseconds(now - st.first_seen));
      for (int r : st.ranks) p->add_reported(r);
      for (const auto& [r, rs] : ranks_) {
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
  if (next != absl::InfiniteFuture()) ArmTimerLocked(next);
}

void Sidecar::SetUpstream(UpstreamSink* upstream) {
  accord::MutexLock l(&mu_);
  node_.SetSink(upstream);
}

Sidecar::RunStamp Sidecar::CurrentRun() {
  accord::MutexLock l(&mu_);
  return RunStamp{node_.job_id(), node_.run_id(), options_.node_id, node_.epoch()};
}

SidecarStats Sidecar::stats() {
  accord::MutexLock l(&mu_);
  SidecarStats s = stats_;
  s.ranks = static_cast<int>(ranks_.size());
  s.sessions = static_cast<int>(sessions_.size());
  s.job_id = node_.has_job() ? node_.job_id() : last_job_id_;
  return s;
}

Sidecar::SessionId Sidecar::OpenRank(RankSink* sink) {
  accord::MutexLock l(&mu_);
  const SessionId id = next_session_++;
  sessions_[id].sink = sink;
  return id;
}

void Sidecar::SendToRankLocked(int rank, v1::RankReply reply) {
  auto it = ranks_.find(rank);
  if (it == ranks_.end() || it->second.sink == nullptr) return;
  it->second.sink->Send(std::make_shared<const v1::RankReply>(std::move(reply)));
}

void Sidecar::SendBatchRepeatLocked(int64_t step) {
  ++stats_.node_batch_repeats;
  node_.SendBatchRepeat(step);
}

void Sidecar::SendOutgoingLocked(std::vector<Outgoing>& items) {
  if (items.empty()) return;
  const int64_t step = items[0].step;
  const wire::StreamBatchRecord& previous = node_.previous_batch();
  bool same = node_.batch_repeat() && items.size() == previous.size();
  for (size_t i = 0; same && i < items.size(); ++i) {
    const Outgoing& o = items[i];
    same = o.repeat && o.step == step && previous.Matches(i, o.group->group_id, o.key);
  }
  if (same) {
    SendBatchRepeatLocked(step);
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

void Sidecar::HandleRankMessage(SessionId id, const v1::RankMessage& message) {
  accord::MutexLock l(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  Session& s = it->second;
  if (message.has_hello()) {
    HandleHelloLocked(id, s, message.hello());
    return;
  }
  if (s.rank < 0) {
    v1::RankReply reply;
    *reply.mutable_error() = OutOfOrderError(v1::INVALID_REQUEST, "send RankHello first");
    s.sink->Send(std::make_shared<const v1::RankReply>(reply));
    s.sink->Close(ErrorStatus(reply.error()));
    return;
  }
  if (message.has_registration()) {
    HandleRegistrationLocked(s.rank, message.registration());
  } else if (message.has_manifests()) {
    HandleManifestsLocked(s.rank, message.manifests());
  }
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

}  // namespace

std::optional<v1::DecisionError> Sidecar::CheckHello(const SidecarOptions& options,
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

bool Sidecar::HadRank(int rank) {
  accord::MutexLock l(&mu_);
  return node_.announced().count(rank) != 0;
}

std::vector<int> Sidecar::ConnectedRanks() {
  accord::MutexLock l(&mu_);
  std::vector<int> out;
  for (const auto& [r, rs] : ranks_) out.push_back(r);
  return out;
}

void Sidecar::HandleHelloLocked(SessionId id, Session& s, const v1::RankHello& hello) {
  auto refuse = [&](v1::DecisionError error) {
    v1::RankReply reply;
    *reply.mutable_error() = std::move(error);
    reply.mutable_error()->set_job_id(hello.job_id());
    reply.mutable_error()->add_ranks(hello.rank());
    s.sink->Send(std::make_shared<const v1::RankReply>(reply));
    s.sink->Close(ErrorStatus(reply.error()));
  };
  if (s.rank >= 0) {
    refuse(OutOfOrderError(v1::INVALID_REQUEST,
                           absl::StrCat("rank ", s.rank, " sent a second RankHello")));
    return;
  }
  if (std::optional<v1::DecisionError> refused = CheckHello(options_, hello)) {
    refuse(*std::move(refused));
    return;
  }
  if (node_.has_job() && hello.job_id() != node_.job_id()) {
    // SidecarJobs gives each job its own Sidecar; only a caller that drives
    // one Sidecar directly gets here.
    refuse(OutOfOrderError(v1::INVALID_REQUEST,
                           absl::StrCat("this Sidecar holds the state of job ", node_.job_id(),
                                        "; rank ", hello.rank(), " of job ", hello.job_id(),
                                        " needs a Sidecar of its own (SidecarJobs)")));
    return;
  }
  if (options_.token.empty()) {
    // The job's token upstream is then the first rank's.
    if (auto refused = TokenRefusal(hello, node_.token(), /*required=*/false)) {
      refuse(*std::move(refused));
      return;
    }
  }
  if (node_.has_job() && hello.world_size() != node_.world_size()) {
    refuse(KindedError(
        v1::WORLD_SIZE_MISMATCH,
        absl::StrCat("job ", hello.job_id(), ": rank ", hello.rank(), " says world size ",
                     hello.world_size(), " but this node's other ranks say ", node_.world_size(),
                     "; check WORLD_SIZE of the launcher")));
    return;
  }
  if (ranks_.count(hello.rank())) {
    refuse(
        KindedError(v1::DUPLICATE_RANK,
                    absl::StrCat("job ", hello.job_id(), ": rank ", hello.rank(),
                                 " is already connected to this sidecar; check RANK of the local "
                                 "processes")));
    return;
  }
  if (static_cast<int>(ranks_.size()) >= options_.max_ranks) {
    refuse(KindedError(v1::LIMIT_EXCEEDED, absl::StrCat("this sidecar already serves ",
                                                        ranks_.size(), " ranks (--max_ranks)")));
    return;
  }
  if (!node_.has_job()) {
    node_.StartJob(hello.job_id(), hello.world_size(),
                   options_.token.empty() ? hello.token() : options_.token);
  }
  s.rank = hello.rank();
  RankState& rs = ranks_[s.rank];
  rs.session = id;
  rs.sink = s.sink;
  rs.key_scratch = Manifest();
  rs.key_scratch.ranks = RankSet(node_.world_size());
  rs.key_scratch.ranks.Add(s.rank);
  v1::RankReply welcome;
  welcome.mutable_welcome()->set_node_id(options_.node_id);
  welcome.mutable_welcome()->set_server_version(kServerVersion);
  s.sink->Send(std::make_shared<const v1::RankReply>(std::move(welcome)));
  node_.AnnounceRanks({s.rank});
}

void Sidecar::HandleRegistrationLocked(int rank, const v1::GroupRegistration& reg) {
  RankState& rs = ranks_[rank];
  auto reply_error = [&](v1::DecisionError e) {
    v1::RankReply reply;
    reply.mutable_registration()->set_group_id(reg.group_id());
    e.set_job_id(node_.job_id());
    e.set_group_id(reg.group_id());
    *reply.mutable_registration()->mutable_error() = std::move(e);
    SendToRankLocked(rank, std::move(reply));
  };
  absl::StatusOr<GroupSpec> spec = wire::GroupSpecFromProto(reg);
  if (!spec.ok()) {
    reply_error(ErrorFromStatus(v1::INVALID_REQUEST, spec.status(),
                                absl::StrCat("job ", node_.job_id(), " rank ", rank, ": ")));
    return;
  }
  if (absl::StatusOr<Policy> p = wire::PolicyFromProto(reg.policy()); !p.ok()) {
    reply_error(ErrorFromStatus(
        v1::INVALID_REQUEST, p.status(),
        absl::StrCat("job ", node_.job_id(), " rank ", rank, " group \"", reg.group_id(), "\": ")));
    return;
  }
  auto [git, inserted] = groups_.try_emplace(reg.group_id());
  LocalGroup& g = git->second;
  if (inserted) {
    g.group_id = reg.group_id();
    g.index = static_cast<int>(group_order_.size());
    group_order_.push_back(&g);
  }
  if (g.registrations.size() == 0) g.spec = *spec;
  g.registrations.Add(reg, {rank});
  if (auto it = std::lower_bound(g.ranks.begin(), g.ranks.end(), rank);
      it == g.ranks.end() || *it != rank) {
    g.ranks.insert(it, rank);
  }
  rs.got_result[reg.group_id()] = false;
  v1::NodeMessage up;
  *up.mutable_registration()->mutable_registration() = reg;
  up.mutable_registration()->add_ranks(rank);
  node_.Send(std::move(up));
}

Sidecar::LocalStep& Sidecar::StepFor(LocalGroup& g, int64_t step) {
  auto it = std::lower_bound(g.steps.begin(), g.steps.end(), step,
                             [](const LocalStep& st, int64_t s) { return st.step < s; });
  if (it != g.steps.end() && it->step == step) return *it;
  LocalStep fresh;
  if (!g.spare.empty()) {
    fresh = std::move(g.spare.back());
    g.spare.pop_back();
  }
  fresh.step = step;
  fresh.sent = false;
  fresh.ranks.clear();
  fresh.rows.clear();
  fresh.merged.clear();
  return *g.steps.insert(it, std::move(fresh));
}

void Sidecar::DropStepsUpTo(LocalGroup& g, int64_t step, bool keep_inflight) {
  size_t n = 0;
  while (n < g.steps.size() && g.steps[n].step <= step) ++n;
  for (size_t i = 0; i < n; ++i) g.spare.push_back(std::move(g.steps[i]));
  g.steps.erase(g.steps.begin(), g.steps.begin() + n);
  if (keep_inflight) return;  // resent until the coordinator decided them
  g.inflight.DropUpTo(step);
}

void Sidecar::HandleManifestsLocked(int rank, const v1::ManifestBatch& batch) {
  RankState& rs = ranks_[rank];
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
    SendToRankLocked(rank, std::move(reply));
    return;
  }
  const uint64_t epoch = ++touch_epoch_;
  touched_.clear();
  for (const v1::Manifest& m : batch.manifests()) {
    HandleRankManifestLocked(rank, rs, m, epoch, errors);
  }
  if (errors.decisions().decisions_size() > 0) SendToRankLocked(rank, std::move(errors));
  if (touched_.empty()) return;
  // Registration order: the same groups go up in the same order every step,
  // whichever rank completes them (what batch repeats match on).
  std::sort(touched_.begin(), touched_.end(),
            [](const LocalGroup* a, const LocalGroup* b) { return a->index < b->index; });
  // Collected as (group, step, key) first: a batch that repeats the previous
  // one goes up as a batch repeat without building its manifests.
  for (LocalGroup* g : touched_) CollectCompleteLocked(*g, &outgoing_);
  DeliverLocalDecisionsLocked();
  SendOutgoingLocked(outgoing_);
}

// One manifest of a rank's batch: added to its group's local step (the group
// noted in touched_ once per batch, `epoch`), or an error for the rank in
// `errors`.
void Sidecar::HandleRankManifestLocked(int rank, RankState& rs, const v1::Manifest& m,
                                       uint64_t epoch, v1::RankReply& errors) {
  auto reply_error = [&](const v1::Manifest& about, v1::DecisionError error) {
    v1::Decision* d = errors.mutable_decisions()->add_decisions();
    d->set_group_id(about.group_id());
    d->set_step(about.step());
    *d->mutable_error() = std::move(error);
    d->mutable_error()->set_job_id(node_.job_id());
    d->mutable_error()->set_group_id(about.group_id());
    d->mutable_error()->set_step(about.step());
    d->mutable_error()->add_ranks(rank);
  };
  std::vector<DTypeMask>& parsed = rs.key_scratch.dtypes;
  ++stats_.rank_manifests;
  auto git = groups_.find(m.group_id());
  if (git == groups_.end() ||
      !std::binary_search(git->second.ranks.begin(), git->second.ranks.end(), rank)) {
    reply_error(
        m, KindedError(v1::UNKNOWN_GROUP, absl::StrCat("job ", node_.job_id(), " rank ", rank,
                                                       ": manifest for group \"", m.group_id(),
                                                       "\" which this rank has not registered")));
    return;
  }
  LocalGroup& g = git->second;
  if (m.step() == g.last_decided_step && g.last_error.has_value()) {
    // The step already failed for the job (e.g. missing ranks) before this
    // rank submitted it: the same error every other rank got.
    *errors.mutable_decisions()->add_decisions() = *g.last_error;
    return;
  }
  if (m.step() <= g.last_decided_step) {
    reply_error(
        m, KindedError(v1::STEP_REGRESSION,
                       absl::StrCat("job ", node_.job_id(), " rank ", rank, " group \"",
                                    m.group_id(), "\" step ", m.step(),
                                    ": older than the last decided step ", g.last_decided_step)));
    return;
  }
  const size_t num_params = g.spec.params.size();
  auto last = std::lower_bound(g.last_full.begin(), g.last_full.end(), rank,
                               [](const LastFull& l, int r) { return l.rank < r; });
  const bool have_last = last != g.last_full.end() && last->rank == rank;
  // The content: a repeat names this rank's previous full manifest for the
  // group by its key (validated when it arrived); a full one is decoded.
  const std::vector<DTypeMask>* content;
  uint64_t full_key = 0;
  if (m.repeat()) {
    if (!have_last || last->key != m.cache_key()) {
      reply_error(
          m, OutOfOrderError(
                 v1::INVALID_MANIFEST,
                 absl::StrCat("job ", node_.job_id(), " rank ", rank, " group \"", m.group_id(),
                              "\" step ", m.step(), ": repeat of cache key ", m.cache_key(),
                              " which is not this rank's previous manifest; send the "
                              "full form")));
      return;
    }
    content = &last->dtypes;
  } else {
    absl::Status valid = wire::ManifestDTypesFromProto(m, num_params, &parsed);
    if (valid.ok() && !m.rank_bits().empty()) {
      valid = absl::InvalidArgumentError(
          absl::StrCat("manifest for group \"", m.group_id(), "\" step ", m.step(),
                       ": a rank's manifest must not carry rank_bits"));
    }
    if (!valid.ok()) {
      const bool non_float = wire::KindOf(valid) == v1::NON_FLOAT_DTYPE;
      reply_error(m, KindedError(non_float ? v1::NON_FLOAT_DTYPE : v1::INVALID_MANIFEST,
                                 absl::StrCat("job ", node_.job_id(), " rank ", rank, ": ",
                                              valid.message())));
      return;
    }
    // The key covers content, not the step; recompute it so a client that
    // did not set one still gets repeats resolved correctly.
    full_key = ManifestKey(rs.key_scratch);
    content = &parsed;
  }
  LocalStep& st = StepFor(g, m.step());
  if (st.ranks.empty()) NoteStepStartedLocked(st);
  auto pos = std::lower_bound(st.ranks.begin(), st.ranks.end(), rank);
  const size_t row = static_cast<size_t>(pos - st.ranks.begin());
  if (pos != st.ranks.end() && *pos == rank) {
    // A second manifest for the step: a resend of the same content is a
    // no-op, different content is an error.
    if (!std::equal(content->begin(), content->end(), st.rows.begin() + row * num_params)) {
      reply_error(m, OutOfOrderError(v1::INVALID_MANIFEST,
                                     absl::StrCat("job ", node_.job_id(), " rank ", rank,
                                                  " group \"", m.group_id(), "\" step ", m.step(),
                                                  ": a second, different manifest for the same "
                                                  "step")));
    }
    return;
  }
  st.ranks.insert(pos, rank);
  st.rows.insert(st.rows.begin() + row * num_params, content->begin(), content->end());
  if (st.merged.size() != num_params) st.merged.assign(num_params, 0);
  for (size_t i = 0; i < num_params; ++i) st.merged[i] |= (*content)[i];
  if (!m.repeat()) {
    if (!have_last) last = g.last_full.insert(last, LastFull{rank, 0, {}});
    last->key = full_key;
    last->dtypes.assign(parsed.begin(), parsed.end());
  }
  rs.last_step = std::max(rs.last_step, m.step());
  if (rs.submitted.size() <= static_cast<size_t>(g.index)) {
    rs.submitted.resize(group_order_.size(), -1);
  }
  rs.submitted[g.index] = std::max(rs.submitted[g.index], m.step());
  if (g.touched_epoch != epoch) {
    g.touched_epoch = epoch;
    touched_.push_back(&g);
  }
}

void Sidecar::CollectCompleteLocked(LocalGroup& g, std::vector<Outgoing>* out) {
  const size_t num_params = g.spec.params.size();
  for (LocalStep& st : g.steps) {
    if (st.sent || st.ranks.empty()) continue;
    bool complete = true;
    for (int r : g.ranks) {
      if (ranks_.count(r) && !std::binary_search(st.ranks.begin(), st.ranks.end(), r)) {
        complete = false;
        break;
      }
    }
    if (!complete) break;  // later steps wait for this one (per-stream order)
    st.sent = true;
    // Ranks whose usage differs from the node's merged usage travel as detail;
    // their (rank, used bits) pairs form the detail signature.
    std::string& detail = detail_scratch_;
    detail.clear();
    for (size_t k = 0; k < st.ranks.size(); ++k) {
      const DTypeMask* row = st.rows.data() + k * num_params;
      bool differs = false;
      for (size_t i = 0; i < num_params && !differs; ++i) {
        differs = (row[i] != 0) != (st.merged[i] != 0);
      }
      if (!differs) continue;
      const int r = st.ranks[k];
      detail.append(reinterpret_cast<const char*>(&r), sizeof(r));
      const size_t at = detail.size();
      detail.append((num_params + 7) / 8, '\0');
      for (size_t i = 0; i < num_params; ++i) {
        if (row[i] != 0)
          detail[at + i / 8] = static_cast<char>(detail[at + i / 8] | (1 << (i % 8)));
      }
    }
    const bool with_ranks = !std::equal(st.ranks.begin(), st.ranks.end(), node_.announced().begin(),
                                        node_.announced().end());
    const bool same_content = g.last_node_full != nullptr && st.ranks == g.last_node_covered &&
                              st.merged == g.last_node_merged && detail == g.last_node_detail;
    if (!same_content || with_ranks != g.last_node_with_ranks) {
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
      for (size_t at = 0; at < detail.size();) {
        int r;
        std::memcpy(&r, detail.data() + at, sizeof(r));
        at += sizeof(r);
        v1::RankUsage* u = full->add_rank_detail();
        u->set_rank(r);
        u->set_used_bits(detail.substr(at, (num_params + 7) / 8));
        at += (num_params + 7) / 8;
      }
      g.last_node_key = full->cache_key();
      g.last_node_covered = st.ranks;
      g.last_node_merged = st.merged;
      g.last_node_detail = detail;
      g.last_node_with_ranks = with_ranks;
      g.last_node_full = std::move(full);
      ++g.node_content_gen;
    }
    g.inflight.Add(st.step, g.last_node_full);
    if (g.have_last_sent && same_content) {
      out->push_back(Outgoing{&g, st.step, /*repeat=*/true, g.last_node_key, nullptr});
      ++stats_.node_manifests_repeat;
    } else {
      out->push_back(Outgoing{&g, st.step, /*repeat=*/false, g.last_node_key, g.last_node_full});
      ++stats_.node_manifests_full;
    }
    g.have_last_sent = true;
    if (options_.local_decisions) DecideLocallyLocked(g, st);
  }
}

void Sidecar::CloseRank(SessionId id) {
  accord::MutexLock l(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  const int rank = it->second.rank;
  sessions_.erase(it);
  auto rit = ranks_.find(rank);
  if (rank < 0 || rit == ranks_.end() || rit->second.session != id) return;
  const int64_t last_step = rit->second.last_step;
  ranks_.erase(rit);
  ACCORD_LOG(INFO) << "job " << node_.job_id() << ": rank " << rank << " left (last step "
                   << last_step << ")";
  if (ranks_.empty()) {
    ResetJobLocked();
    return;
  }
  // Steps that only waited for this rank are now complete: they go up
  // before the rank's leave, so that when the leave fails a step at the
  // coordinator, the node-mates that submitted it are known to have done so
  // and are not named as missing.
  for (LocalGroup* g : group_order_) {
    g->ranks.erase(std::remove(g->ranks.begin(), g->ranks.end(), rank), g->ranks.end());
    CollectCompleteLocked(*g, &outgoing_);
  }
  DeliverLocalDecisionsLocked();
  SendOutgoingLocked(outgoing_);
  node_.LeaveRank(rank, last_step, /*forget=*/false);
}

void Sidecar::ResetJobLocked() {
  ACCORD_LOG(INFO) << "job " << node_.job_id() << ": no rank left on this node; resetting";
  last_job_id_ = node_.job_id();
  node_.EndJob();
  group_order_.clear();
  groups_.clear();
  if (options_.reset_when_empty) node_.sink()->Reconnect();
}

void Sidecar::OnUpstreamConnected() {
  accord::MutexLock l(&mu_);
  std::vector<v1::NodeMessage> registrations;
  v1::ManifestBatch inflight;
  for (LocalGroup* g : group_order_) {
    g->registrations.AppendResend(
        [this](int r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ranks_.count(r) != 0; },
        &registrations);
    g->inflight.AppendAll(&inflight);
    // The coordinator may have lost its cache: the next manifest goes in full.
    g->have_last_sent = false;
    // ... and its pending steps: partial steps are reported again.
    for (LocalStep& st : g->steps) st.partial_reported = false;
  }
  report_after_ = absl::ZeroDuration();  // until the new stream's Welcome says
  node_.Connected(std::move(registrations), std::move(inflight));
}

void Sidecar::HandleCoordinatorMessage(v1::CoordinatorMessage* message) {
  if (message->has_decisions()) {
    accord::MutexLock l(&mu_);
    HandleDecisionsLocked(message->decisions(), message->mutable_decisions());
    return;
  }
  HandleCoordinatorMessage(*message);
}

void Sidecar::HandleCoordinatorMessage(const v1::CoordinatorMessage& message) {
  accord::MutexLock l(&mu_);
  switch (message.body_case()) {
    case v1::CoordinatorMessage::kWelcome:
      node_.OnWelcome(message.welcome());
      report_after_ = absl::Milliseconds(message.welcome().deadline_ms()) / 2;
      // Steps that began before this stream are checked now.
      if (report_after_ > absl::ZeroDuration()) ArmTimerLocked(clock_->Now());
      return;
    case v1::CoordinatorMessage::kError: {
      const v1::DecisionError& e = message.error();
      ACCORD_LOG(ERROR) << "coordinator: " << e.message();
      std::vector<int> targets;
      if (e.kind() == v1::DUPLICATE_RANK && e.ranks_size() > 0) {
        targets.assign(e.ranks().begin(), e.ranks().end());
      } else {
        for (const auto& [r, rs] : ranks_) targets.push_back(r);
      }
      for (int r : targets) {
        auto it = ranks_.find(r);
        if (it == ranks_.end()) continue;
        v1::RankReply reply;
        *reply.mutable_error() = e;
        it->second.sink->Send(std::make_shared<const v1::RankReply>(std::move(reply)));
        it->second.sink->Close(ErrorStatus(e));
      }
      return;
    }
    case v1::CoordinatorMessage::kRegistration: {
      const v1::RegistrationResult& res = message.registration();
      auto git = groups_.find(res.group_id());
      if (git == groups_.end()) return;
      // An error about one node registration names its ranks and goes to
      // them only. The group's or the job's failure (a mismatch across ranks,
      // ranks that did not register it within the deadline, the job failed)
      // goes to every rank that registered the group; its ranks are the
      // ranks at fault.
      const v1::ErrorKind kind = res.error().kind();
      const bool group_wide =
          kind == v1::REGISTRATION_MISMATCH || kind == v1::MISSING_RANKS || kind == v1::JOB_FAILED;
      const bool targeted = res.has_error() && !group_wide && res.error().ranks_size() > 0;
      if (!targeted) git->second.result = res;
      for (int r : git->second.ranks) {
        if (targeted && std::find(res.error().ranks().begin(), res.error().ranks().end(), r) ==
                            res.error().ranks().end()) {
          continue;
        }
        auto it = ranks_.find(r);
        if (it == ranks_.end() || it->second.got_result[res.group_id()]) continue;
        it->second.got_result[res.group_id()] = true;
        v1::RankReply reply;
        *reply.mutable_registration() = res;
        SendToRankLocked(r, std::move(reply));
      }
      return;
    }
    case v1::CoordinatorMessage::kDecisions:
      HandleDecisionsLocked(message.decisions(), nullptr);
      return;
    case v1::CoordinatorMessage::kProgressQuery:
      AnswerProgressLocked(message.progress_query());
      return;
    default:
      return;
  }
}

void Sidecar::AnswerProgressLocked(const v1::ProgressQuery& query) {
  v1::NodeMessage up;
  v1::NodeProgress* p = up.mutable_progress();
  p->set_group_id(query.group_id());
  p->set_step(query.step());
  // Each rank's last step of the asked group (-1: none, or a group not
  // registered here), never its last step of another group.
  int index = -1;
  if (auto git = groups_.find(query.group_id()); git != groups_.end()) {
    index = git->second.index;
    for (const LocalStep& ls : git->second.steps) {
      if (ls.step != query.step()) continue;
      for (int r : ls.ranks) p->add_reported(r);
    }
  }
  for (const auto& [r, rs] : ranks_) {
    p->add_ranks(r);
    p->add_last_steps(index < 0 ? -1 : rs.SubmittedOf(index));
  }
  ACCORD_LOG(INFO) << "coordinator asked about group \"" << query.group_id() << "\" step "
                   << query.step() << ": " << p->reported_size() << " of " << ranks_.size()
                   << " local ranks submitted it";
  node_.Send(std::move(up));
}

void Sidecar::HandleDecisionsLocked(const v1::DecisionBatch& batch, v1::DecisionBatch* take,
                                    bool local) {
  // Pass 1: group state, and per decision which ranks need the full body
  // instead of the coordinator's `same_as_previous`.
  struct Routed {
    const v1::Decision* decision;
    LocalGroup* group;
    std::vector<int> expand;   // ranks that get the full body (usually none)
    v1::DecisionOk expand_ok;  // that body (the group's last ok at this decision)
  };
  std::vector<Routed> routed;
  routed.reserve(batch.decisions_size());
  bool uniform = true;  // every connected rank gets every routed decision as is
  v1::ManifestBatch resend;
  for (const v1::Decision& d : batch.decisions()) {
    if (!local) ++stats_.decisions_in;
    auto git = groups_.find(d.group_id());
    if (git == groups_.end()) continue;
    LocalGroup& g = git->second;
    // A repeat the coordinator could not resolve: resend in full form.
    if (d.has_error() && d.error().resend_full_form()) {
      if (g.inflight.AppendStep(d.step(), &resend)) {
        g.have_last_sent = false;
        continue;
      }
    }
    if (!local) {
      // Already delivered (decided here): only compared.
      if (ConfirmLocalLocked(g, d)) continue;
      // What the coordinator's next `same_as_previous` stands for, kept
      // when local decisions are on (a new body is rare in the steady state).
      if (d.has_ok() || d.has_error()) g.local_ok_delivered.reset();
      if (d.has_error()) {
        g.coordinator_ok_bytes.reset();
      } else if (d.has_ok() && options_.local_decisions) {
        g.coordinator_ok_bytes = d.ok().SerializeAsString();
      }
    }
    const int64_t previous = g.last_decided_step;
    if (d.step() > g.last_decided_step) g.last_decided_step = d.step();
    if (d.has_ok()) g.last_ok = d.ok();
    if (d.has_error()) g.last_ok.reset();
    if (d.step() >= g.last_decided_step) {
      if (d.has_error()) {
        g.last_error = d;
      } else {
        g.last_error.reset();
      }
    }
    DropStepsUpTo(g, d.step(), /*keep_inflight=*/local);
    Routed& out = routed.emplace_back(Routed{&d, &g, {}});
    size_t connected = 0;
    for (int r : g.ranks) {
      auto rit = ranks_.find(r);
      if (rit == ranks_.end()) continue;
      ++connected;
      std::vector<int64_t>& delivered = rit->second.delivered;
      if (delivered.size() <= static_cast<size_t>(g.index)) {
        delivered.resize(group_order_.size(), -1);
      }
      int64_t& last = delivered[g.index];
      if (d.same_as_previous() && (last != previous || previous < 0) && g.last_ok.has_value()) {
        if (out.expand.empty()) out.expand_ok = *g.last_ok;
        out.expand.push_back(r);
      }
      last = d.step();
    }
    if (connected != ranks_.size() || !out.expand.empty()) uniform = false;
  }
  // Pass 2: one shared reply when every rank gets the same decisions (the
  // common case), else one reply per rank.
  if (!routed.empty() && uniform) {
    auto reply = std::make_shared<v1::RankReply>();
    v1::DecisionBatch* b = reply->mutable_decisions();
    if (take != nullptr && static_cast<int>(routed.size()) == batch.decisions_size()) {
      b->Swap(take);  // every decision, unchanged: forward the batch itself
    } else {
      b->mutable_decisions()->Reserve(static_cast<int>(routed.size()));
      for (const Routed& x : routed) *b->add_decisions() = *x.decision;
    }
    std::shared_ptr<const v1::RankReply> shared = std::move(reply);
    for (auto& [r, rs] : ranks_) {
      if (rs.sink != nullptr) rs.sink->Send(shared);
    }
  } else if (!routed.empty()) {
    for (auto& [r, rs] : ranks_) {
      v1::RankReply reply;
      for (const Routed& x : routed) {
        if (!std::binary_search(x.group->ranks.begin(), x.group->ranks.end(), r)) continue;
        v1::Decision* rd = reply.mutable_decisions()->add_decisions();
        *rd = *x.decision;
        if (std::find(x.expand.begin(), x.expand.end(), r) != x.expand.end()) {
          rd->set_same_as_previous(false);
          *rd->mutable_ok() = x.expand_ok;
        }
      }
      if (reply.has_decisions()) SendToRankLocked(r, std::move(reply));
    }
  }
  // Full-form manifests never compact, but the resend is the stream's
  // previous batch from now on.
  if (!local && node_.SendBatch(std::move(resend))) ++stats_.node_batch_repeats;
}

}  // namespace accord::daemon
