// Flags with environment fallbacks: every flag --name may also be given as
// ACCORD_<NAME> (upper case); the command line wins over the environment.
#ifndef ACCORD_DAEMON_COMMON_FLAGS_ENV_H_
#define ACCORD_DAEMON_COMMON_FLAGS_ENV_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace accord::daemon {

// Parses absl flags from argv after applying ACCORD_<NAME> environment
// variables for each name in `names`. Returns the positional arguments.
std::vector<char*> ParseFlagsWithEnv(int argc, char** argv, const std::vector<std::string>& names,
                                     const std::string& usage);

// The same for every flag defined in `defining_file`: pass __FILE__ from the
// file whose ABSL_FLAGs are the daemon's, so a flag added there gets its
// ACCORD_<NAME> variable without a list to keep in step.
std::vector<char*> ParseFlagsWithEnv(int argc, char** argv, const char* defining_file,
                                     const std::string& usage);

// The names of the flags defined in `defining_file`, sorted.
std::vector<std::string> FlagsDefinedIn(const char* defining_file);

// Sets the log threshold from --log_level: debug, info, warning or error
// (debug logs as much as info: there is no debug severity yet).
// INVALID_ARGUMENT naming the flag for anything else.
absl::Status ApplyLogLevel(const std::string& level);

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_FLAGS_ENV_H_
