// A small stream logger (Debian's Abseil predates absl/log). Thread-safe:
// each message is written with one write(2) to stderr.
//
//   ACCORD_LOG(INFO) << "sidecar connected: node=" << node;
#ifndef ACCORD_CORE_LOG_H_
#define ACCORD_CORE_LOG_H_

#include <sstream>

#include "absl/base/log_severity.h"

namespace accord {

// Messages below this severity are dropped (default INFO; ACCORD_LOG_LEVEL
// environment variable: info, warning, error).
absl::LogSeverity MinLogSeverity();
void SetMinLogSeverity(absl::LogSeverity s);

class LogMessage {
 public:
  LogMessage(absl::LogSeverity severity, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  absl::LogSeverity severity_;
  std::ostringstream stream_;
};

}  // namespace accord

#define ACCORD_LOG_SEVERITY_INFO ::absl::LogSeverity::kInfo
#define ACCORD_LOG_SEVERITY_WARNING ::absl::LogSeverity::kWarning
#define ACCORD_LOG_SEVERITY_ERROR ::absl::LogSeverity::kError
#define ACCORD_LOG(sev)                                         \
  if (ACCORD_LOG_SEVERITY_##sev < ::accord::MinLogSeverity()) { \
  } else                                                        \
    ::accord::LogMessage(ACCORD_LOG_SEVERITY_##sev, __FILE__, __LINE__).stream()

#endif  // ACCORD_CORE_LOG_H_
