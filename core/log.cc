#include "core/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace accord {
namespace {

absl::LogSeverity InitialSeverity() {
  const char* env = std::getenv("ACCORD_LOG_LEVEL");
  if (env == nullptr) return absl::LogSeverity::kInfo;
  if (std::strcmp(env, "warning") == 0) return absl::LogSeverity::kWarning;
  if (std::strcmp(env, "error") == 0) return absl::LogSeverity::kError;
  return absl::LogSeverity::kInfo;
}

std::atomic<int>& Min() {
  static std::atomic<int> min{static_cast<int>(InitialSeverity())};
  return min;
}

}  // namespace

absl::LogSeverity MinLogSeverity() { return static_cast<absl::LogSeverity>(Min().load()); }
void SetMinLogSeverity(absl::LogSeverity s) { Min().store(static_cast<int>(s)); }

LogMessage::LogMessage(absl::LogSeverity severity, const char* file, int line)
    : severity_(severity) {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() %
      1000000;
  std::tm tm;
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  const char* base = std::strrchr(file, '/');
  char sev = severity == absl::LogSeverity::kInfo      ? 'I'
             : severity == absl::LogSeverity::kWarning ? 'W'
                                                       : 'E';
  stream_ << sev << ' ' << buf << '.' << us << "Z " << (base ? base + 1 : file) << ':' << line
          << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string s = stream_.str();
  ssize_t ignored = ::write(STDERR_FILENO, s.data(), s.size());
  (void)ignored;
}

}  // namespace accord
