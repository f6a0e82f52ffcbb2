#include "daemon/coordinator/step_pipeline.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/located_errors.h"
#include "proto/wire.h"

namespace accord::daemon {

using located::Error;
using located::ErrorFrom;
using located::OutOfOrder;

bool StepPipeline::CanRunSideBySide(const std::vector<EntryRef>& refs) {
  const size_t n = refs.size();
  if (executor_->threads() <= 1 || n < 2 ||
      static_cast<int64_t>(n) < options_.parallel_min_entries) {
    return false;
  }
  // HandleEntry changes only its own group's state.
  ++batch_stamp_;
  for (const EntryRef& r : refs) {
    if (r.g == nullptr || r.ng == nullptr || r.g->marks.ready || r.g->marks.batch == batch_stamp_) {
      return false;
    }
    r.g->marks.batch = batch_stamp_;
  }
  return true;
}

bool StepPipeline::HandleBatch(JobCore& job, NodeState& node, NodeSink* sink,
                               std::vector<EntryRef>& refs, Times times, JobEffects& fx) {
  const Sender s{job, node, sink};
  const size_t n = refs.size();
  bool all_added = true;
  // With more than one thread, the steps this batch completes are decided
  // together at its end.
  Ready collected;
  Ready* ready = executor_->threads() > 1 ? &collected : nullptr;
  if (!CanRunSideBySide(refs)) {
    for (const EntryRef& r : refs) all_added = HandleManifest(s, r, times, ready, fx) && all_added;
  } else {
    std::vector<EntryResult>& results = results_;
    results.assign(n, EntryResult());
    executor_->ParallelFor(static_cast<int64_t>(n), [&](int64_t i) {
      const EntryRef& r = refs[i];
      EntryResult& result = results[i];
      result.answer = AnswersWithoutContent(job, r.g, r.ng, r.m.step);
      if (!result.answer) HandleEntry(job, node, *r.g, *r.ng, r.m, times.start, result);
    });
    fx.stats().parallel_entries += static_cast<int64_t>(n);
    for (size_t i = 0; i < n; ++i) {
      all_added = ApplyEntry(s, refs[i], results[i], times.now, ready, fx) && all_added;
    }
  }
  if (ready != nullptr) DecideReady(job, *ready, times.now, fx);
  return all_added;
}

bool StepPipeline::HandleManifest(const Sender& s, const EntryRef& e, Times times, Ready* ready,
                                  JobEffects& fx) {
  // A group's steps are decided in order, before anything else about it.
  if (ready != nullptr && e.g != nullptr && e.g->marks.ready) {
    DecideReady(s.job, *ready, times.now, fx);
  }
  EntryResult r;
  if (AnswersWithoutContent(s.job, e.g, e.ng, e.m.step)) {
    r.answer = true;
  } else {
    HandleEntry(s.job, s.node, *e.g, *e.ng, e.m, times.start, r);
  }
  return ApplyEntry(s, e, r, times.now, ready, fx);
}

bool StepPipeline::AnswersWithoutContent(const JobCore& job, const GroupState* g,
                                         const NodeGroupState* ng, int64_t step) {
  return job.failed() || g == nullptr || ng == nullptr || ng->variant < 0 ||
         g->registration.state() == GroupRegistration::State::kFailed || step < 0 ||
         step <= g->last_decided_step();
}

void StepPipeline::HandleEntry(const JobCore& job, NodeState& node, GroupState& g,
                               NodeGroupState& ng, const ManifestRef& m, absl::Time start,
                               EntryResult& r) const {
  CountWaveSkips(g, ng);
  r.retained -= ng.contents.Prune(g.last_decided_step());
  const Content* content = ResolveContent(job, node, g, ng, m, r);
  PendingStep* p = content == nullptr ? nullptr : PendingStepFor(job, g, m, start, r);
  r.added =
      p == nullptr ? Added::kRefused : AddContribution(job, node, ng, m, content, *p, r.error);
  r.complete = r.added == Added::kAdded && p->ranks_covered >= g.registration.member_count();
}

bool StepPipeline::ApplyEntry(const Sender& s, const EntryRef& e, EntryResult& r, absl::Time now,
                              Ready* ready, JobEffects& fx) {
  CoordinatorStats& stats = fx.stats();
  ++stats.manifests;
  if (r.answer) {
    // A step the node holds the decision of needs no answer: one that was
    // decided here (or a later one), or one that cannot be taken.
    if (!e.m.decided) AnswerWithoutContent(s, e.m, e.g, e.ng, fx);
    return false;
  }
  JobCore& job = s.job;
  GroupState& g = *e.g;
  stats.cache_hits += r.cache_hits;
  stats.cache_misses += r.cache_misses;
  stats.repeat_key_mismatches += r.key_mismatches;
  stats.retained_contents += r.retained;
  job.retained += r.retained;
  if (job.observer != nullptr) {
    if (r.cache_hits > 0) job.observer->OnManifests(/*cache_hit=*/true, r.cache_hits);
    if (r.cache_misses > 0) job.observer->OnManifests(/*cache_hit=*/false, r.cache_misses);
  }
  if (r.wake != absl::InfiniteFuture()) fx.WakeAt(r.wake);
  if (r.added == Added::kRefused) {
    fx.SendDecisionError(s.sink, e.m.group_id, e.m.step, std::move(r.error));
  }
  if (r.added != Added::kAdded) return false;
  // An earlier entry of this batch failed the job; its failure answered
  // this entry's step, which was pending then.
  if (job.failed()) return false;
  s.node.last_step = std::max(s.node.last_step, e.m.step);
  if (!r.complete && job.FailIfALeftRankMisses(g, e.m.step, g.pending.at(e.m.step), fx)) {
    return true;
  }
  if (r.complete) {
    if (ready != nullptr) {
      g.marks.ready = true;
      ready->push_back(ReadyStep{&g, e.m.step});
    } else {
      DecideStep(job, g, e.m.step, nullptr, now, fx);
    }
  }
  return true;
}

void StepPipeline::AnswerWithoutContent(const Sender& s, const ManifestRef& m, const GroupState* g,
                                        const NodeGroupState* ng, JobEffects& fx) {
  const JobCore& job = s.job;
  // Built only on the error paths: the common path allocates nothing here.
  auto where = [&] {
    return absl::StrCat("job ", job.job_id, " group \"", m.group_id, "\" step ", m.step);
  };
  auto refuse = [&](v1::ErrorKind kind, std::string message) {
    fx.SendDecisionError(s.sink, m.group_id, m.step,
                         Error(kind, message, job.job_id, m.group_id, m.step));
  };
  if (job.failed()) {
    // The job's failure again (counted when it happened).
    v1::Decision* d = fx.ReplyBatch(s.sink)->add_decisions();
    d->set_group_id(std::string(m.group_id));
    d->set_step(m.step);
    *d->mutable_error() = job.failure;
    d->mutable_error()->set_kind(v1::JOB_FAILED);
    return;
  }
  if (g == nullptr || ng == nullptr || ng->variant < 0) {
    refuse(v1::UNKNOWN_GROUP,
           absl::StrCat(where(), ": node \"", s.node.node_id,
                        "\" has not registered this group; register it before sending "
                        "manifests"));
    return;
  }
  if (g->registration.state() == GroupRegistration::State::kFailed) {
    // The group's failure again (counted when it happened).
    v1::Decision* d = fx.ReplyBatch(s.sink)->add_decisions();
    d->set_group_id(g->group_id);
    d->set_step(m.step);
    *d->mutable_error() = g->registration.error();
    d->mutable_error()->set_step(m.step);
    return;
  }
  if (m.step < 0) {
    refuse(v1::INVALID_MANIFEST, absl::StrCat(where(), ": negative step"));
    return;
  }
  if (m.step == g->last_decided_step() && g->last_decision() != nullptr) {
    // A resend after a reconnect whose decision was lost: answer again.
    v1::Decision* again = fx.ReplyBatch(s.sink)->add_decisions();
    *again = *g->last_decision();
    again->set_step(m.step);
    again->set_wait_us(g->last_decision_wait_us());
    return;
  }
  refuse(v1::STEP_REGRESSION,
         absl::StrCat(where(), ": step ", m.step, " is older than the last decided step ",
                      g->last_decided_step(),
                      " of this group; check that the training loop's step counter "
                      "only moves forward (was the process restarted alone?)"));
}

const Content* StepPipeline::ResolveContent(const JobCore& job, const NodeState& node,
                                            GroupState& g, NodeGroupState& ng, const ManifestRef& m,
                                            EntryResult& r) {
  if (m.repeat) {
    const Content* cached = ng.contents.Repeat(m.cache_key);
    if (cached == nullptr) {
      ++r.key_mismatches;
      r.error = OutOfOrder(
          v1::INVALID_MANIFEST,
          absl::StrCat("job ", job.job_id, " group \"", m.group_id, "\" step ", m.step,
                       ": repeat-form manifest with cache key ", absl::Hex(m.cache_key),
                       " but node \"", node.node_id, "\"'s previous manifest for this group ",
                       ng.contents.current() == nullptr
                           ? std::string("is unknown here")
                           : absl::StrCat("has key ", absl::Hex(ng.contents.current()->key)),
                       "; resend this step in full form"),
          job.job_id, m.group_id, m.step);
      r.error.set_resend_full_form(true);
      return nullptr;
    }
    ++r.cache_hits;
    ++g.counters.cache_hits;
    return cached;
  }
  const size_t num_params = g.registration.variant(ng.variant).spec.params.size();
  // A manifest without rank_bits stands for the node's member ranks.
  const std::shared_ptr<const RankSet> none;
  const NodeMembers* own = g.members() ? MemberSets::Of(node, *g.members()) : nullptr;
  const ServedRanks served =
      g.members() == nullptr ? ServedRanks{node.node_id, static_cast<int>(node.ranks.size()),
                                           node.rank_set, node.word_lo, node.word_hi}
      : own == nullptr
          ? ServedRanks{node.node_id, 0, none, 0, 0, true}
          : ServedRanks{node.node_id, own->count, own->set, own->word_lo, own->word_hi, true};
  std::shared_ptr<const Content> predecoded =
      m.predecoded != nullptr ? ContentFromPredecoded(served, num_params, *m.full, *m.predecoded)
                              : nullptr;
  absl::StatusOr<std::shared_ptr<const Content>> parsed =
      predecoded != nullptr ? std::move(predecoded)
                            : ParseContent(served, num_params, job.world_size, *m.full);
  if (!parsed.ok()) {
    const bool non_float = wire::KindOf(parsed.status()) == v1::NON_FLOAT_DTYPE;
    r.error = Error(non_float ? v1::NON_FLOAT_DTYPE : v1::INVALID_MANIFEST,
                    absl::StrCat("job ", job.job_id, ": ", parsed.status().message()), job.job_id,
                    m.group_id, m.step);
    return nullptr;
  }
  r.retained += ng.contents.Replace(*std::move(parsed));
  ++r.cache_misses;
  ++g.counters.cache_misses;
  return ng.contents.current().get();
}

PendingStep* StepPipeline::PendingStepFor(const JobCore& job, GroupState& g, const ManifestRef& m,
                                          absl::Time start, EntryResult& r) const {
  auto pit = g.pending.find(m.step);
  if (pit != g.pending.end()) {
    // The first manifest of a node that waits for the step starts the clock
    // of a step only `decided` manifests spoke for.
    if (!m.decided && !pit->second.clock.started()) {
      r.wake = std::min(r.wake, job.StartClock(pit->second, start));
    }
    return &pit->second;
  }
  if (static_cast<int>(g.pending.size()) >= options_.max_pending_steps) {
    r.error = Error(v1::LIMIT_EXCEEDED,
                    absl::StrCat("job ", job.job_id, " group \"", m.group_id, "\" step ", m.step,
                                 ": ", g.pending.size(),
                                 " steps of this group are already waiting for ranks "
                                 "(--max_pending_steps); some ranks are far behind"),
                    job.job_id, m.group_id, m.step);
    return nullptr;
  }
  auto [it, wake] = job.StartStep(g, m.step, m.decided ? absl::InfiniteFuture() : start);
  r.wake = std::min(r.wake, wake);
  return &it->second;
}

StepPipeline::Added StepPipeline::AddContribution(const JobCore& job, NodeState& node,
                                                  NodeGroupState& ng, const ManifestRef& m,
                                                  const Content* content, PendingStep& p,
                                                  v1::DecisionError& error) {
  if (ng.contents.Contributed(m.step)) {
    // The node already spoke for this step: an identical resend is a no-op;
    // ranks that joined the node late may add a disjoint contribution.
    RankSet earlier(job.world_size);
    for (const Contribution& c : p.contributions) {
      if (c.node != &node) continue;
      if (c.content == content ||
          (c.content->key == content->key && *c.content->ranks == *content->ranks)) {
        return Added::kResent;
      }
      earlier.Union(*c.content->ranks);
    }
    if (earlier.Intersects(*content->ranks)) {
      // A restarted relay resends in parts what it had sent as one manifest
      // (docs/ARCHITECTURE.md, "Relays"): ranks already spoken for add nothing.
      RankSet both = earlier;
      both.Union(*content->ranks);
      if (both == earlier) return Added::kResent;
      error = OutOfOrder(v1::INVALID_MANIFEST,
                         absl::StrCat("job ", job.job_id, " group \"", m.group_id, "\" step ",
                                      m.step, ": node \"", node.node_id,
                                      "\" sent a second, different manifest for ranks it already "
                                      "reported at this step"),
                         job.job_id, m.group_id, m.step);
      return Added::kRefused;
    }
  } else {
    ng.contents.AddStep(m.step);
  }
  // content is the cache's current one here: its key and rank count are in
  // the cache (no Content access, and no reference count traffic, per repeat).
  p.ranks_covered += ng.contents.rank_count();
  p.combined_key += MixKey(ng.contents.key());
  p.contributions.push_back(Contribution{&node, content, &ng});
  p.all_repeat = p.all_repeat && m.repeat;
  ng.contents.CountSkips();
  return Added::kAdded;
}

absl::StatusOr<Decision> StepPipeline::ComputeDecision(const RegVariant& agreed, int world_size,
                                                       int64_t step, const PendingStep& p) {
  StepMerger merger(agreed.spec.params.size(), world_size, step);
  for (const Contribution& c : p.contributions) merger.Add(*c.content);
  return merger.Decide(agreed);
}

void StepPipeline::DecideReady(JobCore& job, Ready& ready_in, absl::Time now, JobEffects& fx) {
  if (ready_in.empty()) return;
  Ready ready = std::move(ready_in);
  ready_in.clear();
  if (job.failed()) {
    // The job failed while these waited (a rank that left, seen by a later
    // entry of the batch): its failure answered them, pending steps are gone.
    for (const ReadyStep& r : ready) r.group->marks.ready = false;
    return;
  }
  // The steps that need a core Decide, and what each one's merge costs.
  struct Work {
    const RegVariant* agreed;
    const PendingStep* step;
    int64_t step_id;
    std::optional<absl::StatusOr<Decision>> decision;
  };
  std::vector<Work> work;
  std::vector<int> work_of(ready.size(), -1);
  int64_t contents = 0;
  for (size_t i = 0; i < ready.size(); ++i) {
    GroupState& g = *ready[i].group;
    const PendingStep& p = g.pending.at(ready[i].step);
    if (g.SameAsPrevious(p)) continue;
    work_of[i] = static_cast<int>(work.size());
    work.push_back(Work{&g.registration.reference(), &p, ready[i].step, std::nullopt});
    contents += static_cast<int64_t>(p.contributions.size());
  }
  if (work.size() >= 2 && executor_->threads() > 1 &&
      contents >= options_.parallel_decide_min_contents) {
    // Each part reads its step's contents and registration (unchanged until
    // the loop returns) and writes its own slot.
    const int world = job.world_size;
    executor_->ParallelFor(static_cast<int64_t>(work.size()), [&work, world](int64_t i) {
      Work& w = work[i];
      w.decision = ComputeDecision(*w.agreed, world, w.step_id, *w.step);
    });
    fx.stats().parallel_decides += static_cast<int64_t>(work.size());
  }
  for (size_t i = 0; i < ready.size(); ++i) {
    GroupState& g = *ready[i].group;
    g.marks.ready = false;
    absl::StatusOr<Decision>* computed = nullptr;
    if (work_of[i] >= 0 && work[work_of[i]].decision.has_value()) {
      computed = &*work[work_of[i]].decision;
    }
    DecideStep(job, g, ready[i].step, computed, now, fx);
  }
}

void StepPipeline::DecideStep(JobCore& job, GroupState& g, int64_t step,
                              absl::StatusOr<Decision>* computed, absl::Time now, JobEffects& fx) {
  PendingStep& p = g.pending.at(step);
  CoordinatorStats& stats = fx.stats();
  v1::Decision* d = fx.Decisions().add_decisions();
  d->set_group_id(g.group_id);
  d->set_step(step);
  d->set_wait_us(p.clock.started() ? absl::ToInt64Microseconds(now - p.clock.first_seen()) : 0);
  ++stats.decisions;
  // The step's contents, handed to the usage window when it needs them.
  auto contents = [&p] {
    std::vector<std::shared_ptr<const Content>> out;
    out.reserve(p.contributions.size());
    for (const Contribution& c : p.contributions) out.push_back(c.Owner());
    p.contributions.clear();
    return out;
  };
  std::optional<absl::StatusOr<Decision>> decision;
  if (g.SameAsPrevious(p)) {
    d->set_same_as_previous(true);
    ++stats.same_as_previous;
  } else {
    decision = computed != nullptr
                   ? std::move(*computed)
                   : ComputeDecision(g.registration.reference(), job.world_size, step, p);
    if (decision->ok()) {
      wire::DecisionToProto(**decision, d->mutable_ok());
    } else {
      *d->mutable_error() =
          ErrorFrom(v1::INVALID_MANIFEST, decision->status(),
                    absl::StrCat("job ", job.job_id, ": "), job.job_id, g.group_id, step);
      fx.NoteError(d->error());
    }
  }
  g.RecordDecision(step, *d, p.combined_key);
  const Decision* decided = decision.has_value() && decision->ok() ? &**decision : nullptr;
  job.ObserveDecision(g, step, &p, *d, decided, contents, fx);
  g.pending.erase(step);
}

}  // namespace accord::daemon
