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
                                                "job ", w.job_id,
                                                ": the coordinator is shutting down; retry "
                                                "against its replacement")));
    }
    waiters_.clear();
    cv_.SignalAll();
  }
  for (auto& [done, result] : ready) done(std::move(result));
  if (timer_.joinable()) timer_.join();
}

bool KvStore::Lookup(const std::string& job_id, const std::vector<std::string>& keys,
                     std::vector<std::string>* values, std::vector<std::string>* missing) {
  auto jit = data_.find(job_id);
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

absl::Status KvStore::Set(const std::string& job_id, const std::string& key, std::string value) {
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
    auto jit = data_.find(job_id);
    if (jit == data_.end() && static_cast<int>(data_.size()) >= options_.max_jobs) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "job ", job_id, ": the key-value store already holds ", data_.size(), " jobs"));
    }
    auto& job = data_[job_id];
    if (!job.contains(key) && static_cast<int>(job.size()) >= options_.max_keys_per_job) {
      return absl::ResourceExhaustedError(
          absl::StrCat("job ", job_id, ": more than ", options_.max_keys_per_job, " keys"));
    }
    job[key] = std::move(value);
    std::vector<std::string> values, missing;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->job_id == job_id &&
          std::find(it->keys.begin(), it->keys.end(), key) != it->keys.end() &&
          Lookup(it->job_id, it->keys, &values, &missing)) {
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

void KvStore::Get(const std::string& job_id, std::vector<std::string> keys, absl::Duration timeout,
                  GetCallback done) {
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
    if (!Lookup(job_id, keys, &values, &missing) && timeout > absl::ZeroDuration()) {
      const absl::Time deadline = clock_->Now() + std::min(timeout, options_.max_timeout);
      waiters_.push_back(Waiter{job_id, std::move(keys), deadline, std::move(done)});
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
        Lookup(it->job_id, it->keys, &values, &missing);
        ready.emplace_back(std::move(it->done),
                           absl::DeadlineExceededError(absl::StrCat(
                               "job ", it->job_id, ": keys still not set after the wait: ",
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
