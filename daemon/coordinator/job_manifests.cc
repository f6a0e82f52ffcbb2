// Job: node manifests (full form, repeat form, batch repeats) and repeat
// waves (docs/ARCHITECTURE.md, "Repeat waves").
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/job.h"
#include "daemon/coordinator/located_errors.h"
#include "proto/wire.h"

namespace accord::daemon {

void Job::HandleManifests(NodeStream& s, const v1::ManifestBatch& batch,
                          std::vector<PredecodedContent>* predecoded, absl::Time now,
                          JobEffects& fx) {
  if (batch.repeat_batch_key() != 0) {
    HandleBatchRepeat(s, batch, now, fx);
    return;
  }
  if (batch.manifests_size() == 0) return;
  // The new record. An entry naming the same group as the old record's entry
  // at its position (the common case: the same groups every step) keeps its
  // resolved pointers instead of two hash lookups.
  BatchRecord& record = s.last_batch;
  const size_t n = static_cast<size_t>(batch.manifests_size());
  if (record.entries.size() > n) record.entries.resize(n);
  record.entries.reserve(n);
  record.groups_key = 0;
  const int64_t step = batch.manifests(0).step();
  // The record's key, hashed here while the entries are at hand: the first
  // batch repeat then costs O(1) (a wave at scale), not a pass over them.
  wire::BatchKeyHasher hasher;
  std::vector<EntryRef>& refs = pipeline_.refs();
  refs.clear();
  for (size_t i = 0; i < n; ++i) {
    const v1::Manifest& m = batch.manifests(static_cast<int>(i));
    if (i == record.entries.size()) record.entries.emplace_back();
    BatchEntry& e = record.entries[i];
    if (e.group_id != m.group_id()) {
      e.group_id = m.group_id();
      e.group = nullptr;
      e.node_group = nullptr;
    }
    ResolveEntry(s, e);
    e.cache_key = m.cache_key();
    hasher.Add(e.group_id, e.cache_key);
    PredecodedContent* pre =
        predecoded != nullptr && predecoded->size() == n ? &(*predecoded)[i] : nullptr;
    refs.push_back(EntryRef{ManifestRef{m.group_id(), m.step(), m.repeat(), m.cache_key(),
                                        m.repeat() ? nullptr : &m, pre, m.decided()},
                            e.group, e.node_group});
  }
  record.key = hasher.Finish();
  bool all_added = pipeline_.HandleBatch(core_, *s.node, s.sink, refs, {now, now}, fx);
  for (const EntryRef& r : refs) all_added = all_added && r.m.step == step;
  NoteSynced(s, step, all_added);
}

void Job::HandleBatchRepeat(NodeStream& s, const v1::ManifestBatch& batch, absl::Time now,
                            JobEffects& fx) {
  BatchRecord& record = s.last_batch;
  if (batch.manifests_size() > 0 || record.key != batch.repeat_batch_key()) {
    const JobCore& job = core_;
    fx.SendError(
        s.sink,
        located::OutOfOrder(
            v1::INVALID_REQUEST,
            absl::StrCat("job ", job.job_id, " step ", batch.repeat_step(), ": node \"",
                         s.node->node_id, "\" sent a batch repeat with key ",
                         absl::Hex(batch.repeat_batch_key()),
                         batch.manifests_size() > 0
                             ? std::string(" together with manifests")
                             : absl::StrCat(" but the previous batch on this stream has key ",
                                            absl::Hex(record.key), " (", record.entries.size(),
                                            " manifests)"),
                         "; the sidecar and the coordinator disagree on the stream's "
                         "history. Check the sidecar's version; restarting it resends in "
                         "full form"),
            job.job_id, "", batch.repeat_step()));
    return;
  }
  RepeatBatch(s, batch.repeat_step(), {now, now}, fx);
}

void Job::RepeatBatch(NodeStream& s, int64_t step, StepPipeline::Times times, JobEffects& fx) {
  std::vector<EntryRef>& refs = pipeline_.refs();
  refs.clear();
  for (BatchEntry& e : s.last_batch.entries) {
    ResolveEntry(s, e);  // unknown when recorded: it may have been registered since
    ManifestRef ref;
    ref.group_id = e.group_id;
    ref.step = step;
    ref.repeat = true;
    ref.cache_key = e.cache_key;
    refs.push_back(EntryRef{ref, e.group, e.node_group});
  }
  const bool all_added = pipeline_.HandleBatch(core_, *s.node, s.sink, refs, times, fx);
  NoteSynced(s, step, all_added);
}

void Job::ResolveEntry(NodeStream& s, BatchEntry& e) {
  if (e.group != nullptr && e.node_group != nullptr) return;
  auto git = core_.groups.find(e.group_id);
  auto ngit = s.node->groups.find(e.group_id);
  if (git != core_.groups.end() && ngit != s.node->groups.end()) {
    e.group = &git->second;
    e.node_group = &ngit->second;
    s.last_batch.groups_key = 0;
  }
}

void Job::NoteSynced(NodeStream& s, int64_t step, bool all_added) {
  if (!core_.options.repeat_waves) return;
  if (!core_.member_sets.empty()) {
    NoteSyncedInDomain(s, step, all_added);
    return;
  }
  // Without member sets: one domain, the job's nodes.
  waves_.world().NoteSynced(s.wave, s.last_batch, step, all_added,
                            !core_.failed() && core_.members.all_connected(),
                            core_.members.connected());
}

void Job::NoteSyncedInDomain(NodeStream& s, int64_t step, bool all_added) {
  WaveStream& w = s.wave;
  // Counted at this step already: that count was not the step's record.
  if (w.domain >= 0 && w.synced_step == step) waves_.at(waves_.Find(w.domain)).Spoil(step);
  w.domain = -1;
  BatchRecord& record = s.last_batch;
  if (!all_added || record.entries.empty()) return;
  // The record's member sets are one domain from now on. O(entries), on the
  // entry-by-entry path only.
  int root = -1;
  for (const BatchEntry& e : record.entries) {
    if (e.group == nullptr) return;
    const int r = waves_.Find(waves_.ElementOf(e.group->members()));
    if (root < 0) {
      root = r;
    } else if (r != root) {
      if (!waves_.Link(root, r)) return;  // a domain holds a wave: counted at a later sync
      root = waves_.Find(root);
    }
  }
  w.domain = root;
  const bool whole = !core_.failed() && waves_.AllConnected(root, core_.members);
  waves_.at(root).NoteSynced(w, record, step, all_added, whole,
                             waves_.Connected(root, core_.members));
}

bool Job::TryJoinWave(NodeStream& s, const v1::ManifestBatch& batch,
                      absl::FunctionRef<absl::Time()> now, JobEffects& fx) {
  if (batch.repeat_batch_key() == 0 || batch.manifests_size() > 0) return false;
  // Without member sets one domain; with them the one the record was
  // counted in (a stale root's waves hold no base).
  const bool one = core_.member_sets.empty();
  if (!one && s.wave.domain < 0) return false;
  RepeatWaves& waves = one ? waves_.world() : waves_.at(s.wave.domain);
  const int64_t step = batch.repeat_step();
  absl::Time wake = absl::InfiniteFuture();
  const RepeatWaves::Join join = waves.TryJoin(
      s.id, s.wave, s.last_batch, step, batch.repeat_batch_key(), core_.failed(), now, &wake);
  if (join == RepeatWaves::Join::kNo) return false;
  if (wake != absl::InfiniteFuture()) fx.WakeAt(wake);
  s.node->last_step = std::max(s.node->last_step, step);
  if (join == RepeatWaves::Join::kComplete) CompleteWave(waves.TakeComplete(), now(), fx);
  return true;
}

void Job::CompleteWave(RepeatWaves::Wave wave, absl::Time now, JobEffects& fx) {
  std::vector<NodeStream*> members;
  members.reserve(wave.streams.size());
  int64_t manifests = 0;
  for (StreamId id : wave.streams) {
    NodeStream& m = streams_.at(id);  // a stream that ended broke the wave first
    members.push_back(&m);
    manifests += static_cast<int64_t>(m.last_batch.entries.size());
    m.wave.synced_step = wave.step;
    m.wave.wave_step = -1;
  }
  if (core_.retained > 0) {
    // Contents retained across the base step are no longer named (the
    // entry-by-entry path would prune them now).
    for (NodeStream* m : members) {
      for (BatchEntry& e : m->last_batch.entries) {
        core_.PruneContributions(*e.group, *e.node_group, fx);
      }
    }
  }
  CoordinatorStats& stats = fx.stats();
  stats.manifests += manifests;
  stats.cache_hits += manifests;
  ++stats.repeat_waves;
  if (core_.observer != nullptr) core_.observer->OnManifests(/*cache_hit=*/true, manifests);
  const int64_t nodes = static_cast<int64_t>(members.size());
  const int64_t wait_us = absl::ToInt64Microseconds(now - wave.first_seen);
  const std::vector<BatchEntry>& entries = members.front()->last_batch.entries;
  // Without member sets the domain is the job; with them its decisions go to
  // its nodes (the wave's), which serve every member of its groups.
  auto scoped = [&]() -> v1::DecisionBatch& {
    std::vector<NodeSink*> sinks;
    sinks.reserve(members.size());
    for (NodeStream* m : members) sinks.push_back(m->sink);
    return fx.ScopedDecisions(std::move(sinks));
  };
  v1::DecisionBatch& batch = core_.member_sets.empty() ? fx.Decisions() : scoped();
  for (size_t i = 0; i < entries.size(); ++i) {
    GroupState& g = *entries[i].group;
    g.counters.cache_hits += nodes;
    ++g.waves;
    v1::Decision* d = batch.add_decisions();
    d->set_group_id(g.group_id);
    d->set_step(wave.step);
    d->set_wait_us(wait_us);
    d->set_same_as_previous(true);
    ++stats.decisions;
    ++stats.same_as_previous;
    g.RecordDecision(wave.step, *d, /*combined_key=*/0);
    auto contents = [&] {
      std::vector<std::shared_ptr<const Content>> out;
      out.reserve(members.size());
      for (NodeStream* m : members) {
        out.push_back(m->last_batch.entries[i].node_group->contents.current());
      }
      return out;
    };
    core_.ObserveDecision(g, wave.step, nullptr, *d, nullptr, contents, fx);
  }
}

void Job::BreakWave(absl::Time now, JobEffects& fx) {
  for (int e = 0; e < waves_.elements(); ++e) {
    if (waves_.IsRoot(e)) BreakDomain(e, now, fx);
  }
}

void Job::BreakDomain(int element, absl::Time now, JobEffects& fx) {
  const RepeatWaves::Wave wave = waves_.at(element).Break();
  if (wave.streams.empty()) return;
  // The held-back repeats are handled as if on arrival: the steps they
  // create start at the wave's first arrival.
  for (StreamId id : wave.streams) {
    auto it = streams_.find(id);
    if (it == streams_.end()) continue;
    it->second.wave.wave_step = -1;
    RepeatBatch(it->second, wave.step, {now, wave.first_seen}, fx);
  }
  waves_.at(element).Left();  // RepeatBatch may have synced it again
}

void Job::BreakWavesFor(const NodeStream* s, const v1::NodeMessage& message, absl::Time now,
                        JobEffects& fx) {
  // Manifests touch the domains of their groups (docs/MEMBERS.md 2.11);
  // anything else, or a job without member sets, every domain.
  if (core_.member_sets.empty() || s == nullptr || !message.has_manifests()) {
    BreakWave(now, fx);
    return;
  }
  for (int root : DomainsOf(*s, message.manifests())) BreakDomain(root, now, fx);
}

std::vector<int> Job::DomainsOf(const NodeStream& s, const v1::ManifestBatch& batch) {
  std::vector<int> roots;
  if (s.wave.domain >= 0) roots.push_back(waves_.Find(s.wave.domain));
  auto add = [&](const GroupState* g) {
    if (g != nullptr) roots.push_back(waves_.Find(waves_.ElementOf(g->members())));
  };
  const std::vector<BatchEntry>& record = s.last_batch.entries;
  if (batch.repeat_batch_key() != 0) {
    for (const BatchEntry& e : record) add(e.group);
  }
  for (int i = 0; i < batch.manifests_size(); ++i) {
    const std::string& id = batch.manifests(i).group_id();
    const size_t at = static_cast<size_t>(i);
    if (at < record.size() && record[at].group != nullptr && record[at].group_id == id) {
      add(record[at].group);  // the common case: the record's group at this position
      continue;
    }
    auto it = core_.groups.find(id);
    if (it != core_.groups.end()) add(&it->second);
  }
  std::sort(roots.begin(), roots.end());
  roots.erase(std::unique(roots.begin(), roots.end()), roots.end());
  return roots;
}

void Job::BreakWavesIfFailed(absl::Time now, JobEffects& fx) {
  if (core_.failed() && waves_.holding()) BreakWave(now, fx);
}

}  // namespace accord::daemon
