#include "daemon/sidecar/sidecar.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "daemon/common/auth_tokens.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

constexpr char kServerVersion[] = "accord-sidecar/0.1";

v1::DecisionError Error(v1::ErrorKind kind, absl::StatusCode code, std::string message) {
  return wire::MakeError(kind, absl::Status(code, std::move(message)));
}

absl::Status ErrorStatus(const v1::DecisionError& e) { return wire::ErrorToStatus(e); }

}  // namespace

void Sidecar::SetUpstream(UpstreamSink* upstream) {
  accord::MutexLock l(&mu_);
  upstream_ = upstream;
}

SidecarStats Sidecar::stats() {
  accord::MutexLock l(&mu_);
  SidecarStats s = stats_;
  s.ranks = static_cast<int>(ranks_.size());
  s.job_id = job_id_.empty() ? last_job_id_ : job_id_;
  return s;
}

Sidecar::SessionId Sidecar::OpenRank(RankSink* sink) {
  accord::MutexLock l(&mu_);
  const SessionId id = next_session_++;
  sessions_[id].sink = sink;
  return id;
}

void Sidecar::SendToRank(int rank, v1::RankReply reply) {
  auto it = ranks_.find(rank);
  if (it == ranks_.end() || it->second.sink == nullptr) return;
  it->second.sink->Send(std::make_shared<const v1::RankReply>(std::move(reply)));
}

void Sidecar::RecordBatch(const v1::ManifestBatch& batch) {
  last_batch_.clear();
  wire::BatchKeyHasher hasher;
  for (const v1::Manifest& m : batch.manifests()) {
    last_batch_.emplace_back(m.group_id(), m.cache_key());
    hasher.Add(m.group_id(), m.cache_key());
  }
  last_batch_key_ = last_batch_.empty() ? 0 : hasher.Finish();
}

void Sidecar::SendManifests(v1::NodeMessage up) {
  const v1::ManifestBatch& batch = up.manifests();
  const int n = batch.manifests_size();
  if (n == 0) return;
  bool same = upstream_batch_repeat_ && last_batch_key_ != 0 &&
              static_cast<size_t>(n) == last_batch_.size();
  const int64_t step = batch.manifests(0).step();
  for (int i = 0; same && i < n; ++i) {
    const v1::Manifest& m = batch.manifests(i);
    same = m.repeat() && m.step() == step && m.cache_key() == last_batch_[i].second &&
           m.group_id() == last_batch_[i].first;
  }
  if (same) {
    v1::NodeMessage rep;
    rep.mutable_manifests()->set_repeat_step(step);
    rep.mutable_manifests()->set_repeat_batch_key(last_batch_key_);
    ++stats_.node_batch_repeats;
    upstream_->Send(std::move(rep));
    return;
  }
  RecordBatch(batch);
  upstream_->Send(std::move(up));
}

v1::NodeMessage Sidecar::HelloMessage() {
  v1::NodeMessage m;
  v1::NodeHello* h = m.mutable_hello();
  h->set_job_id(job_id_);
  h->set_node_id(options_.node_id);
  h->set_world_size(world_size_);
  h->set_token(options_.token.empty() ? rank_token_ : options_.token);
  for (int r : announced_) h->add_ranks(r);
  return m;
}

