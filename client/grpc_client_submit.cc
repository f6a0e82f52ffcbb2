// GrpcClient's calls: registrations, manifests, decisions and Wait.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/grpc_client.h"
#include "core/log.h"
#include "proto/wire.h"

namespace accord {
namespace {

bool SamePolicy(const Policy& a, const Policy& b) {
  return a.reduce_dtype == b.reduce_dtype && a.reduce_dtype_exact == b.reduce_dtype_exact &&
         a.fp8_tie == b.fp8_tie && a.empty_group_dtype == b.empty_group_dtype;
}

}  // namespace

std::deque<GrpcClient::Pending>::iterator GrpcClient::FindPending(GroupState& g, int64_t step) {
  return std::find_if(g.pending.begin(), g.pending.end(),
                      [step](const Pending& p) { return p.step == step; });
}

absl::Status GrpcClient::RegisterGroup(const GroupSpec& spec, const Policy& policy,
                                       absl::Time deadline) {
  return RegisterGroups({{spec, policy}}, deadline);
}

absl::Status GrpcClient::RegisterGroups(const std::vector<std::pair<GroupSpec, Policy>>& groups,
                                        absl::Time deadline) {
  for (const auto& [spec, policy] : groups) {
    if (absl::Status s = ValidateGroupSpec(spec); !s.ok()) return s;
  }
  accord::MutexLock lock(&mu_);
  if (absl::Status s = conn_.CallStatus(); !s.ok()) return s;
  std::vector<GroupSpec> specs;
  specs.reserve(groups.size());
  for (const auto& [spec, policy] : groups) {
    absl::StatusOr<GroupSpec> checked = CheckRegistrationLocked(spec);
    if (!checked.ok()) return checked.status();
    specs.push_back(*std::move(checked));
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    if (absl::Status s = SendRegistrationLocked(specs[i], groups[i].second); !s.ok()) return s;
  }
  for (const GroupSpec& spec : specs) {
    if (absl::Status s = AwaitRegistrationLocked(spec, deadline); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<GroupSpec> GrpcClient::CheckRegistrationLocked(const GroupSpec& spec) const {
  if (spec.members == nullptr) return spec;
  const MemberSet& m = *spec.members;
  if (m.world_size() != options_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group \"", spec.group_id, "\": its members are ranks of a job of ", m.world_size(),
        " ranks, but rank ", options_.rank, " joined job \"", options_.job_id, "\" of ",
        options_.world_size, "; build the member set with the job's world size"));
  }
  if (!m.Contains(options_.rank)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group \"", spec.group_id, "\": rank ", options_.rank, " is not among its members (",
        m.Describe(), "); a rank registers only the groups it reduces"));
  }
  if (m.AllRanks()) {
    GroupSpec every = spec;
    every.members = nullptr;
    return every;
  }
  if (!facts_.welcome_members) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group \"", spec.group_id, "\" has members (", m.Describe(),
        ") but the sidecar or coordinator is older than groups with members; upgrade them"));
  }
  return spec;
}

void GrpcClient::NoteVerdictLocked(const v1::DecisionError& e) {
  if (!e.job_failed() || facts_.verdict.has_value()) return;
  absl::Status s = wire::ErrorToStatus(e);
  if (s.ok()) s = absl::UnknownError("the job failed; the error carried no code");
  facts_.verdict = std::move(s);
}

std::optional<absl::Status> GrpcClient::WaitVerdict(absl::Time deadline) {
  accord::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return facts_.verdict.has_value() || conn_.closed();
  };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  if (facts_.verdict.has_value()) return facts_.verdict;
  if (conn_.closed()) return conn_.CallStatus();
  return std::nullopt;
}

DecisionFuture GrpcClient::Submit(const GroupSubmission& submission) {
  return SubmitBatch({submission}).front();
}

std::vector<DecisionFuture> GrpcClient::SubmitBatch(const std::vector<GroupSubmission>& batch,
                                                    uint64_t sync_key) {
  std::vector<DecisionFuture> out;
  out.reserve(batch.size());
  v1::RankMessage msg;
  accord::MutexLock lock(&mu_);
  if (!buffers_.spare.empty()) {
    msg.set_allocated_manifests(buffers_.spare.back().release());
    buffers_.spare.pop_back();
  }
  v1::ManifestBatch* mb = msg.mutable_manifests();
  const absl::Status closed = conn_.CallStatus();
  for (const GroupSubmission& sub : batch) {
    auto state = std::make_shared<DecisionFuture::State>(hub_, sub.group_id, sub.step);
    out.emplace_back(state);
    GroupState* group = nullptr;
    absl::Status s = closed.ok() ? CheckSubmission(sub, &group) : closed;
    if (!s.ok()) {
      state->Complete(s);
      continue;
    }
    AddManifestLocked(sub, *group, std::move(state), mb);
  }
  if (mb->manifests_size() != 0) {
    mb->set_sync_key(sync_key);
    SendBatchLocked(std::move(msg));
  }
  return out;
}

