#include "daemon/coordinator/run_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/wire.h"

namespace accord::daemon {
namespace {

// A 64-bit finalizer: consecutive nonces give unrelated run ids.
uint64_t Mix(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return k;
}

}  // namespace

Run* RunRegistry::Find(const std::string& job_id) {
  auto it = runs_.find(job_id);
  return it == runs_.end() ? nullptr : &it->second;
}

Run& RunRegistry::Start(const std::string& job_id, std::string run_id, absl::Time now) {
  if (run_id.empty()) {
    const uint64_t n = nonce_++;
    run_id = absl::StrCat(
        "r", absl::Hex(Mix(n) ^ Mix(Mix(n) + 0x9e3779b97f4a7c15ull), absl::kZeroPad16));
  }
  gone_.erase(job_id);  // a run of the job is current again
  Run& run = runs_[job_id];
  run = Run();
  run.run_id = std::move(run_id);
  run.started = now;
  return run;
}

bool RunRegistry::End(const std::string& job_id, const std::string& run_id, absl::Status why) {
  auto it = runs_.find(job_id);
  if (it == runs_.end() || it->second.run_id != run_id) return false;
  ended_.push_back(EndedRun{job_id, KeyScopeOf(it->second), std::move(why), ""});
  runs_.erase(it);
  return true;
}

void RunRegistry::SetLastEndReason(const std::string& scope, absl::Status why) {
  if (!ended_.empty() && ended_.back().run_id == scope) ended_.back().why = std::move(why);
}

void RunRegistry::Fail(const std::string& job_id, const std::string& run_id,
                       const v1::DecisionError& error) {
  Run* run = Find(job_id);
  if (run == nullptr || run->run_id != run_id || run->state == RunState::kFailed) return;
  const std::string scope = KeyScopeOf(*run);
  run->SetFailed(error);
  ended_.push_back(EndedRun{job_id, scope, wire::ErrorToStatus(error), KeyScopeOf(*run)});
}

void RunRegistry::NoteLastNodeGone(const std::string& job_id, const std::string& run_id,
                                   absl::Time at, absl::Duration grace) {
  const uint64_t note = ++gone_notes_;
  gone_[job_id] = Gone{run_id, at + grace, note};
  gone_order_.emplace_back(job_id, note);
  while (gone_order_.size() > kRemembered) {
    const auto& [oldest, its_note] = gone_order_.front();
    // A later note of the same job replaced it: that one stays.
    auto it = gone_.find(oldest);
    if (it != gone_.end() && it->second.note == its_note) gone_.erase(it);
    gone_order_.pop_front();
  }
}

std::string RunRegistry::Revivable(const std::string& job_id, absl::Time now) const {
  auto it = gone_.find(job_id);
  if (it == gone_.end() || now >= it->second.until) return "";
  return it->second.run_id;
}

void RunRegistry::Remember(const std::string& job_id, const std::string& run_id,
                           v1::DecisionError why) {
  if (remembered_why_.insert_or_assign(std::make_pair(job_id, run_id), std::move(why)).second) {
    remembered_.emplace_back(job_id, run_id);
  }
  while (remembered_.size() > kRemembered) {
    remembered_why_.erase(remembered_.front());
    remembered_.pop_front();
  }
}

void RunRegistry::Remember(const std::string& job_id, const Run& run,
                           const v1::DecisionError& why) {
  Remember(job_id, run.run_id, why);
  for (const std::string& alias : run.aliases) Remember(job_id, alias, why);
}

std::vector<std::string> RunRegistry::StartingPast(absl::Time now, absl::Duration timeout,
                                                   absl::Time& next) const {
  std::vector<std::string> expired;
  for (const auto& [job_id, run] : runs_) {
    if (run.state != RunState::kStarting) continue;
    const absl::Time due = run.started + timeout;
    if (due <= now) {
      expired.push_back(job_id);
    } else {
      next = std::min(next, due);
    }
  }
  return expired;
}

std::vector<EndedRun> RunRegistry::TakeEnded() {
  std::vector<EndedRun> ended;
  ended.swap(ended_);
  return ended;
}

std::string RunRegistry::KeyScopeOf(const Run& run) {
  return run.state == RunState::kFailed ? absl::StrCat(run.run_id, "/after-failure") : run.run_id;
}

}  // namespace accord::daemon
