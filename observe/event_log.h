// Structured event log: one JSON object per line, appended to a file whose
// size is bounded by rotation (path -> path.1 -> ... -> path.N, oldest
// dropped). Thread-safe.
#ifndef ACCORD_OBSERVE_EVENT_LOG_H_
#define ACCORD_OBSERVE_EVENT_LOG_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/sync.h"

namespace accord {

// A JSON object built field by field; values are escaped.
class JsonObject {
 public:
  JsonObject& Add(const std::string& key, const std::string& value);
  JsonObject& Add(const std::string& key, const char* value) {
    return Add(key, std::string(value));
  }
  JsonObject& Add(const std::string& key, int64_t value);
  JsonObject& Add(const std::string& key, int value) {
    return Add(key, static_cast<int64_t>(value));
  }
  JsonObject& Add(const std::string& key, double value);
  JsonObject& Add(const std::string& key, bool value);
  JsonObject& AddRaw(const std::string& key, const std::string& json);  // value already JSON
  JsonObject& Add(const std::string& key, const std::vector<int>& values);
  std::string ToString() const;

 private:
  std::string body_;
};

std::string JsonEscape(const std::string& s);

class EventLog {
 public:
  struct Options {
    std::string path;
    int64_t max_bytes = 64 << 20;  // rotate when the file would pass this size
    int max_files = 3;             // rotated files kept besides the live one
  };
  // Opens (appends to) the file. INVALID_ARGUMENT for bad options,
  // the errno's meaning when the file cannot be opened.
  static absl::StatusOr<std::unique_ptr<EventLog>> Open(const Options& options);
  ~EventLog();

  // Writes {"ts":"...","event":type, ...fields} as one line.
  void Write(const std::string& type, const JsonObject& fields);
  int64_t lines_written() const;

 private:
  explicit EventLog(Options options) : options_(std::move(options)) {}
  absl::Status OpenFile() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Rotate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable accord::Mutex mu_;
  std::FILE* file_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t size_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t lines_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace accord

#endif  // ACCORD_OBSERVE_EVENT_LOG_H_
