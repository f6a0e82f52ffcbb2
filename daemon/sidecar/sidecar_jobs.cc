#include "daemon/sidecar/sidecar_jobs.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/rank_set.h"
#include "daemon/common/decision_errors.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

void AddCounters(const SidecarStats& from, SidecarStats* into) {
  into->rank_manifests += from.rank_manifests;
  into->node_manifests_full += from.node_manifests_full;
  into->node_manifests_repeat += from.node_manifests_repeat;
  into->node_batch_repeats += from.node_batch_repeats;
  into->decisions_in += from.decisions_in;
  into->decisions_ignored += from.decisions_ignored;
  into->local_decisions += from.local_decisions;
  into->local_confirmed += from.local_confirmed;
  into->local_mismatches += from.local_mismatches;
  into->adapter_speculated += from.adapter_speculated;
  into->adapter_repaired += from.adapter_repaired;
  into->adapter_redone += from.adapter_redone;
}

void Refuse(RankSink* sink, const std::string& job_id, int rank, v1::DecisionError error) {
  v1::RankReply reply;
  *reply.mutable_error() = std::move(error);
  if (!job_id.empty()) reply.mutable_error()->set_job_id(job_id);
  if (rank >= 0) reply.mutable_error()->add_ranks(rank);
  const absl::Status status = wire::ErrorToStatus(reply.error());
  sink->Send(std::make_shared<const v1::RankReply>(std::move(reply)));
  sink->Close(status);
}

// Puts `value` for `job_id` last in `kept`, in place of the id's earlier
// one; the oldest id goes past SidecarJobs::kEndedJobsKept.
template <typename T>
void KeepLatest(std::deque<std::pair<std::string, T>>* kept, const std::string& job_id, T value) {
  for (auto it = kept->begin(); it != kept->end(); ++it) {
    if (it->first == job_id) {
      kept->erase(it);
      break;
    }
  }
  kept->emplace_back(job_id, std::move(value));
  while (static_cast<int>(kept->size()) > SidecarJobs::kEndedJobsKept) kept->pop_front();
}

}  // namespace

SidecarJobs::SidecarJobs(SidecarJobsOptions options, UpstreamOpener opener)
    : options_(std::move(options)),
      opener_(std::move(opener)),
      clock_(options_.sidecar.clock != nullptr ? options_.sidecar.clock : RealClock::Get()) {
  {
    accord::MutexLock l(&mu_);
    idle_.spare = OpenLaunchLocked();
  }
  if (options_.start_thread) thread_ = std::thread([this] { Loop(); });
}

SidecarJobs::~SidecarJobs() { Stop(); }

