// Job tokens: which secret admits which job (the coordinator's --tokens_file).
//
// File format, one entry per line:
//     # comment
//     job_id token
//     * admin_token
// Blank lines and lines starting with '#' are ignored. A job may have several
// tokens (one per line, for rotation). The job id "*" marks an admin token:
// it may read every job through the observe API (and list all jobs) but is
// never accepted as a job's token for NodeHello or key-value requests.
//
// Thread-safe: Check* may run on any thread while Reload() swaps the table.
#ifndef ACCORD_DAEMON_COMMON_AUTH_TOKENS_H_
#define ACCORD_DAEMON_COMMON_AUTH_TOKENS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/sync.h"

namespace accord::daemon {

class JobTokens {
 public:
  // job id -> its accepted tokens; "*" holds the admin tokens.
  using Table = absl::flat_hash_map<std::string, std::vector<std::string>>;

  // Parses the file format above. INVALID_ARGUMENT naming `source` and the
  // line for a malformed line (never echoing a token).
  static absl::StatusOr<Table> Parse(absl::string_view text, absl::string_view source);
  // Reads and parses `path` (NOT_FOUND / INVALID_ARGUMENT naming --tokens_file).
  static absl::StatusOr<std::unique_ptr<JobTokens>> Load(std::string path);
  // A table not backed by a file (tests).
  explicit JobTokens(Table table, std::string path = "");

  // Re-reads the file; on error keeps the current table and returns the error.
  absl::Status Reload();

  // OK when `token` is one of `job_id`'s tokens. PERMISSION_DENIED otherwise
  // (missing, wrong, another job's, or the admin token), naming the job and
  // `what` (e.g. "NodeHello from node n1") but never the token.
  absl::Status CheckJob(absl::string_view job_id, absl::string_view token,
                        absl::string_view what) const;
  // For read-only observe requests about one job: the job's token or an admin
  // token.
  absl::Status CheckJobRead(absl::string_view job_id, absl::string_view token,
                            absl::string_view what) const;
  // For requests about every job (observe without a job id): an admin token.
  absl::Status CheckAdmin(absl::string_view token, absl::string_view what) const;

  // Called for every refusal with the job id ("" for all-jobs requests) and
  // the message (metrics, event log). Set before serving; must not block.
  using DeniedCallback = std::function<void(const std::string& job_id, const std::string& message)>;
  void SetDeniedCallback(DeniedCallback callback) { on_denied_ = std::move(callback); }

  // Requests refused so far (for metrics: accord_errors_total{kind="PERMISSION_DENIED"}).
  int64_t denied() const { return denied_.load(std::memory_order_relaxed); }
  int jobs() const;

 private:
  bool Matches(absl::string_view job_id, absl::string_view token) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status Deny(absl::string_view job_id, std::string message) const;

  const std::string path_;
  mutable accord::Mutex mu_;
  Table table_ ABSL_GUARDED_BY(mu_);
  mutable std::atomic<int64_t> denied_{0};
  DeniedCallback on_denied_;
};

// Constant-time comparison (no early exit on the first differing byte).
bool TokensEqual(absl::string_view a, absl::string_view b);

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_AUTH_TOKENS_H_