void GrpcClient::AddManifestLocked(const GroupSubmission& sub, GroupState& g,
                                   std::shared_ptr<DecisionFuture::State> state,
                                   v1::ManifestBatch* batch) {
  Manifest& scratch = buffers_.scratch;
  scratch.step = sub.step;
  scratch.dtypes.resize(sub.grad_dtypes.size());
  for (size_t i = 0; i < sub.grad_dtypes.size(); ++i) {
    scratch.dtypes[i] = sub.grad_dtypes[i] ? MaskOf(*sub.grad_dtypes[i]) : DTypeMask{0};
  }
  v1::Manifest* pm = batch->add_manifests();
  // The key is a function of the content (the rank set is fixed): the same
  // content as the last full form is a repeat of its key.
  if (g.last_key.has_value() && *g.last_content == scratch.dtypes) {
    pm->set_group_id(sub.group_id);
    pm->set_step(sub.step);
    pm->set_cache_key(*g.last_key);
    pm->set_repeat(true);
  } else {
    wire::ManifestToProto(sub.group_id, scratch, /*with_ranks=*/false, pm);
    g.last_key = pm->cache_key();
  }
  if (g.last_content == nullptr || *g.last_content != scratch.dtypes) {
    g.last_content = std::make_shared<const std::vector<DTypeMask>>(scratch.dtypes);
  }
  g.last_step = sub.step;
  // The content stays with the step until its decision: a resume resends it.
  g.pending.push_back(Pending{sub.step, std::move(state), g.last_content});
}

void GrpcClient::SendBatchLocked(v1::RankMessage msg) {
  if (!CanWriteDirectlyLocked()) {
    EnqueueLocked(std::move(msg));
    return;
  }
  writing_ = true;
  mu_.Unlock();
  const bool ok = stream_.rw->Write(msg);
  mu_.Lock();
  writing_ = false;
  RecycleBatchLocked(&msg);
  // A failed write means the stream is broken: the reader sees it end.
  if (!ok) stream_.ctx->TryCancel();
}

void GrpcClient::RecycleBatchLocked(v1::RankMessage* msg) {
  if (!msg->has_manifests() || buffers_.spare.size() >= kMaxSpareBatches) return;
  std::unique_ptr<v1::ManifestBatch> batch(msg->release_manifests());
  batch->Clear();
  buffers_.spare.push_back(std::move(batch));
}

absl::StatusOr<Decision> GrpcClient::Wait(const DecisionFuture& future, absl::Time deadline) {
  if (!future.valid()) {
    return absl::InvalidArgumentError("Wait on an empty DecisionFuture (not from Submit)");
  }
  DecisionFuture::State* st = future.state().get();
  // Usually the decision is already there (a batch completes at once): no lock.
  if (st->completed.load(std::memory_order_acquire)) return st->CompletedResult();
  accord::MutexLock lock(&st->hub->mu);
  st->hub->mu.AwaitWithDeadline(absl::Condition(&st->done), deadline);
  if (!st->done) {
    return LocalTimeoutError(absl::StrCat(
        "no decision for group \"", st->group_id, "\" step ", st->step, " (job \"", options_.job_id,
        "\", rank ", options_.rank,
        ") before the caller's deadline; the coordinator reports ranks that never submitted "
        "once its own deadline passes"));
  }
  return st->result;
}

absl::Status GrpcClient::AddAdapterCounts(const AdapterCounts& more) {
  if (more.redone < 0 || more.redone > more.repaired || more.repaired > more.speculated) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adapter counts must hold 0 <= redone <= repaired <= speculated; got speculated=",
        more.speculated, " repaired=", more.repaired, " redone=", more.redone));
  }
  accord::MutexLock lock(&mu_);
  if (absl::Status s = conn_.CallStatus(); !s.ok()) return s;
  AdapterCounts& total =
      facts_.adapter_counts.emplace(facts_.adapter_counts.value_or(AdapterCounts{}));
  total.speculated += more.speculated;
  total.repaired += more.repaired;
  total.redone += more.redone;
  EnqueueLocked(AdapterCountsMessage(total));
  return absl::OkStatus();
}

