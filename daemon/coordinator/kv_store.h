// The coordinator's key-value rendezvous (NCCL unique ids, the Gloo store),
// scoped per run of a job (job id + run id): two jobs, or two runs of one
// job, never see each other's keys. A key is write-once per run: a second Set
// with another value is ALREADY_EXISTS (the same value again is accepted, so
// a retried Set is harmless). DropRun deletes a run's keys when the
// coordinator ends the run (see docs/ARCHITECTURE.md, "Runs").
//
// Get with a timeout never blocks a thread: it registers a callback that runs
// when every key is present (from the Set that completes it), when the
// timeout passes (DEADLINE_EXCEEDED naming the missing keys, fired by this
// class's timer thread), or on Stop() (UNAVAILABLE). Callbacks run without
// the store's lock held, exactly once.
//
// No Get waits longer than KvOptions::wait_bound (the coordinator's
// --deadline), and one that ends without its keys names who was expected to
// set them (docs/ARCHITECTURE.md, "Every wait names who is missing"). Keys
// have no owner, so the store keeps, per run and key prefix (the key up to
// its last '/'), the ranks that set a key under it and the ranks that asked
// for one; the ranks of the job (RankDirectory) that did neither are named,
// with their node and whether they are connected. That covers the two
// rendezvous patterns: one rank publishes a key the others wait for (the
// NCCL unique id: the publisher is the one rank not waiting), and every rank
// publishes its own key under a prefix and reads all of them (the ranks that
// did not publish are named). Requests that do not say their rank (older
// clients) are not counted; the message then says why nobody is named.
//
// Thread-safe. Owns one timer thread that stops in Stop() or the destructor.
#ifndef ACCORD_DAEMON_COORDINATOR_KV_STORE_H_
#define ACCORD_DAEMON_COORDINATOR_KV_STORE_H_

#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/members.h"
#include "core/sync.h"
#include "daemon/common/clock.h"
#include "daemon/coordinator/rank_directory.h"

namespace accord::daemon {

// A key-value error that is the job's verdict rather than one call's
// (wire::kJobVerdictMetadataKey): carried as a status payload from where it
// is made to the service that answers the call.
absl::Status AsJobVerdict(absl::Status s);
bool IsJobVerdict(const absl::Status& s);

struct KvOptions {
  // Runs holding keys at once (the coordinator's --max_jobs): runs are
  // dropped when they end, so this bounds live runs, not ids ever seen.
  int max_jobs = 1024;
  int max_keys_per_job = 1 << 16;
  int64_t max_value_bytes = 1 << 20;
  absl::Duration max_timeout = absl::Minutes(30);
  // The coordinator's --deadline: no Get waits longer; one that reaches it
  // fails naming the ranks expected to set its keys (see the class comment).
  absl::Duration wait_bound = absl::InfiniteDuration();
  // Ranks recorded per run for those names (who set and who asked for a key
  // under each prefix).
  int64_t max_rank_records = 1 << 20;
};

class KvStore {
 public:
  using GetCallback = std::function<void(absl::StatusOr<std::vector<std::string>>)>;

  KvStore(KvOptions options, Clock* clock);
  ~KvStore();
  void Stop();
  // Who the ranks of a job are (the Coordinator, built after the store);
  // without one a timed-out Get says its ranks are not known. Not owned;
  // must outlive Stop().
  void SetRankDirectory(RankDirectory* ranks);

  static constexpr int kUnknownRank = -1;
  // INVALID_ARGUMENT for an empty job or key, RESOURCE_EXHAUSTED past limits,
  // ALREADY_EXISTS when the run already holds `key` with another value.
  // `rank`: the rank that sets it (kUnknownRank: not said).
  absl::Status Set(const std::string& job_id, const std::string& run_id, const std::string& key,
                   std::string value, int rank = kUnknownRank);
  // Calls `done` with the values of `keys` in order (see class comment).
  // timeout 0: answers at once, NOT_FOUND naming missing keys. Otherwise
  // waits up to min(timeout, wait_bound); DEADLINE_EXCEEDED names the
  // missing keys and the ranks expected to set them. `rank`: the rank that
  // asks (kUnknownRank: not said). `expected`: the ranks among which those
  // are named (a member set; absent: every rank of the job); a form that is
  // not a member set of the job's world size is named as such in the error.
  void Get(const std::string& job_id, const std::string& run_id, std::vector<std::string> keys,
           absl::Duration timeout, GetCallback done, int rank = kUnknownRank,
           std::optional<MembersForm> expected = std::nullopt);
  // Deletes the run's keys; its waiting Gets get `why` (a RUN_ENDED status),
  // or, with a `successor` scope (a failed run's fresh scope), wait there. A
  // wait in that scope that ends without its keys ends with `why` (the run's
  // failure, which every rank was told), not with the keys it lacks.
  void DropRun(const std::string& job_id, const std::string& run_id, const absl::Status& why,
               const std::string& successor = "");
  // The ranks of the run whose Get was cut at wait_bound (the coordinator's
  // --deadline) and that have not asked again since (a Get or Set of a key
  // under a prefix the cut Get missed), each with the error it ended with,
  // ascending. A rank that then leaves has ended the rendezvous for every
  // rank: the coordinator fails the run with those words
  // (docs/ARCHITECTURE.md, "Every wait names who is missing").
  std::vector<std::pair<int, absl::Status>> WaitsCut(const std::string& job_id,
                                                     const std::string& run_id);
  // Number of Get calls waiting (for tests).
  int NumWaiting();
  // Runs holding keys, and keys held in all (for the churn soak and metrics).
  int NumRuns();
  int64_t NumKeys();

