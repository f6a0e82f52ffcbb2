#include "daemon/common/auth_tokens.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/log.h"

namespace accord::daemon {

constexpr char kAdminJob[] = "*";

bool TokensEqual(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

absl::StatusOr<JobTokens::Table> JobTokens::Parse(absl::string_view text,
                                                  absl::string_view source) {
  Table table;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(source, " line ", line_no,
                                                     ": expected \"job_id token\" (", fields.size(),
                                                     " fields found); comments start with #"));
    }
    table[std::string(fields[0])].emplace_back(fields[1]);
  }
  return table;
}

absl::StatusOr<std::unique_ptr<JobTokens>> JobTokens::Load(std::string path) {
  auto tokens = std::make_unique<JobTokens>(Table(), path);
  if (absl::Status s = tokens->Reload(); !s.ok()) return s;
  return tokens;
}

JobTokens::JobTokens(Table table, std::string path)
    : path_(std::move(path)), table_(std::move(table)) {}

absl::Status JobTokens::Reload() {
  if (path_.empty()) return absl::OkStatus();
  std::ifstream in(path_, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("--tokens_file=", path_, ": cannot read the file; keeping the old tokens"));
  }
  std::ostringstream s;
  s << in.rdbuf();
  absl::StatusOr<Table> table = Parse(s.str(), absl::StrCat("--tokens_file=", path_));
  if (!table.ok()) return table.status();
  size_t jobs = table->size() - (table->contains(kAdminJob) ? 1 : 0);
  accord::MutexLock l(&mu_);
  table_ = *std::move(table);
  ACCORD_LOG(INFO) << "loaded tokens for " << jobs << " jobs from " << path_
                   << (table_.contains(kAdminJob) ? " (with an admin token)" : "");
  return absl::OkStatus();
}

int JobTokens::jobs() const {
  accord::ReaderMutexLock l(&mu_);
  return static_cast<int>(table_.size() - (table_.contains(kAdminJob) ? 1 : 0));
}

bool JobTokens::Matches(absl::string_view job_id, absl::string_view token) const {
  if (token.empty()) return false;
  auto it = table_.find(job_id);
  if (it == table_.end()) return false;
  bool match = false;
  for (const std::string& t : it->second) match |= TokensEqual(t, token);
  return match;
}

absl::Status JobTokens::Deny(absl::string_view job_id, std::string message) const {
  denied_.fetch_add(1, std::memory_order_relaxed);
  ACCORD_LOG(WARNING) << "permission denied: " << message;
  if (on_denied_) on_denied_(std::string(job_id), message);
  return absl::PermissionDeniedError(std::move(message));
}

absl::Status JobTokens::CheckJob(absl::string_view job_id, absl::string_view token,
                                 absl::string_view what) const {
  {
    accord::ReaderMutexLock l(&mu_);
    if (job_id != kAdminJob && Matches(job_id, token)) return absl::OkStatus();
  }
  return Deny(job_id,
              absl::StrCat(
                  "job ", job_id, ": ", what,
                  token.empty() ? " carries no token" : " carries a token that is not this job's",
                  "; give the sidecar the job's token (--token_file or ACCORD_TOKEN) and check the "
                  "coordinator's --tokens_file has a line \"",
                  job_id, " <token>\""));
}

absl::Status JobTokens::CheckJobRead(absl::string_view job_id, absl::string_view token,
                                     absl::string_view what) const {
  {
    accord::ReaderMutexLock l(&mu_);
    if ((job_id != kAdminJob && Matches(job_id, token)) || Matches(kAdminJob, token)) {
      return absl::OkStatus();
    }
  }
  return Deny(job_id, absl::StrCat("job ", job_id, ": ", what,
                                   token.empty() ? " carries no token"
                                                 : " carries a token that is not "
                                                   "this job's nor an admin token",
                                   "; pass the job's token (--token or ACCORD_TOKEN)"));
}

absl::Status JobTokens::CheckAdmin(absl::string_view token, absl::string_view what) const {
  {
    accord::ReaderMutexLock l(&mu_);
    if (Matches(kAdminJob, token)) return absl::OkStatus();
  }
  return Deny("",
              absl::StrCat(
                  what,
                  " covers every job and needs an admin token (a \"* <token>\" line in the "
                  "coordinator's --tokens_file); name one job (--job) and pass its token instead"));
}

}  // namespace accord::daemon