absl::StatusOr<GroupSpec> GrpcClient::Group(absl::string_view group_id) const {
  accord::MutexLock lock(&mu_);
  auto it = groups_.by_id.find(group_id);
  if (it == groups_.by_id.end() || it->second.reg != RegState::kOk) {
    return absl::NotFoundError(
        absl::StrCat("group \"", group_id, "\" is not registered on rank ", options_.rank));
  }
  return it->second.spec;
}

absl::Status GrpcClient::CheckSubmission(const GroupSubmission& sub, GroupState** group) {
  auto it = groups_.by_id.find(sub.group_id);
  if (it == groups_.by_id.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("manifest for group \"", sub.group_id, "\" step ", sub.step, " on rank ",
                     options_.rank, ": the group is not registered; call RegisterGroup first"));
  }
  const GroupState& g = it->second;
  if (g.reg == RegState::kFailed) return g.reg_status;
  if (g.reg != RegState::kOk) {
    return absl::FailedPreconditionError(absl::StrCat(
        "manifest for group \"", sub.group_id, "\" step ", sub.step, " on rank ", options_.rank,
        ": the group's registration has not completed; wait for RegisterGroup to return"));
  }
  if (sub.grad_dtypes.size() != g.spec.params.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest for group \"", sub.group_id, "\" step ", sub.step, " on rank ",
                     options_.rank, ": ", sub.grad_dtypes.size(),
                     " entries but the group registered ", g.spec.params.size(), " parameters"));
  }
  if (sub.step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest for group \"", sub.group_id, "\": negative step ", sub.step));
  }
  if (sub.step <= g.last_step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "manifest for group \"", sub.group_id, "\" step ", sub.step, " on rank ", options_.rank,
        ": steps must increase; this rank already submitted step ", g.last_step));
  }
  *group = &it->second;
  return absl::OkStatus();
}

absl::Status GrpcClient::SendRegistrationLocked(const GroupSpec& spec, const Policy& policy) {
  auto it = groups_.by_id.find(spec.group_id);
  if (it != groups_.by_id.end()) {
    if (!(it->second.spec == spec) || !SamePolicy(it->second.policy, policy)) {
      return absl::AlreadyExistsError(absl::StrCat(
          "group \"", spec.group_id, "\" was already registered by rank ", options_.rank,
          " with a different spec or policy; register each group once per job"));
    }
    return absl::OkStatus();
  }
  GroupState& g = groups_.by_id[spec.group_id];
  groups_.order.push_back(spec.group_id);
  g.spec = spec;
  g.policy = policy;
  g.spec_fingerprint = SpecFingerprint(spec);
  v1::RankMessage msg;
  *msg.mutable_registration() = wire::GroupSpecToProto(spec, policy);
  EnqueueLocked(std::move(msg));
  return absl::OkStatus();
}

// The group is looked up by id at each check: the map may rehash while the
// lock is released.
absl::Status GrpcClient::AwaitRegistrationLocked(const GroupSpec& spec, absl::Time deadline) {
  auto state = [this, &spec]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return groups_.by_id.find(spec.group_id)->second.reg;
  };
  auto done = [this, &state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return state() != RegState::kPending || !conn_.CallStatus().ok();
  };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  const GroupState& g = groups_.by_id.find(spec.group_id)->second;
  if (g.reg == RegState::kOk) return absl::OkStatus();
  if (g.reg == RegState::kFailed) return g.reg_status;
  if (absl::Status s = conn_.CallStatus(); !s.ok()) return s;
  return LocalTimeoutError(
      absl::StrCat("no registration result for group \"", spec.group_id, "\" (job \"",
                   options_.job_id, "\", rank ", options_.rank,
                   ") before the caller's deadline; the coordinator answers once every "
                   "rank registered the group, and names the ranks that did not once its own "
                   "--deadline passes after the group's first registration: check that all "
                   "ranks register it"));
}

