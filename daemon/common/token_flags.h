// The daemons' token flags: --token/--token_file (the job token a sidecar or
// a relay sends upstream) and --tokens_file (the tokens a coordinator or a
// relay checks, re-read on SIGHUP). Only main files read the flags; they pass
// the values here.
#ifndef ACCORD_DAEMON_COMMON_TOKEN_FLAGS_H_
#define ACCORD_DAEMON_COMMON_TOKEN_FLAGS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/common/auth_tokens.h"

namespace accord::daemon {

// The job token: the contents of `token_file` (whitespace trimmed; an empty
// file is INVALID_ARGUMENT) when set, else `token`.
absl::StatusOr<std::string> JobTokenFrom(const std::string& token_file, const std::string& token);

// The tokens of --tokens_file `path`; nullptr, with a warning that any
// client reaching the port may join any job, when `path` is empty.
absl::StatusOr<std::unique_ptr<JobTokens>> LoadTokensFile(const std::string& path);

// Waits for SIGTERM/SIGINT, re-reading `tokens` (when not null) on each
// SIGHUP; a failed reload keeps the current tokens and is logged. Returns the
// signal. BlockTerminationSignals() must have run first.
int WaitForStopReloadingTokens(JobTokens* tokens);

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_TOKEN_FLAGS_H_
