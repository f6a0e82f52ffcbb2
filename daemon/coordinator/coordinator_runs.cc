// The coordinator's runs (docs/ARCHITECTURE.md, "Runs"): which run a node
// or a key-value request belongs to, starting, superseding and ending runs.
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/coordinator_effects.h"
#include "daemon/coordinator/located_errors.h"
#include "proto/wire.h"

namespace accord::daemon {

using located::Error;

namespace {

// Whether the job's current `run` takes `run_id`, unknown here, as another id
// of itself when `node_id` RESUMEs it (docs/ARCHITECTURE.md, "Runs"), and
// then adopts it: a run this coordinator drew (not one a RESUME took over:
// two runs both resumed were both welcomed, so are two launches), healthy,
// that has decided nothing (a launch's decisions need every rank, so a run
// whose other half never joined has none), and that the resuming node is not
// already in (a node of the run asking for another one is stale). `job`: the
// run's job, nullptr before a node joined.
bool Adopt(const RunRegistry& runs, const Job* job, const std::string& job_id, Run& run,
           const std::string& run_id, const std::string& node_id) {
  if (run.taken_over || run.state == RunState::kFailed || run.aliases.size() >= Run::kMaxAliases ||
      runs.Remembered(job_id, run_id) || run.node_epochs.contains(node_id)) {
    return false;
  }
  if (job != nullptr) {
    for (const auto& [group_id, g] : job->core().groups) {
      if (g.last_decided_step() >= 0) return false;
    }
  }
  ACCORD_LOG(INFO) << "job " << job_id << ": run " << run.run_id << " adopts run " << run_id
                   << ", which node \"" << node_id
                   << "\" resumes: both are this launch's (the first died with the previous "
                      "coordinator before every node was welcomed)";
  run.aliases.push_back(run_id);
  return true;
}

}  // namespace

void Coordinator::EndRunLocked(const std::string& job_id, const absl::Status& why_given,
                               const v1::DecisionError* error, Outbox& out) {
  const Run* run = runs_.Find(job_id);
  if (run == nullptr) return;
  const Run ended = *run;  // as it was: ids and aliases, remembered below
  // A run that failed ends with its failure, whatever ends it now (a restart
  // superseding it, say): its ranks were told that, and one that is late
  // (stopped, or slow) must get the same words, not news of the restart.
  absl::Status why = why_given;
  if (ended.state == RunState::kFailed) {
    why = wire::ErrorToStatus(ended.failure);
    if (error != nullptr) error = &ended.failure;
  }
  const std::string& run_id = ended.run_id;
  const std::string scope = RunRegistry::KeyScopeOf(ended);
  if (auto jit = jobs_.find(job_id); jit != jobs_.end()) {
    Job& job = jit->second;
    Effects fx(*this, out, &job);
    for (auto& [node_id, node] : job.core().members.nodes()) {
      if (node.sink == nullptr || error == nullptr) continue;
      fx.SendError(node.sink, *error);
    }
    RemoveJobLocked(&job);  // queues the run's end
  }
  if (runs_.End(job_id, run_id, why)) {
    ACCORD_LOG(INFO) << "job " << job_id << " run " << run_id
                     << " ended; its state and keys are dropped";
    stats_.runs = static_cast<int64_t>(runs_.size());
  } else {
    runs_.SetLastEndReason(scope, why);  // the end RemoveJobLocked queued
  }
  // A superseded run is never resumed: its late requests get RUN_ENDED.
  if (error != nullptr) runs_.Remember(job_id, ended, *error);
}

namespace {

// The refusal of a RESUME of run `run_id`, which has ended (`current`: the
// job's current run, if any). Every node of the old run gets the same words,
// so its ranks end with one error; the log names the node.
absl::Status ResumedRunEnded(const std::string& job_id, const std::string& run_id,
                             const std::string& node_id, const std::string& current) {
  ACCORD_LOG(WARNING) << "job " << job_id << ": node \"" << node_id << "\" resumes run " << run_id
                      << ", which has ended"
                      << (current.empty() ? "" : absl::StrCat(" (current run ", current, ")"));
  if (current.empty()) {
    return wire::KindError(
        v1::RUN_ENDED,
        absl::StrCat("job ", job_id, " run ", run_id,
                     " has ended (its last node left, it failed and its nodes left, or a restart "
                     "superseded it); its ranks still speak for it: stop them"));
  }
  return wire::KindError(
      v1::RUN_ENDED,
      absl::StrCat("job ", job_id, " run ", run_id, " has ended (the job's current run is ",
                   current,
                   ", started by a restart under the same job id); its ranks still speak for the "
                   "old run: stop them"));
}

// The refusal of a run past --max_jobs (`serving` runs).
absl::Status TooManyJobs(const std::string& job_id, size_t serving) {
  return wire::KindError(
      v1::LIMIT_EXCEEDED,
      absl::StrCat("job ", job_id, ": the coordinator already serves ", serving,
                   " jobs (--max_jobs); raise the limit or shard jobs across coordinators"));
}

}  // namespace

absl::StatusOr<Run*> Coordinator::JoinRunLocked(const std::string& job_id,
                                                v1::NodeHello::RunStart start,
                                                const std::string& run_id,
                                                const std::string& node_id, uint64_t node_epoch,
                                                Outbox& out) {
  Run* current = runs_.Find(job_id);
  auto start_run = [&](std::string id, bool taken_over = false) -> absl::StatusOr<Run*> {
    if (static_cast<int>(runs_.size()) >= options_.max_jobs)
      return TooManyJobs(job_id, runs_.size());
    Run& run = runs_.Start(job_id, std::move(id), timer_.Now());
    stats_.runs = static_cast<int64_t>(runs_.size());
    ACCORD_LOG(INFO) << "job " << job_id << ": run " << run.run_id << " started";
    // Until a node joins, the run ends at run_start_timeout (the timer).
    if (!jobs_.contains(job_id)) timer_.WakeAt(run.started + options_.run_start_timeout);
    if (!node_id.empty()) run.node_epochs[node_id] = node_epoch;
    run.taken_over = taken_over;
    return &run;
  };
  if (start == v1::NodeHello::RUN_START_RESUME) {
    // A reconnect (or a request stamped with the run): the run must be the
    // current one, or unknown here (this coordinator restarted) and not one
    // that ended here. A node back too late for a run that failed or was
    // superseded gets the very error the run's other nodes got, so every
    // rank of the run ends with one error (docs/RELIABILITY.md, "Chaos").
    if (const v1::DecisionError* why = runs_.RememberedError(job_id, run_id)) {
      if (current == nullptr || !current->Names(run_id)) {
        return wire::KindError(why->kind(), why->message());
      }
    }
    if (current == nullptr) {
      if (runs_.Remembered(job_id, run_id)) return ResumedRunEnded(job_id, run_id, node_id, "");
      return start_run(run_id, /*taken_over=*/true);
    }
    Run& run = *current;
    auto jit = jobs_.find(job_id);
    if (!run.Names(run_id) &&
        !Adopt(runs_, jit == jobs_.end() ? nullptr : &jit->second, job_id, run, run_id, node_id)) {
      return ResumedRunEnded(job_id, run_id, node_id, run.run_id);
    }
    if (!node_id.empty()) run.node_epochs[node_id] = node_epoch;
    return &run;
  }
  if (current == nullptr) {
    if (start == v1::NodeHello::RUN_START_NEW) {
      // The run's last node went moments ago: this node may be of the same
      // launch and never have got its Welcome (it reached a relay or this
      // coordinator only after the others' streams ended). It takes that
      // run's id, as a RESUME of it would, rather than splitting the launch
      // in two runs; a new launch loses nothing by it (the run held no
      // state any more, and its ranks were gone).
      if (std::string revived = runs_.Revivable(job_id, timer_.Now()); !revived.empty()) {
        ACCORD_LOG(INFO) << "job " << job_id << ": node \"" << node_id << "\" joins run " << revived
                         << ", whose last node left less than "
                         << absl::FormatDuration(options_.node_reconnect_grace)
                         << " (--node_reconnect_grace) ago";
        return start_run(revived);
      }
    }
    return start_run(run_id);
  }
  Run& run = *current;
  if (start == v1::NodeHello::RUN_START_NEW) {
    auto nit = run.node_epochs.find(node_id);
    if (nit != run.node_epochs.end() && nit->second != node_epoch) {
      // This node's ranks were restarted: the current run is over, even if
      // a stream of it still lingers (half-open) somewhere.
      const std::string old = run.run_id;
      const std::string msg =
          absl::StrCat("job ", job_id, " run ", old, " ended: node \"", node_id,
                       "\" started a new run of the same job id (its ranks were restarted), so "
                       "this run gets no more decisions; stop the ranks of the old run");
      v1::DecisionError e = Error(v1::RUN_ENDED, msg, job_id);
      ACCORD_LOG(WARNING) << msg;
      EndRunLocked(job_id, wire::KindError(v1::RUN_ENDED, msg), &e, out);
      return start_run("");
    }
    run.node_epochs[node_id] = node_epoch;
  }
  return &run;
}

absl::Time Coordinator::ExpireStartingRunsLocked(absl::Time now) {
  absl::Time next = absl::InfiniteFuture();
  Outbox none;
  for (const std::string& job_id : runs_.StartingPast(now, options_.run_start_timeout, next)) {
    const std::string run_id = runs_.Find(job_id)->run_id;
    ACCORD_LOG(WARNING) << "job " << job_id << ": run " << run_id
                        << " got no node within --run_start_timeout; ending it";
    EndRunLocked(job_id,
                 wire::KindError(v1::RUN_ENDED,
                                 absl::StrCat("job ", job_id, " run ", run_id,
                                              " ended: no node joined it within ",
                                              absl::FormatDuration(options_.run_start_timeout),
                                              " (--run_start_timeout)")),
                 nullptr, none);
  }
  return next;
}

absl::StatusOr<std::string> Coordinator::RunForKeyValue(const std::string& job_id,
                                                        const KeyValueOrigin& origin) {
  absl::StatusOr<std::string> result;
  {
    accord::MutexLock l(&mu_);
    Outbox out;
    v1::NodeHello::RunStart start = v1::NodeHello::RUN_START_UNSPECIFIED;
    if (!origin.run_id.empty()) {
      start = v1::NodeHello::RUN_START_RESUME;
    } else if (!origin.node_id.empty()) {
      start = v1::NodeHello::RUN_START_NEW;
    }
    absl::StatusOr<Run*> run =
        JoinRunLocked(job_id, start, origin.run_id, origin.node_id, origin.node_epoch, out);
    if (!run.ok()) {
      result = run.status();
    } else {
      result = RunRegistry::KeyScopeOf(**run);
    }
    FlushLocked(out);
  }
  Deliver();
  return result;
}

std::string Coordinator::CurrentRun(const std::string& job_id) {
  accord::MutexLock l(&mu_);
  const Run* run = runs_.Find(job_id);
  return run == nullptr ? "" : run->run_id;
}

}  // namespace accord::daemon