void GrpcClient::HandleRegistrationLocked(const v1::RegistrationResult& r) {
  auto it = groups_.by_id.find(r.group_id());
  // A group registered again on a resumed stream is answered again.
  if (it != groups_.by_id.end() && it->second.reg == RegState::kOk) return;
  if (it == groups_.by_id.end() || it->second.reg != RegState::kPending) {
    ACCORD_LOG(WARNING) << "unexpected registration result for group \"" << r.group_id()
                        << "\" on rank " << options_.rank << "; ignored";
    return;
  }
  GroupState& g = it->second;
  if (r.has_error() && (r.error().kind() != v1::ERROR_KIND_UNSPECIFIED || r.error().code() != 0)) {
    NoteVerdictLocked(r.error());
    g.reg = RegState::kFailed;
    g.reg_status = wire::ErrorToStatus(r.error());
  } else if (r.spec_fingerprint() != 0 && r.spec_fingerprint() != g.spec_fingerprint) {
    g.reg = RegState::kFailed;
    g.reg_status = absl::FailedPreconditionError(absl::StrCat(
        "group \"", r.group_id(), "\": the coordinator's spec fingerprint ",
        absl::Hex(r.spec_fingerprint()), " differs from rank ", options_.rank, "'s ",
        absl::Hex(g.spec_fingerprint), "; check that every rank registers the same parameters"));
  } else {
    g.reg = RegState::kOk;
  }
}

void GrpcClient::HandleDecisionLocked(const v1::Decision& d) {
  auto it = groups_.by_id.find(d.group_id());
  if (it == groups_.by_id.end()) {
    ACCORD_LOG(WARNING) << "decision for unknown group \"" << d.group_id() << "\" step " << d.step()
                        << " on rank " << options_.rank << "; ignored";
    return;
  }
  GroupState& g = it->second;
  // A decision this rank already holds, sent again after it resumed.
  if (d.step() <= g.decided_step) return;
  if (d.local()) conn_.NoteLocalDecision();
  if (d.has_error()) NoteVerdictLocked(d.error());
  absl::StatusOr<Decision> result = DecodeDecision(g, d);
  if (result.ok()) {
    if (d.same_as_previous()) {
      g.last_decision->step = result->step;  // the same content
    } else {
      g.last_decision = *result;
    }
  }
  auto p = FindPending(g, d.step());
  if (p == g.pending.end()) {
    ACCORD_LOG(WARNING) << "decision for group \"" << d.group_id() << "\" step " << d.step()
                        << " that rank " << options_.rank << " is not waiting for; ignored";
    return;
  }
  p->state->CompleteLocked(std::move(result));
  g.decided_step = std::max(g.decided_step, d.step());
  g.pending.erase(p);
}

absl::StatusOr<Decision> GrpcClient::DecodeDecision(const GroupState& g,
                                                    const v1::Decision& d) const {
  const auto where = [&] {
    return absl::StrCat("decision for group \"", d.group_id(), "\" step ", d.step(), " (job \"",
                        options_.job_id, "\", rank ", options_.rank, ")");
  };
  if (d.has_error()) return wire::ErrorToStatus(d.error());
  if (d.same_as_previous()) {
    if (!g.last_decision.has_value()) {
      return absl::InternalError(
          absl::StrCat(where(),
                       " says 'same as previous' but this rank has no previous decision for the "
                       "group; check that the sidecar and coordinator versions match the client"));
    }
    Decision out = *g.last_decision;
    out.step = d.step();
    return out;
  }
  if (!d.has_ok()) {
    return absl::InternalError(absl::StrCat(where(), " carries neither a result nor an error"));
  }
  absl::StatusOr<Decision> dec = wire::DecisionFromProto(d.step(), d.ok(), g.spec.params.size());
  if (!dec.ok()) {
    return absl::InternalError(absl::StrCat("malformed ", where(), ": ", dec.status().message()));
  }
  int n = 0;
  for (bool b : dec->included) n += b ? 1 : 0;
  if (d.ok().num_included() != n) {
    return absl::InternalError(absl::StrCat("malformed ", where(), ": num_included ",
                                            d.ok().num_included(), " but ", n,
                                            " bits are set in included_bits"));
  }
  const uint64_t local = LayoutFingerprint(g.spec, LayoutWorld(g.spec, options_.world_size),
                                           dec->included, dec->wire_dtype);
  if (local != dec->layout_fingerprint) {
    return absl::InternalError(absl::StrCat(
        where(), ": layout fingerprint ", absl::Hex(dec->layout_fingerprint),
        " differs from the one this rank computes (", absl::Hex(local),
        ") for the registered spec; check that every rank runs the same accord version and "
        "registered the same world size"));
  }
  return dec;
}

void GrpcClient::FailAllLocked(const absl::Status& s) {
  for (auto& [id, g] : groups_.by_id) {
    for (Pending& p : g.pending) p.state->Complete(s);
    g.pending.clear();
    if (g.reg == RegState::kPending) {
      g.reg = RegState::kFailed;
      g.reg_status = s;
    }
  }
}

}  // namespace accord