 private:
  using Scope = std::pair<std::string, std::string>;  // job id, run id
  struct Waiter {
    Scope scope;
    std::vector<std::string> keys;
    absl::Time deadline;
    GetCallback done;
    int rank = kUnknownRank;
    std::optional<MembersForm> expected;  // absent: every rank of the job
    absl::Duration waits;                 // min(timeout, max_timeout, wait_bound)
    bool bounded = false;  // `waits` is wait_bound, shorter than the caller's timeout
  };
  // Per run and key prefix: the ranks that set a key under it, and those that
  // asked for one (a Get that waited).
  struct PrefixRanks {
    absl::flat_hash_set<int> set;
    absl::flat_hash_set<int> asked;
  };
  // A Get cut at wait_bound: the error it ended with, and the prefixes of the
  // keys it missed (a later request of the rank under one of them is the
  // rank asking again; one under another prefix, e.g. a key announcing that
  // it is done, is not).
  struct CutWait {
    absl::Status words;
    std::vector<std::string> prefixes;
  };
  struct Prefixes {
    absl::flat_hash_map<std::string, PrefixRanks> by_prefix;
    // Ranks whose Get was cut at wait_bound and that have not asked since for
    // a key under the prefixes it missed (WaitsCut).
    absl::flat_hash_map<int, CutWait> cut;
    int64_t records = 0;  // ranks recorded under every prefix and in `cut` (max_rank_records)
  };
  // A Get that ended without its keys: what its error says (UnsetKeysError).
  struct Unset {
    GetCallback done;
    std::string job_id;
    std::vector<std::string> missing;
    std::vector<std::string> prefixes;  // of the missing keys, distinct, in order
    int rank = kUnknownRank;
    std::optional<MembersForm> expected;
    absl::Duration waited;
    bool bounded = false;
    std::vector<int> set;    // set a key under every prefix (ascending)
    std::vector<int> asked;  // asked for a key under one of them (ascending)
    absl::Status failed;     // the run's failure, when the wait was in a failed run
    Scope scope;
  };
  // The facts of waiter `w` at its end; its callback is moved into them.
  Unset UnsetLocked(Waiter& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The error of an Unset; asks the rank directory (without mu_ held).
  absl::Status UnsetKeysError(const Unset& u) ABSL_LOCKS_EXCLUDED(mu_);
  // Records that `rank` set `key` (asked: asked for it) in `scope`; past
  // max_rank_records per run nothing more is recorded (the names may then
  // miss a rank, the store does not grow).
  void NoteRankLocked(const Scope& scope, const std::string& key, int rank, bool asked)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `rank` asked for (or set) `keys` in `scope`: a cut wait of its under one
  // of their prefixes is not its last word.
  void ClearCutLocked(const Scope& scope, int rank, const std::vector<std::string>& keys)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  using Ready = std::vector<std::pair<GetCallback, absl::StatusOr<std::vector<std::string>>>>;
  // Values of all keys, or the missing ones in `missing`.
  bool Lookup(const Scope& scope, const std::vector<std::string>& keys,
              std::vector<std::string>* values, std::vector<std::string>* missing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TimerLoop();

  const KvOptions options_;
  Clock* const clock_;
  accord::Mutex mu_;
  accord::CondVar cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  RankDirectory* ranks_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::flat_hash_map<Scope, absl::flat_hash_map<std::string, std::string>> data_
      ABSL_GUARDED_BY(mu_);
  // Dropped with the run, as data_.
  absl::flat_hash_map<Scope, Prefixes> prefixes_ ABSL_GUARDED_BY(mu_);
  int64_t num_keys_ ABSL_GUARDED_BY(mu_) = 0;
  std::list<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  // A failed run's fresh scope -> the run's failure (until the run ends).
  absl::flat_hash_map<Scope, absl::Status> failed_ ABSL_GUARDED_BY(mu_);
  std::thread timer_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_KV_STORE_H_
