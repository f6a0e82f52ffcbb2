#include "daemon/coordinator/kv_store.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/rank_set.h"

namespace accord::daemon {
namespace {

// A key's prefix: the key up to and including its last '/' ("" without one).
std::string PrefixOf(const std::string& key) {
  const size_t slash = key.rfind('/');
  return slash == std::string::npos ? std::string() : key.substr(0, slash + 1);
}

std::vector<int> Sorted(const absl::flat_hash_set<int>& ranks) {
  std::vector<int> out(ranks.begin(), ranks.end());
  std::sort(out.begin(), out.end());
  return out;
}

constexpr char kJobVerdictPayload[] = "type.accord.dev/job-verdict";

// The ranks a Get's unset keys are expected from, of a job of `world` ranks:
// its member set, or every rank (also when the set is not one of this job:
// `*among` then says why). `*among` names them for the error.
std::vector<int> ExpectedRanks(const std::optional<MembersForm>& expected, int world,
                               std::string* among) {
  std::vector<int> all(world);
  for (int r = 0; r < world; ++r) all[r] = r;
  *among = "the job";
  if (!expected.has_value()) return all;
  absl::StatusOr<MemberSet> set = MemberSet::FromForm(*expected, world);
  if (!set.ok()) {
    *among = absl::StrCat("the job (the Get's member set is not one of a job of ", world,
                          " ranks: ", set.status().message(), ")");
    return all;
  }
  *among = absl::StrCat("the Get's member set (", set->Describe(), ")");
  return set->ranks();
}

}  // namespace

absl::Status AsJobVerdict(absl::Status s) {
  if (!s.ok()) s.SetPayload(kJobVerdictPayload, absl::Cord("1"));
  return s;
}

bool IsJobVerdict(const absl::Status& s) { return s.GetPayload(kJobVerdictPayload).has_value(); }

KvStore::KvStore(KvOptions options, Clock* clock) : options_(options), clock_(clock) {
  timer_ = std::thread([this] { TimerLoop(); });
}

KvStore::~KvStore() { Stop(); }

void KvStore::SetRankDirectory(RankDirectory* ranks) {
  accord::MutexLock l(&mu_);
  ranks_ = ranks;
}

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
                          const std::string& key, std::string value, int rank) {
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
    ClearCutLocked(scope, rank, {key});
    // One entry per key at most: bounded like the keys.
    NoteRankLocked(scope, key, rank, /*asked=*/false);
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
                  std::vector<std::string> keys, absl::Duration timeout, GetCallback done, int rank,
                  std::optional<MembersForm> expected) {
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
    ClearCutLocked(scope, rank, keys);
    if (!Lookup(scope, keys, &values, &missing) && timeout > absl::ZeroDuration()) {
      const absl::Duration asked = std::min(timeout, options_.max_timeout);
      const absl::Duration waits = std::min(asked, options_.wait_bound);
      for (const std::string& k : keys) NoteRankLocked(scope, k, rank, /*asked=*/true);
      Waiter w{std::move(scope), std::move(keys), clock_->Now() + waits, std::move(done)};
      w.rank = rank;
      w.expected = std::move(expected);
      w.waits = waits;
      w.bounded = waits < asked;
      waiters_.push_back(std::move(w));
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

void KvStore::NoteRankLocked(const Scope& scope, const std::string& key, int rank, bool asked) {
  if (rank < 0) return;  // not said (or not a rank)
  Prefixes& prefixes = prefixes_[scope];
  if (prefixes.records >= options_.max_rank_records) return;
  PrefixRanks& ranks = prefixes.by_prefix[PrefixOf(key)];
  if ((asked ? ranks.asked : ranks.set).insert(rank).second) ++prefixes.records;
}

void KvStore::ClearCutLocked(const Scope& scope, int rank, const std::vector<std::string>& keys) {
  if (rank < 0) return;
  auto pit = prefixes_.find(scope);
  if (pit == prefixes_.end()) return;
  auto cit = pit->second.cut.find(rank);
  if (cit == pit->second.cut.end()) return;
  const std::vector<std::string>& missed = cit->second.prefixes;
  for (const std::string& k : keys) {
    if (std::find(missed.begin(), missed.end(), PrefixOf(k)) != missed.end()) {
      pit->second.cut.erase(cit);
      --pit->second.records;
      return;
    }
  }
}

std::vector<std::pair<int, absl::Status>> KvStore::WaitsCut(const std::string& job_id,
                                                            const std::string& run_id) {
  std::vector<std::pair<int, absl::Status>> out;
  accord::MutexLock l(&mu_);
  auto pit = prefixes_.find(Scope(job_id, run_id));
  if (pit == prefixes_.end() || pit->second.cut.empty()) return out;
  for (const auto& [rank, wait] : pit->second.cut) out.emplace_back(rank, wait.words);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

KvStore::Unset KvStore::UnsetLocked(Waiter& w) {
  Unset u;
  u.scope = w.scope;
  u.done = std::move(w.done);
  u.job_id = w.scope.first;
  u.rank = w.rank;
  u.expected = std::move(w.expected);
  u.waited = w.waits;
  u.bounded = w.bounded;
  if (auto fit = failed_.find(w.scope); fit != failed_.end()) u.failed = fit->second;
  std::vector<std::string> values;
  Lookup(w.scope, w.keys, &values, &u.missing);
  for (const std::string& k : u.missing) {
    std::string prefix = PrefixOf(k);
    if (std::find(u.prefixes.begin(), u.prefixes.end(), prefix) == u.prefixes.end()) {
      u.prefixes.push_back(std::move(prefix));
    }
  }
  auto pit = prefixes_.find(w.scope);
  if (pit == prefixes_.end()) return u;
  // Set a key under every prefix; asked for a key under any of them.
  absl::flat_hash_set<int> set, asked;
  for (size_t i = 0; i < u.prefixes.size(); ++i) {
    auto it = pit->second.by_prefix.find(u.prefixes[i]);
    if (it == pit->second.by_prefix.end()) {
      set.clear();  // nobody set a key under this prefix
      continue;
    }
    if (i == 0) {
      set = it->second.set;
    } else {
      absl::erase_if(set, [&](int r) { return !it->second.set.contains(r); });
    }
    asked.insert(it->second.asked.begin(), it->second.asked.end());
  }
  u.set = Sorted(set);
  u.asked = Sorted(asked);
  return u;
}

absl::Status KvStore::UnsetKeysError(const Unset& u) {
  std::string msg =
      u.bounded ? absl::StrCat("job ", u.job_id, ": keys still not set after ",
                               absl::FormatDuration(u.waited),
                               " (the coordinator's --deadline): ", absl::StrJoin(u.missing, ", "))
                : absl::StrCat("job ", u.job_id, ": keys still not set after the wait (",
                               absl::FormatDuration(u.waited),
                               ", this Get's timeout): ", absl::StrJoin(u.missing, ", "));
  const std::string under = absl::StrCat(
      "under ", absl::StrJoin(u.prefixes, ", ", [](std::string* out, const std::string& p) {
        absl::StrAppend(out, "\"", p, "\"");
      }));
  RankDirectory* directory = nullptr;
  {
    accord::MutexLock l(&mu_);
    directory = ranks_;
  }
  const int world = directory != nullptr && u.rank >= 0 ? directory->WorldSize(u.job_id) : 0;
  if (world == 0) {
    absl::StrAppend(
        &msg, "; who should set them is not named: ",
        u.rank < 0
            ? "this Get did not say its rank (a client older than this coordinator)"
            : absl::StrCat("no sidecar of job ", u.job_id,
                           " is connected to this coordinator, so its ranks are not known here"),
        ". Check that the rank that publishes them runs and reaches the point where it sets them");
    return absl::DeadlineExceededError(msg);
  }
  std::string among;
  std::vector<int> named;
  for (int r : ExpectedRanks(u.expected, world, &among)) {
    if (!std::binary_search(u.set.begin(), u.set.end(), r) &&
        !std::binary_search(u.asked.begin(), u.asked.end(), r)) {
      named.push_back(r);
    }
  }
  const std::string who = absl::StrCat(
      u.set.empty() ? std::string("no rank set one")
                    : absl::StrCat("ranks ", FormatRanks(u.set), " set one"),
      ", ",
      u.asked.empty() ? std::string("no rank asked for one")
                      : absl::StrCat("ranks ", FormatRanks(u.asked), " asked for one"));
  if (named.empty()) {
    absl::StrAppend(&msg, "; every rank of ", among, " set a key ", under, " or asked for one (",
                    who,
                    "), so no rank is expected to set these: check the keys' names against the "
                    "ones the publishing rank sets");
    return absl::DeadlineExceededError(msg);
  }
  const size_t shown = std::min<size_t>(named.size(), 32);
  std::vector<std::string> parts =
      directory->DescribeRanks(u.job_id, std::vector<int>(named.begin(), named.begin() + shown));
  if (named.size() > shown) parts.push_back(absl::StrCat("and ", named.size() - shown, " more"));
  absl::StrAppend(&msg, "; missing ranks ", FormatRanks(named),
                  u.expected.has_value() ? absl::StrCat(" of ", among) : std::string(),
                  " (neither set a key ", under,
                  " nor asked for one): ", absl::StrJoin(parts, ", "), "; ", who,
                  ". Check the missing ranks' processes and their sidecars' logs: the rank that "
                  "publishes these keys is among them; a rank only slower than the wait can ask "
                  "again");
  return absl::DeadlineExceededError(msg);
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
    prefixes_.erase(scope);
    failed_.erase(scope);
    if (!successor.empty()) failed_[Scope(job_id, successor)] = why;
    std::vector<std::string> values, missing;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->scope != scope) {
        ++it;
        continue;
      }
      if (successor.empty()) {
        ready.emplace_back(std::move(it->done), AsJobVerdict(why));
        it = waiters_.erase(it);
        continue;
      }
      it->scope = Scope(job_id, successor);
      for (const std::string& k : it->keys) NoteRankLocked(it->scope, k, it->rank, /*asked=*/true);
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
    std::vector<Unset> ended;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->deadline <= now) {
        ended.push_back(UnsetLocked(*it));
        it = waiters_.erase(it);
      } else {
        next = std::min(next, it->deadline);
        ++it;
      }
    }
    if (!ended.empty()) {
      // The errors ask the rank directory, which takes the coordinator's
      // lock: never with this one held.
      mu_.Unlock();
      // A wait cut at the coordinator's --deadline ends the rendezvous for
      // every rank alike; one that ends at its own shorter timeout does not.
      // In a failed run the keys are missing because the run failed: the
      // wait ends with that failure, as the run's other ranks were told.
      for (Unset& u : ended) {
        if (!u.failed.ok()) {
          u.done(AsJobVerdict(u.failed));
        } else if (!u.bounded) {
          u.done(UnsetKeysError(u));
        } else {
          absl::Status cut = UnsetKeysError(u);
          if (u.rank >= 0) {
            mu_.Lock();
            auto pit = prefixes_.find(u.scope);  // gone: the run ended meanwhile
            if (pit != prefixes_.end()) {
              // The first cut ended the run's rendezvous: a rank cut later
              // gets its words, not a description of a later moment (a rank
              // that connected meanwhile), so every rank ends alike. Every
              // standing cut holds those words.
              if (!pit->second.cut.empty()) cut = pit->second.cut.begin()->second.words;
              if (pit->second.records < options_.max_rank_records &&
                  pit->second.cut.insert_or_assign(u.rank, CutWait{cut, u.prefixes}).second) {
                ++pit->second.records;
              }
            }
            mu_.Unlock();
          }
          u.done(AsJobVerdict(std::move(cut)));
        }
      }
      mu_.Lock();
      continue;
    }
    clock_->WaitUntil(&cv_, &mu_, next);
  }
}

}  // namespace accord::daemon