void Sidecar::HandleRankMessage(SessionId id, const v1::RankMessage& message) {
  accord::MutexLock l(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  Session& s = it->second;
  if (message.has_hello()) {
    HandleHello(id, s, message.hello());
    return;
  }
  if (s.rank < 0) {
    v1::RankReply reply;
    *reply.mutable_error() =
        Error(v1::INVALID_REQUEST, absl::StatusCode::kFailedPrecondition, "send RankHello first");
    s.sink->Send(std::make_shared<const v1::RankReply>(reply));
    s.sink->Close(ErrorStatus(reply.error()));
    return;
  }
  if (message.has_registration()) {
    HandleRegistration(s.rank, message.registration());
  } else if (message.has_manifests()) {
    HandleManifests(s.rank, message.manifests());
  }
}

void Sidecar::HandleHello(SessionId id, Session& s, const v1::RankHello& hello) {
  auto refuse = [&](v1::ErrorKind kind, absl::StatusCode code, std::string msg) {
    v1::RankReply reply;
    *reply.mutable_error() = Error(kind, code, std::move(msg));
    reply.mutable_error()->set_job_id(hello.job_id());
    reply.mutable_error()->add_ranks(hello.rank());
    s.sink->Send(std::make_shared<const v1::RankReply>(reply));
    s.sink->Close(ErrorStatus(reply.error()));
  };
  if (s.rank >= 0) {
    refuse(v1::INVALID_REQUEST, absl::StatusCode::kFailedPrecondition,
           absl::StrCat("rank ", s.rank, " sent a second RankHello"));
    return;
  }
  if (hello.job_id().empty()) {
    refuse(v1::INVALID_REQUEST, absl::StatusCode::kInvalidArgument, "RankHello without a job_id");
    return;
  }
  if (!options_.job.empty() && hello.job_id() != options_.job) {
    refuse(v1::PERMISSION_DENIED, absl::StatusCode::kPermissionDenied,
           absl::StrCat("this sidecar serves job ", options_.job, " (--job) only; rank ",
                        hello.rank(), " belongs to job ", hello.job_id()));
    return;
  }
  if (!job_id_.empty() && hello.job_id() != job_id_) {
    refuse(v1::INVALID_REQUEST, absl::StatusCode::kFailedPrecondition,
           absl::StrCat("this sidecar is serving job ", job_id_, "; rank ", hello.rank(),
                        " of job ", hello.job_id(),
                        " must wait until that job's ranks have left or use another sidecar"));
    return;
  }
  if (const std::string& expected = options_.token.empty() ? rank_token_ : options_.token;
      (!hello.token().empty() && !expected.empty() && !TokensEqual(hello.token(), expected)) ||
      (hello.token().empty() && options_.require_rank_token)) {
    ACCORD_LOG(WARNING) << "permission denied: job " << hello.job_id() << " rank " << hello.rank()
                        << ": RankHello token "
                        << (hello.token().empty() ? "missing" : "differs from the job's");
    refuse(v1::PERMISSION_DENIED, absl::StatusCode::kPermissionDenied,
           absl::StrCat("job ", hello.job_id(), ": rank ", hello.rank(),
                        hello.token().empty()
                            ? " sent no token and this sidecar requires one (--require_rank_token)"
                            : " sent a token that is not the one this sidecar holds for the job",
                        "; check ACCORD_TOKEN / ClientOptions.token of the rank"));
    return;
  }
  if (hello.world_size() < 1) {
    refuse(v1::INVALID_REQUEST, absl::StatusCode::kInvalidArgument,
           absl::StrCat("job ", hello.job_id(), ": world size ", hello.world_size()));
    return;
  }
  if (!job_id_.empty() && hello.world_size() != world_size_) {
    refuse(v1::WORLD_SIZE_MISMATCH, absl::StatusCode::kFailedPrecondition,
           absl::StrCat("job ", hello.job_id(), ": rank ", hello.rank(), " says world size ",
                        hello.world_size(), " but this node's other ranks say ", world_size_,
                        "; check WORLD_SIZE of the launcher"));
    return;
  }
  if (hello.rank() < 0 || hello.rank() >= hello.world_size()) {
    refuse(v1::INVALID_REQUEST, absl::StatusCode::kInvalidArgument,
           absl::StrCat("job ", hello.job_id(), ": rank ", hello.rank(), " outside 0..",
                        hello.world_size() - 1));
    return;
  }
  if (ranks_.count(hello.rank())) {
    refuse(v1::DUPLICATE_RANK, absl::StatusCode::kAlreadyExists,
           absl::StrCat("job ", hello.job_id(), ": rank ", hello.rank(),
                        " is already connected to this sidecar; check RANK of the local "
                        "processes"));
    return;
  }
  if (static_cast<int>(ranks_.size()) >= options_.max_ranks) {
    refuse(v1::LIMIT_EXCEEDED, absl::StatusCode::kResourceExhausted,
           absl::StrCat("this sidecar already serves ", ranks_.size(), " ranks (--max_ranks)"));
    return;
  }
  const bool first = job_id_.empty();
  if (first) rank_token_ = hello.token();
  job_id_ = hello.job_id();
  world_size_ = hello.world_size();
  s.rank = hello.rank();
  RankState& rs = ranks_[s.rank];
  rs.session = id;
  rs.sink = s.sink;
  v1::RankReply welcome;
  welcome.mutable_welcome()->set_node_id(options_.node_id);
  welcome.mutable_welcome()->set_server_version(kServerVersion);
  s.sink->Send(std::make_shared<const v1::RankReply>(std::move(welcome)));
  const bool new_rank = announced_.insert(s.rank).second;
  if (first || !hello_sent_) {
    hello_sent_ = true;
    upstream_->Send(HelloMessage());
  } else if (new_rank) {
    v1::NodeMessage joined;
    joined.mutable_rank_event()->set_rank(s.rank);
    joined.mutable_rank_event()->set_joined(true);
    upstream_->Send(std::move(joined));
  }
}

void Sidecar::HandleRegistration(int rank, const v1::GroupRegistration& reg) {
  RankState& rs = ranks_[rank];
  auto reply_error = [&](v1::DecisionError e) {
    v1::RankReply reply;
    reply.mutable_registration()->set_group_id(reg.group_id());
    e.set_job_id(job_id_);
    e.set_group_id(reg.group_id());
    *reply.mutable_registration()->mutable_error() = std::move(e);
    SendToRank(rank, std::move(reply));
  };
  absl::StatusOr<GroupSpec> spec = wire::GroupSpecFromProto(reg);
  if (!spec.ok()) {
    reply_error(
        Error(v1::INVALID_REQUEST, spec.status().code(),
              absl::StrCat("job ", job_id_, " rank ", rank, ": ", spec.status().message())));
    return;
  }
  if (absl::StatusOr<Policy> p = wire::PolicyFromProto(reg.policy()); !p.ok()) {
    reply_error(Error(v1::INVALID_REQUEST, p.status().code(),
                      absl::StrCat("job ", job_id_, " rank ", rank, " group \"", reg.group_id(),
                                   "\": ", p.status().message())));
    return;
  }
  LocalGroup& g = groups_[reg.group_id()];
  if (g.variants.empty()) g.spec = *spec;
  const std::string bytes = reg.SerializeAsString();
  Variant* v = nullptr;
  for (Variant& x : g.variants) {
    if (x.bytes == bytes) v = &x;
  }
  if (v == nullptr) {
    g.variants.push_back(Variant{reg, bytes, {}});
    v = &g.variants.back();
  }
  v->ranks.insert(rank);
  g.ranks.insert(rank);
  rs.got_result[reg.group_id()] = false;
  v1::NodeMessage up;
  *up.mutable_registration()->mutable_registration() = reg;
  up.mutable_registration()->add_ranks(rank);
  upstream_->Send(std::move(up));
}

void Sidecar::HandleManifests(int rank, const v1::ManifestBatch& batch) {
  RankState& rs = ranks_[rank];
  v1::RankReply errors;
  auto reply_error = [&](const v1::Manifest& m, v1::ErrorKind kind, absl::StatusCode code,
                         std::string msg) {
    v1::Decision* d = errors.mutable_decisions()->add_decisions();
    d->set_group_id(m.group_id());
    d->set_step(m.step());
    *d->mutable_error() = Error(kind, code, std::move(msg));
    d->mutable_error()->set_job_id(job_id_);
    d->mutable_error()->set_group_id(m.group_id());
    d->mutable_error()->set_step(m.step());
    d->mutable_error()->add_ranks(rank);
  };
  if (batch.repeat_batch_key() != 0) {
    // Batch repeats are a sidecar -> coordinator form only.
    v1::RankReply reply;
    *reply.mutable_error() =
        Error(v1::INVALID_REQUEST, absl::StatusCode::kInvalidArgument,
              absl::StrCat("job ", job_id_, " rank ", rank, " step ", batch.repeat_step(),
                           ": a rank must send manifests, not a batch repeat record; check the "
                           "client library's version"));
    reply.mutable_error()->add_ranks(rank);
    SendToRank(rank, std::move(reply));
    return;
  }
  std::set<std::string> touched;
  for (const v1::Manifest& m : batch.manifests()) {
    ++stats_.rank_manifests;
    auto git = groups_.find(m.group_id());
    if (git == groups_.end() || !git->second.ranks.count(rank)) {
      reply_error(m, v1::UNKNOWN_GROUP, absl::StatusCode::kNotFound,
                  absl::StrCat("job ", job_id_, " rank ", rank, ": manifest for group \"",
                               m.group_id(), "\" which this rank has not registered"));
      continue;
    }
    LocalGroup& g = git->second;
    if (m.step() == g.last_decided_step && g.last_error.has_value()) {
      // The step already failed for the job (e.g. missing ranks) before this
      // rank submitted it: the same error every other rank got.
      *errors.mutable_decisions()->add_decisions() = *g.last_error;
      continue;
    }
    if (m.step() <= g.last_decided_step) {
      reply_error(
          m, v1::STEP_REGRESSION, absl::StatusCode::kFailedPrecondition,
          absl::StrCat("job ", job_id_, " rank ", rank, " group \"", m.group_id(), "\" step ",
                       m.step(), ": older than the last decided step ", g.last_decided_step));
      continue;
    }
    // A repeat names this rank's previous full manifest for the group by
    // its key; resolve it to that content at the new step.
    v1::Manifest resolved;
    if (m.repeat()) {
      auto last = g.last_full.find(rank);
      if (last == g.last_full.end() || last->second.cache_key() != m.cache_key()) {
        reply_error(
            m, v1::INVALID_MANIFEST, absl::StatusCode::kFailedPrecondition,
            absl::StrCat("job ", job_id_, " rank ", rank, " group \"", m.group_id(), "\" step ",
                         m.step(), ": repeat of cache key ", m.cache_key(),
                         " which is not this rank's previous manifest; send the full form"));
        continue;
      }
      resolved = last->second;
      resolved.set_step(m.step());
    } else {
      resolved = m;
    }
    absl::StatusOr<Manifest> parsed =
        wire::ManifestFromProto(resolved, g.spec.params.size(), world_size_, rank);
    absl::Status valid =
        parsed.ok() ? ValidateManifest(*parsed, m.group_id(), g.spec.params.size(), world_size_)
                    : parsed.status();
    if (!valid.ok()) {
      const bool non_float = absl::StrContains(valid.message(), "not a float dtype");
      reply_error(m, non_float ? v1::NON_FLOAT_DTYPE : v1::INVALID_MANIFEST,
                  absl::StatusCode::kInvalidArgument,
                  absl::StrCat("job ", job_id_, " rank ", rank, ": ", valid.message()));
      continue;
    }
    LocalStep& st = g.steps[m.step()];
    const std::string raw = m.SerializeAsString();
    if (auto prev = st.raw.find(rank); prev != st.raw.end()) {
      if (prev->second != raw) {
        reply_error(
            m, v1::INVALID_MANIFEST, absl::StatusCode::kFailedPrecondition,
            absl::StrCat("job ", job_id_, " rank ", rank, " group \"", m.group_id(), "\" step ",
                         m.step(), ": a second, different manifest for the same step"));
      }
      continue;
    }
    if (st.raw.empty()) {
      st.merged = *parsed;
    } else if (absl::Status s = Merge(st.merged, *parsed); !s.ok()) {
      reply_error(m, v1::INVALID_MANIFEST, absl::StatusCode::kInvalidArgument,
                  absl::StrCat("job ", job_id_, " rank ", rank, ": ", s.message()));
      continue;
    }
    st.raw[rank] = raw;
    if (!m.repeat()) {
      v1::Manifest keep = m;
      keep.clear_step();
      // The key covers content, not the step; recompute it so a client that
      // did not set one still gets repeats resolved correctly.
      keep.set_cache_key(ManifestKey(*parsed));
      g.last_full[rank] = std::move(keep);
    }
    std::vector<bool> used(parsed->dtypes.size());
    for (size_t i = 0; i < used.size(); ++i) used[i] = parsed->dtypes[i] != 0;
    st.used[rank] = std::move(used);
    rs.last_step = std::max(rs.last_step, m.step());
    touched.insert(m.group_id());
  }
  if (errors.decisions().decisions_size() > 0) SendToRank(rank, std::move(errors));
  v1::NodeMessage up;
  for (const std::string& gid : touched) {
    CollectComplete(gid, groups_[gid], up.mutable_manifests());
  }
  SendManifests(std::move(up));
}

void Sidecar::CollectComplete(const std::string& group_id, LocalGroup& g, v1::ManifestBatch* out) {
  for (auto& [step, st] : g.steps) {
    if (st.sent || st.raw.empty()) continue;
    bool complete = true;
    for (int r : g.ranks) {
      if (ranks_.count(r) && !st.raw.count(r)) complete = false;
    }
    if (!complete) break;  // later steps wait for this one (per-stream order)
    st.sent = true;
    // Ranks whose usage differs from the node's merged usage travel as detail.
    std::vector<bool> merged_used(st.merged.dtypes.size());
    for (size_t i = 0; i < merged_used.size(); ++i) merged_used[i] = st.merged.dtypes[i] != 0;
    v1::Manifest full;
    std::set<int> covered;
    for (const auto& [r, used] : st.used) covered.insert(r);
    wire::ManifestToProto(group_id, st.merged, /*with_ranks=*/covered != announced_, &full);
    for (const auto& [r, used] : st.used) {
      if (used != merged_used) {
        v1::RankUsage* u = full.add_rank_detail();
        u->set_rank(r);
        u->set_used_bits(wire::PackBits(used));
      }
    }
    std::string detail;
    for (const v1::RankUsage& u : full.rank_detail()) detail += u.SerializeAsString();
    g.inflight[step] = full;
    if (g.have_last_sent && g.last_sent_key == full.cache_key() && g.last_sent_detail == detail) {
      v1::Manifest* rep = out->add_manifests();
      rep->set_group_id(group_id);
      rep->set_step(step);
      rep->set_repeat(true);
      rep->set_cache_key(full.cache_key());
      ++stats_.node_manifests_repeat;
    } else {
      *out->add_manifests() = full;
      ++stats_.node_manifests_full;
    }
    g.have_last_sent = true;
    g.last_sent_key = full.cache_key();
    g.last_sent_detail = std::move(detail);
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
  ACCORD_LOG(INFO) << "job " << job_id_ << ": rank " << rank << " left (last step " << last_step
                   << ")";
  if (ranks_.empty()) {
    ResetJob();
    return;
  }
  v1::NodeMessage left;
  left.mutable_rank_event()->set_rank(rank);
  left.mutable_rank_event()->set_joined(false);
  left.mutable_rank_event()->set_last_step(last_step);
  upstream_->Send(std::move(left));
  // Steps that only waited for this rank are now complete.
  v1::NodeMessage up;
  for (auto& [gid, g] : groups_) {
    g.ranks.erase(rank);
    CollectComplete(gid, g, up.mutable_manifests());
  }
  SendManifests(std::move(up));
}

void Sidecar::ResetJob() {
  ACCORD_LOG(INFO) << "job " << job_id_ << ": no rank left on this node; resetting";
  last_job_id_ = job_id_;
  job_id_.clear();
  rank_token_.clear();
  world_size_ = 0;
  hello_sent_ = false;
  announced_.clear();
  groups_.clear();
  upstream_batch_repeat_ = false;
  last_batch_.clear();
  last_batch_key_ = 0;
  upstream_->Reconnect();
}

void Sidecar::OnUpstreamConnected() {
  accord::MutexLock l(&mu_);
  std::vector<v1::NodeMessage> msgs;
  if (!job_id_.empty()) {
    msgs.push_back(HelloMessage());
    hello_sent_ = true;
    v1::NodeMessage batch;
    for (auto& [gid, g] : groups_) {
      for (const Variant& v : g.variants) {
        std::vector<int> live;
        for (int r : v.ranks) {
          if (ranks_.count(r)) live.push_back(r);
        }
        if (live.empty()) continue;
        v1::NodeMessage reg;
        *reg.mutable_registration()->mutable_registration() = v.registration;
        for (int r : live) reg.mutable_registration()->add_ranks(r);
        msgs.push_back(std::move(reg));
      }
      for (const auto& [step, m] : g.inflight) *batch.mutable_manifests()->add_manifests() = m;
      // The coordinator may have lost its cache: the next manifest goes in full.
      g.have_last_sent = false;
    }
    // A new stream: no batch repeat until its Welcome says so; its previous
    // batch is the resend (or none).
    RecordBatch(batch.manifests());
    if (batch.manifests().manifests_size() > 0) msgs.push_back(std::move(batch));
  } else {
    hello_sent_ = false;
    RecordBatch(v1::ManifestBatch());
  }
  upstream_batch_repeat_ = false;
  upstream_->Reset(std::move(msgs));
}

void Sidecar::HandleCoordinatorMessage(const v1::CoordinatorMessage& message) {
  accord::MutexLock l(&mu_);
  switch (message.body_case()) {
    case v1::CoordinatorMessage::kWelcome:
      upstream_batch_repeat_ = message.welcome().batch_repeat();
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
      // An error about one node registration (not a mismatch across ranks)
      // names its ranks and goes to them only.
      const bool targeted = res.has_error() && res.error().kind() != v1::REGISTRATION_MISMATCH &&
                            res.error().ranks_size() > 0;
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
        SendToRank(r, std::move(reply));
      }
      return;
    }
    case v1::CoordinatorMessage::kDecisions: {
      std::map<int, v1::RankReply> out;
      v1::NodeMessage resend;
      for (const v1::Decision& d : message.decisions().decisions()) {
        ++stats_.decisions_in;
        auto git = groups_.find(d.group_id());
        if (git == groups_.end()) continue;
        LocalGroup& g = git->second;
        // A repeat the coordinator could not resolve: resend in full form.
        if (d.has_error() && d.error().kind() == v1::INVALID_MANIFEST &&
            absl::StrContains(d.error().message(), "full form")) {
          if (auto in = g.inflight.find(d.step()); in != g.inflight.end()) {
            *resend.mutable_manifests()->add_manifests() = in->second;
            g.have_last_sent = false;
            continue;
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
        g.inflight.erase(g.inflight.begin(), g.inflight.upper_bound(d.step()));
        g.steps.erase(g.steps.begin(), g.steps.upper_bound(d.step()));
        for (int r : g.ranks) {
          auto rit = ranks_.find(r);
          if (rit == ranks_.end()) continue;
          v1::Decision* rd = out[r].mutable_decisions()->add_decisions();
          *rd = d;
          int64_t& delivered =
              rit->second.delivered.try_emplace(d.group_id(), int64_t{-1}).first->second;
          if (d.same_as_previous() && (delivered != previous || previous < 0)) {
            if (g.last_ok.has_value()) {
              rd->set_same_as_previous(false);
              *rd->mutable_ok() = *g.last_ok;
            }
          }
          delivered = d.step();
        }
      }
      for (auto& [r, reply] : out) SendToRank(r, std::move(reply));
      // Full-form manifests never compact, but the resend is the stream's
      // previous batch from now on.
      SendManifests(std::move(resend));
      return;
    }
    default:
      return;
  }
}

}  // namespace accord::daemon