void SidecarJobs::Stop() {
  {
    accord::MutexLock l(&mu_);
    if (stopping_) return;
    stopping_ = true;
    wake_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
  std::vector<std::unique_ptr<Launch>> all;
  {
    accord::MutexLock l(&mu_);
    for (auto& [id, s] : sessions_) {
      if (s.state == State::kHeld) {
        Refuse(s.sink, s.job_id, s.rank,
               KindedError(v1::UNAVAILABLE, "the sidecar is shutting down"));
        s.state = State::kRefused;
      }
    }
    for (auto& [id, job] : jobs_) {
      job.held.clear();
      if (job.launch != nullptr) all.push_back(std::move(job.launch));
    }
    for (auto& l : idle_.retired) all.push_back(std::move(l));
    idle_.retired.clear();
    if (idle_.spare != nullptr) all.push_back(std::move(idle_.spare));
  }
  // Each Sidecar's timer sends upstream: stopped before its stream.
  for (auto& l : all) l->sidecar->Stop();
  for (auto& l : all) l->upstream.reset();
}

SidecarStats SidecarJobs::LaunchHistory::Start(const std::string& job_id) {
  ++started_;
  SidecarStats carried;
  for (auto it = ended_.begin(); it != ended_.end(); ++it) {
    if (it->first == job_id) {
      carried = std::move(it->second);
      ended_.erase(it);
      break;
    }
  }
  return carried;
}

void SidecarJobs::LaunchHistory::End(const std::string& job_id, SidecarStats final_stats) {
  KeepLatest(&ended_, job_id, std::move(final_stats));
}

void SidecarJobs::LaunchHistory::Retire(const std::string& job_id, Incarnation incarnation) {
  KeepLatest(&incarnations_, job_id, std::move(incarnation));
}

std::optional<SidecarJobs::Incarnation> SidecarJobs::LaunchHistory::Continued(
    const std::string& job_id, const std::string& launch_id, int rank, absl::Time retired_since) {
  if (launch_id.empty()) return std::nullopt;
  for (auto it = incarnations_.begin(); it != incarnations_.end(); ++it) {
    if (it->first != job_id) continue;
    const Incarnation& inc = it->second;
    if (inc.launch_id != launch_id || inc.retired_at < retired_since ||
        std::binary_search(inc.ranks.begin(), inc.ranks.end(), rank)) {
      return std::nullopt;
    }
    Incarnation out = std::move(it->second);
    incarnations_.erase(it);
    return out;
  }
  return std::nullopt;
}

bool SidecarJobs::HadRank(Launch& launch, int rank) {
  return std::binary_search(launch.ranks.begin(), launch.ranks.end(), rank) ||
         launch.sidecar->HadRank(rank);
}

std::unique_ptr<SidecarJobs::Launch> SidecarJobs::OpenLaunchLocked() {
  auto launch = std::make_unique<Launch>();
  SidecarOptions o = options_.sidecar;
  o.reset_when_empty = false;  // retired instead
  launch->sidecar = std::make_unique<Sidecar>(std::move(o));
  launch->upstream = opener_(launch->sidecar.get());
  return launch;
}

Sidecar::SessionId SidecarJobs::OpenRank(RankSink* sink) {
  accord::MutexLock l(&mu_);
  const SessionId id = next_session_++;
  sessions_[id].sink = sink;
  return id;
}

int SidecarJobs::RanksLocked() const {
  int n = 0;
  for (const auto& [id, s] : sessions_) {
    n += s.state == State::kHeld || s.state == State::kRouted ? 1 : 0;
  }
  return n;
}

void SidecarJobs::HandleRankMessage(SessionId id, const v1::RankMessage& message) {
  Sidecar* target = nullptr;
  SessionId routed_id = 0;
  {
    accord::MutexLock l(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end() || stopping_) return;
    Session& s = it->second;
    switch (s.state) {
      case State::kRouted:
        target = s.launch->sidecar.get();
        routed_id = s.routed_id;
        break;
      case State::kHeld:
        if (static_cast<int>(s.held.size()) > options_.max_held_messages) {
          RefuseLocked(id, s, s.job_id, s.rank,
                       OutOfOrderError(v1::INVALID_REQUEST,
                                       absl::StrCat("job ", s.job_id, ": rank ", s.rank, " sent ",
                                                    s.held.size(),
                                                    " messages before its RankHello was answered; "
                                                    "wait for the Welcome")));
          return;
        }
        s.held.push_back(message);
        return;
      case State::kNew:
        if (!message.has_hello()) {
          RefuseLocked(id, s, "", -1, OutOfOrderError(v1::INVALID_REQUEST, "send RankHello first"));
          return;
        }
        HandleHelloLocked(id, s, message);
        return;
      case State::kRefused:
        return;
    }
  }
  // Without this class's lock: the launch lives while this session does.
  target->HandleRankMessage(routed_id, message);
}

void SidecarJobs::HandleHelloLocked(SessionId id, Session& s, const v1::RankMessage& message) {
  const v1::RankHello& hello = message.hello();
  if (std::optional<v1::DecisionError> refused = Sidecar::CheckHello(options_.sidecar, hello)) {
    RefuseLocked(id, s, hello.job_id(), hello.rank(), *std::move(refused));
    return;
  }
  if (RanksLocked() >= options_.sidecar.max_ranks) {
    RefuseLocked(
        id, s, hello.job_id(), hello.rank(),
        KindedError(v1::LIMIT_EXCEEDED, absl::StrCat("this sidecar already serves ", RanksLocked(),
                                                     " ranks (--max_ranks)")));
    return;
  }
  s.job_id = hello.job_id();
  s.launch_id = hello.launch_id();
  s.rank = hello.rank();
  s.held.assign(1, message);
  Job& job = jobs_[s.job_id];
  // A rank that resumes the current launch's run after its stream dropped
  // (docs/RELIABILITY.md, "Sidecar restart") goes back to that launch.
  const bool resumes_launch = hello.has_resume() && job.held.empty() && job.launch != nullptr &&
                              !job.launch->emptied && !hello.resume().run_id().empty() &&
                              job.launch->sidecar->CurrentRun().run_id == hello.resume().run_id();
  const bool other_launch = job.launch != nullptr && !job.launch->launch_id.empty() &&
                            !s.launch_id.empty() && s.launch_id != job.launch->launch_id;
  const bool new_launch =
      !resumes_launch &&
      (!job.held.empty() || (job.launch != nullptr && (job.launch->emptied || other_launch ||
                                                       HadRank(*job.launch, s.rank))));
  if (!new_launch) {
    std::optional<Incarnation> continued;
    if (job.launch == nullptr && !hello.has_resume()) {
      continued = history_.Continued(s.job_id, s.launch_id, s.rank,
                                     clock_->Now() - options_.handover_timeout);
    }
    RouteLocked(id, s, job, s.job_id, std::move(continued));
    return;
  }
  // A rank the current launch already had, or of another launch: a new
  // launch of the job, served once the current one's ranks have left.
  s.state = State::kHeld;
  s.held_since = clock_->Now();
  job.held.push_back(id);
  wake_.SignalAll();
  std::vector<int> connected;
  if (job.launch != nullptr) connected = job.launch->sidecar->ConnectedRanks();
  ACCORD_LOG(INFO) << "job " << s.job_id << ": rank " << s.rank
                   << " starts a new launch of the job on this node; its hello waits until the "
                      "previous launch's ranks "
                   << FormatRanks(connected) << " have left (at most "
                   << absl::FormatDuration(options_.handover_timeout)
                   << ", --job_handover_timeout)";
}

void SidecarJobs::RouteLocked(SessionId id, Session& s, Job& job, const std::string& job_id,
                              std::optional<Incarnation> continued) {
  if (job.launch == nullptr) {
    std::unique_ptr<Launch> launch = std::move(idle_.spare);
    if (launch == nullptr) launch = OpenLaunchLocked();
    launch->job_id = job_id;
    launch->launch_id = s.launch_id;
    launch->carried = history_.Start(job_id);
    if (continued.has_value()) {
      ACCORD_LOG(INFO) << "job " << job_id << ": rank " << s.rank << " of launch \"" << s.launch_id
                       << "\" arrived after that launch's ranks " << FormatRanks(continued->ranks)
                       << " left this node; it continues their run "
                       << (continued->run_id.empty() ? std::string("(not yet placed)")
                                                     : continued->run_id)
                       << " as the same incarnation";
      launch->ranks = std::move(continued->ranks);
      launch->sidecar->ContinueIncarnation(std::move(continued->run_id), continued->node_epoch);
    }
    job.launch = std::move(launch);
    idle_.spare = OpenLaunchLocked();
  }
  Launch& launch = *job.launch;
  if (auto it = std::lower_bound(launch.ranks.begin(), launch.ranks.end(), s.rank);
      it == launch.ranks.end() || *it != s.rank) {
    launch.ranks.insert(it, s.rank);
  }
  s.state = State::kRouted;
  s.launch = &launch;
  s.routed_id = launch.sidecar->OpenRank(s.sink);
  ++launch.sessions;
  std::vector<v1::RankMessage> messages = std::move(s.held);
  s.held.clear();
  for (const v1::RankMessage& m : messages) launch.sidecar->HandleRankMessage(s.routed_id, m);
}

void SidecarJobs::CloseRank(SessionId id) {
  accord::MutexLock l(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  Session s = std::move(it->second);
  sessions_.erase(it);
  if (stopping_) return;
  switch (s.state) {
    case State::kRouted: {
      // The run and epoch, before the last rank's leave resets the Sidecar.
      Sidecar::RunStamp run = s.launch->sidecar->CurrentRun();
      if (run.node_epoch != 0) s.launch->last_run = std::move(run);
      s.launch->sidecar->CloseRank(s.routed_id);
      LeaveLaunchLocked(s);
      return;
    }
    case State::kHeld: {
      Job& job = jobs_[s.job_id];
      job.held.erase(std::remove(job.held.begin(), job.held.end(), id), job.held.end());
      ForgetJobIfIdleLocked(s.job_id);
      return;
    }
    case State::kNew:
    case State::kRefused:
      return;
  }
}

void SidecarJobs::LeaveLaunchLocked(Session& s) {
  Launch* launch = s.launch;
  if (!launch->emptied && launch->sidecar->ConnectedRanks().empty()) {
    // Its last rank left; a session still routed to it was refused and is
    // closing. The job's next rank goes to a new launch.
    launch->emptied = true;
  }
  if (--launch->sessions > 0) return;
  const std::string job_id = launch->job_id;
  auto jit = jobs_.find(job_id);
  if (jit == jobs_.end() || jit->second.launch.get() != launch) return;  // not ours
  Job& job = jit->second;
  SidecarStats final_stats = launch->sidecar->stats();
  AddCounters(launch->carried, &final_stats);
  final_stats.job_id = job_id;
  final_stats.ranks = 0;
  final_stats.sessions = 0;
  history_.End(job_id, std::move(final_stats));
  if (!launch->launch_id.empty() && launch->last_run.node_epoch != 0) {
    history_.Retire(job_id, Incarnation{launch->launch_id, launch->last_run.run_id,
                                        launch->last_run.node_epoch, launch->ranks, clock_->Now()});
  }
  idle_.retired.push_back(std::move(job.launch));
  wake_.SignalAll();
  if (job.held.empty()) {
    jobs_.erase(jit);
    return;
  }
  ServeHeldLocked(job_id);
}

void SidecarJobs::ServeHeldLocked(const std::string& job_id) {
  Job& job = jobs_[job_id];
  std::deque<SessionId> held = std::move(job.held);
  job.held.clear();
  const absl::Time now = clock_->Now();
  for (SessionId id : held) {
    auto it = sessions_.find(id);
    if (it == sessions_.end()) continue;
    Session& s = it->second;
    if (job.launch != nullptr && HadRank(*job.launch, s.rank)) {
      job.held.push_back(id);  // the same rank twice: waits for the launch after
      continue;
    }
    ACCORD_LOG(INFO) << "job " << job_id << ": the previous launch's ranks have left; serving rank "
                     << s.rank << " of the new launch after "
                     << absl::FormatDuration(now - s.held_since);
    RouteLocked(id, s, job, job_id);
  }
}

void SidecarJobs::RefuseLocked(SessionId id, Session& s, const std::string& job_id, int rank,
                               v1::DecisionError error) {
  const bool was_held = s.state == State::kHeld;
  s.state = State::kRefused;
  s.held.clear();
  Refuse(s.sink, job_id, rank, std::move(error));
  if (!was_held) return;
  auto jit = jobs_.find(s.job_id);
  if (jit == jobs_.end()) return;
  std::deque<SessionId>& held = jit->second.held;
  held.erase(std::remove(held.begin(), held.end(), id), held.end());
  ForgetJobIfIdleLocked(s.job_id);
}

void SidecarJobs::ForgetJobIfIdleLocked(const std::string& job_id) {
  auto jit = jobs_.find(job_id);
  if (jit != jobs_.end() && jit->second.launch == nullptr && jit->second.held.empty()) {
    jobs_.erase(jit);
  }
}

void SidecarJobs::RefuseExpiredLocked(absl::Time now) {
  std::vector<SessionId> expired;
  for (const auto& [job_id, job] : jobs_) {
    for (SessionId id : job.held) {
      auto it = sessions_.find(id);
      if (it != sessions_.end() && now - it->second.held_since >= options_.handover_timeout) {
        expired.push_back(id);
      }
    }
  }
  for (SessionId id : expired) {
    Session& s = sessions_[id];
    const std::string job_id = s.job_id;
    const Job& job = jobs_[job_id];
    std::vector<int> connected;
    if (job.launch != nullptr) connected = job.launch->sidecar->ConnectedRanks();
    const std::string waited =
        absl::StrCat("waited ", absl::FormatDuration(options_.handover_timeout),
                     " (--job_handover_timeout) for");
    v1::DecisionError error;
    if (std::binary_search(connected.begin(), connected.end(), s.rank)) {
      error = KindedError(
          v1::DUPLICATE_RANK,
          absl::StrCat("job ", job_id, ": rank ", s.rank, " ", waited, " the rank ", s.rank,
                       " already connected to this sidecar to leave, but it "
                       "is still connected: a previous launch of the job is still running here, "
                       "or two local processes have RANK ",
                       s.rank, "; stop the previous launch's processes or check RANK"));
    } else {
      error = OutOfOrderError(
          v1::INVALID_REQUEST,
          absl::StrCat("job ", job_id, ": rank ", s.rank,
                       " starts a new launch of the job on "
                       "this node and ",
                       waited, " the previous launch's ranks ", FormatRanks(connected),
                       " to leave, but they are still connected; stop the previous launch's "
                       "processes"));
    }
    ACCORD_LOG(WARNING) << error.message();
    RefuseLocked(id, s, job_id, s.rank, std::move(error));
  }
}

void SidecarJobs::DestroyRetiredLocked() {
  if (idle_.retired.empty()) return;
  std::vector<std::unique_ptr<Launch>> dead = std::move(idle_.retired);
  idle_.retired.clear();
  mu_.Unlock();
  // Each Sidecar's timer sends upstream: stopped before its stream.
  for (auto& l : dead) l->sidecar->Stop();
  for (auto& l : dead) l->upstream.reset();
  dead.clear();
  mu_.Lock();
}

void SidecarJobs::CheckHeld() {
  accord::MutexLock l(&mu_);
  RefuseExpiredLocked(clock_->Now());
  DestroyRetiredLocked();
}

void SidecarJobs::Loop() {
  accord::MutexLock l(&mu_);
  while (!stopping_) {
    DestroyRetiredLocked();
    if (stopping_) return;
    const absl::Time now = clock_->Now();
    RefuseExpiredLocked(now);
    if (!idle_.retired.empty()) continue;
    absl::Time next = absl::InfiniteFuture();
    for (const auto& [job_id, job] : jobs_) {
      for (SessionId id : job.held) {
        auto it = sessions_.find(id);
        if (it != sessions_.end()) {
          next = std::min(next, it->second.held_since + options_.handover_timeout);
        }
      }
    }
    clock_->WaitUntil(&wake_, &mu_, next);
  }
}

Sidecar::RunStamp SidecarJobs::CurrentRun(const std::string& job_id) {
  accord::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || it->second.launch == nullptr) return {};
  return it->second.launch->sidecar->CurrentRun();
}

SidecarJobsStats SidecarJobs::stats() {
  accord::MutexLock l(&mu_);
  SidecarJobsStats out;
  out.sessions = static_cast<int>(sessions_.size());
  out.launches = history_.started();
  for (const auto& [id, s] : sessions_) out.held += s.state == State::kHeld ? 1 : 0;
  for (const auto& [job_id, final_stats] : history_.ended()) {
    if (jobs_.contains(job_id) && jobs_.at(job_id).launch != nullptr) continue;
    out.jobs.push_back(final_stats);
  }
  for (const auto& [job_id, job] : jobs_) {
    if (job.launch == nullptr) continue;
    SidecarStats s = job.launch->sidecar->stats();
    AddCounters(job.launch->carried, &s);
    s.job_id = job_id;
    out.jobs.push_back(std::move(s));
  }
  std::sort(out.jobs.begin(), out.jobs.end(),
            [](const SidecarStats& a, const SidecarStats& b) { return a.job_id < b.job_id; });
  return out;
}

}  // namespace accord::daemon
