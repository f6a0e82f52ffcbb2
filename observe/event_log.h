// Structured event log: one JSON object per line, appended to a file whose
// size is bounded by rotation (path -> path.1 -> ... -> path.N, oldest
// dropped). Thread-safe.
//
// Write only formats the line and queues it: the file I/O (fwrite, fflush,
// rename on rotation) runs on the log's own writer thread, so callers (the
// coordinator's gRPC callback threads) never wait on the disk. The queue is
// bounded (Options::max_queued lines); past it lines are dropped and counted.
// The thread stops in the destructor after writing what was queued.
#ifndef ACCORD_OBSERVE_EVENT_LOG_H_
#define ACCORD_OBSERVE_EVENT_LOG_H_

#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <string>
#include <thread>
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
    size_t max_queued = 65536;     // lines waiting for the writer thread
  };
  // Opens (appends to) the file. INVALID_ARGUMENT for bad options,
  // the errno's meaning when the file cannot be opened.
  static absl::StatusOr<std::unique_ptr<EventLog>> Open(const Options& options);
  ~EventLog();

  // Writes {"ts":"...","event":type, ...fields} as one line.
  void Write(const std::string& type, const JsonObject& fields);
  int64_t lines_written() const;
  // Lines dropped because the queue was full.
  int64_t lines_dropped() const;
  // Returns once every line queued before the call is written (for tests and
  // shutdown).
  void Flush();

 private:
  explicit EventLog(Options options) : options_(std::move(options)) {}
  // The writer thread's: file_ and size_ are touched only by it (and by Open
  // before it starts and the destructor after it stopped).
  absl::Status OpenFile();
  void Rotate();
  void WriteLine(const std::string& line);
  void WriterLoop();

  const Options options_;
  std::FILE* file_ = nullptr;
  int64_t size_ = 0;
  mutable accord::Mutex mu_;
  std::deque<std::string> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;  // lines ever queued
  int64_t lines_ ABSL_GUARDED_BY(mu_) = 0;   // lines ever written (or failed to)
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread writer_;
};

}  // namespace accord

#endif  // ACCORD_OBSERVE_EVENT_LOG_H_
