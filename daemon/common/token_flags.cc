#include "daemon/common/token_flags.h"

#include <signal.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "daemon/common/signals.h"
#include "daemon/common/tls.h"

namespace accord::daemon {

absl::StatusOr<std::string> JobTokenFrom(const std::string& token_file, const std::string& token) {
  if (token_file.empty()) return token;
  absl::StatusOr<std::string> text = ReadPemFile(token_file, "token_file");
  if (!text.ok()) return text.status();
  std::string trimmed(absl::StripAsciiWhitespace(*text));
  if (trimmed.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--token_file=", token_file, " is empty"));
  }
  return trimmed;
}

absl::StatusOr<std::unique_ptr<JobTokens>> LoadTokensFile(const std::string& path) {
  if (path.empty()) {
    ACCORD_LOG(WARNING) << "no --tokens_file: any client that reaches this port may join any job "
                           "and read its decisions and key-value entries";
    return std::unique_ptr<JobTokens>();
  }
  return JobTokens::Load(path);
}

int WaitForStopReloadingTokens(JobTokens* tokens) {
  int sig = 0;
  while ((sig = WaitForTerminationOrReloadSignal()) == SIGHUP) {
    if (tokens == nullptr) {
      ACCORD_LOG(INFO) << "SIGHUP: no --tokens_file to reload";
    } else if (absl::Status s = tokens->Reload(); !s.ok()) {
      ACCORD_LOG(ERROR) << "SIGHUP: " << s.message();
    }
  }
  return sig;
}

}  // namespace accord::daemon
