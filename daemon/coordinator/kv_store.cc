#include "daemon/coordinator/kv_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace accord::daemon {

KvStore::KvStore(KvOptions options, Clock* clock) : options_(options), clock_(clock) {
  timer_ = std::thread([this] { TimerLoop(); });
}

KvStore::~KvStore() { Stop(); }

void KvStore::Stop() {
  Ready ready;
  {
    accord::MutexLock l(&mu_);
    stopping_ = true;
    for (Waiter& w : waiters_) {
      ready.emplace_back(std::move(w.done), absl::UnavailableError(absl::StrCat(
                                                "job ", w.scope.first,
                                                ": the coordinator is shutting down; retry "
                                                "against its replacement")));
    }
    waiters_.clear();
    cv_.SignalAll();
  }
  for (auto& [done, result] : ready) done(std::move(result));
  if (timer_.joinable()) timer_.join();
}

bool KvStore::Lookup(const Scope& scope, const std::vector<std::string>& keys,
                     std::vector<std::string>* values, std::vector<std::string>* missing) {
  auto jit = data_.find(scope);
  values->clear();
  missing->clear();
  for (const std::string& k : keys) {
    if (jit != data_.end()) {
      if (auto it = jit->second.find(k); it != jit->second.end()) {
        values->push_back(it->second);
        continue;
      }
    }
    missing->push_back(k);
  }
  return missing->empty();
}

absl::Status KvStore::Set(const std::string& job_id, const std::string& run_id,
                          const std::string& key, std::string value) {
  if (job_id.empty() || key.empty()) {
    return absl::InvalidArgumentError("key-value Set needs a job_id and a key");
  }
  if (static_cast<int64_t>(value.size()) > options_.max_value_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("job ", job_id, ": value for key \"", key, "\" has ", value.size(),
                     " bytes; the limit is ", options_.max_value_bytes));
  }
  Ready ready;
  {
    accord::MutexLock l(&mu_);
    if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
    Scope scope(job_id, run_id);
    auto jit = data_.find(scope);
    if (jit == data_.end() && static_cast<int>(data_.size()) >= options_.max_jobs) {
      return absl::ResourceExhaustedError(
          absl::StrCat("job ", job_id, ": the key-value store already holds keys of ", data_.size(),
                       " live runs (--max_jobs); a run's keys are dropped when it ends, so check "
                       "for jobs that never end or raise --max_jobs"));
    }
    auto& job = data_[scope];
    if (auto it = job.find(key); it != job.end()) {
      if (it->second == value) return absl::OkStatus();
      return absl::AlreadyExistsError(absl::StrCat(
          "job ", job_id, " run ", run_id, ": key \"", key,
          "\" was already set in this run with another value; bootstrap keys are write-once "
          "per run. Check that only one rank publishes it (e.g. rank 0 for the NCCL unique id) "
          "and that no rank of an earlier run is still running"));
    }
    if (static_cast<int>(job.size()) >= options_.max_keys_per_job) {
      return absl::ResourceExhaustedError(
          absl::StrCat("job ", job_id, ": more than ", options_.max_keys_per_job, " keys"));
    }
    job.emplace(key, std::move(value));
    ++num_keys_;
    std::vector<std::string> values, missing;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->scope == scope &&
          std::find(it->keys.begin(), it->keys.end(), key) != it->keys.end() &&
          Lookup(it->scope, it->keys, &values, &missing)) {
        ready.emplace_back(std::move(it->done), values);
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [done, result] : ready) done(std::move(result));
  return absl::OkStatus();
}

void KvStore::Get(const std::string& job_id, const std::string& run_id,
                  std::vector<std::string> keys, absl::Duration timeout, GetCallback done) {
  if (job_id.empty() || keys.empty()) {
    done(absl::InvalidArgumentError("key-value Get needs a job_id and at least one key"));
    return;
  }
  std::vector<std::string> values, missing;
  {
    accord::MutexLock l(&mu_);
    if (stopping_) {
      mu_.Unlock();
      done(absl::UnavailableError("the coordinator is shutting down"));
      mu_.Lock();
      return;
    }
    Scope scope(job_id, run_id);
    if (!Lookup(scope, keys, &values, &missing) && timeout > absl::ZeroDuration()) {
      const absl::Time deadline = clock_->Now() + std::min(timeout, options_.max_timeout);
      waiters_.push_back(Waiter{std::move(scope), std::move(keys), deadline, std::move(done)});
      cv_.SignalAll();
      return;
    }
  }
  if (missing.empty()) {
    done(std::move(values));
  } else {
    done(absl::NotFoundError(
        absl::StrCat("job ", job_id, ": keys not set: ", absl::StrJoin(missing, ", "))));
  }
}

void KvStore::DropRun(const std::string& job_id, const std::string& run_id, const absl::Status& why,
                      const std::string& successor) {
  Ready ready;
  {
    accord::MutexLock l(&mu_);
    const Scope scope(job_id, run_id);
    if (auto it = data_.find(scope); it != data_.end()) {
      num_keys_ -= static_cast<int64_t>(it->second.size());
      data_.erase(it);
    }
    std::vector<std::string> values, missing;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->scope != scope) {
        ++it;
        continue;
      }
      if (successor.empty()) {
        ready.emplace_back(std::move(it->done), why);
        it = waiters_.erase(it);
        continue;
      }
      it->scope = Scope(job_id, successor);
      if (Lookup(it->scope, it->keys, &values, &missing)) {
        ready.emplace_back(std::move(it->done), values);
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [done, result] : ready) done(std::move(result));
}

int KvStore::NumRuns() {
  accord::MutexLock l(&mu_);
  return static_cast<int>(data_.size());
}

int64_t KvStore::NumKeys() {
  accord::MutexLock l(&mu_);
  return num_keys_;
}

int KvStore::NumWaiting() {
  accord::MutexLock l(&mu_);
  return static_cast<int>(waiters_.size());
}

void KvStore::TimerLoop() {
  accord::MutexLock l(&mu_);
  while (!stopping_) {
    const absl::Time now = clock_->Now();
    absl::Time next = absl::InfiniteFuture();
    Ready ready;
    std::vector<std::string> values, missing;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->deadline <= now) {
        Lookup(it->scope, it->keys, &values, &missing);
        ready.emplace_back(std::move(it->done),
                           absl::DeadlineExceededError(absl::StrCat(
                               "job ", it->scope.first, ": keys still not set after the wait: ",
                               absl::StrJoin(missing, ", "),
                               "; check that the rank that publishes them is running")));
        it = waiters_.erase(it);
      } else {
        next = std::min(next, it->deadline);
        ++it;
      }
    }
    if (!ready.empty()) {
      mu_.Unlock();
      for (auto& [done, result] : ready) done(std::move(result));
      mu_.Lock();
      continue;
    }
    clock_->WaitUntil(&cv_, &mu_, next);
  }
}

}  // namespace accord::daemon
