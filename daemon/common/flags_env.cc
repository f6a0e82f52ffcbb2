#include "daemon/common/flags_env.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"

namespace accord::daemon {

std::vector<char*> ParseFlagsWithEnv(int argc, char** argv, const std::vector<std::string>& names,
                                     const std::string& usage) {
  absl::SetProgramUsageMessage(usage);
  // --help lists the daemons' own flags (defined in their main.cc files).
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "daemon/");
  };
  absl::SetFlagsUsageConfig(config);
  // Environment values go first so a later command-line flag overrides them.
  static std::vector<std::string>* storage = new std::vector<std::string>();
  std::vector<std::string> env_args;
  for (const std::string& name : names) {
    std::string var = "ACCORD_";
    for (char c : name) var += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (const char* v = std::getenv(var.c_str()); v != nullptr) {
      env_args.push_back("--" + name + "=" + v);
    }
  }
  storage->reserve(env_args.size());
  std::vector<char*> args;
  args.push_back(argv[0]);
  for (std::string& a : env_args) {
    storage->push_back(std::move(a));
    args.push_back(storage->back().data());
  }
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  return absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
}

std::vector<std::string> FlagsDefinedIn(const char* defining_file) {
  // CommandLineFlag::Filename() is the defining __FILE__ as the flags usage
  // config normalizes it (by default without its leading '/', '\\' and '.'
  // characters), so compare both forms.
  const absl::string_view raw = defining_file;
  absl::string_view stripped = raw;
  while (!stripped.empty() &&
         (stripped.front() == '/' || stripped.front() == '\\' || stripped.front() == '.')) {
    stripped.remove_prefix(1);
  }
  std::vector<std::string> names;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    const std::string file = flag->Filename();
    if (file == raw || file == stripped) names.emplace_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<char*> ParseFlagsWithEnv(int argc, char** argv, const char* defining_file,
                                     const std::string& usage) {
  return ParseFlagsWithEnv(argc, argv, FlagsDefinedIn(defining_file), usage);
}

absl::Status ApplyLogLevel(const std::string& level) {
  if (level == "debug" || level == "info") {
    SetMinLogSeverity(absl::LogSeverity::kInfo);
  } else if (level == "warning") {
    SetMinLogSeverity(absl::LogSeverity::kWarning);
  } else if (level == "error") {
    SetMinLogSeverity(absl::LogSeverity::kError);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level=", level, ": expected debug, info, warning or error"));
  }
  return absl::OkStatus();
}

}  // namespace accord::daemon
