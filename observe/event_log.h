// Structured event log: one JSON object per line, appended to a file whose
// size is bounded by rotation (path -> path.1 -> ... -> path.N, oldest
// dropped). Thread-safe.
//
// Write only formats the line and queues it: the file I/O (write(2), rename
// on rotation) runs on the log's own writer thread, so callers (the
// coordinator's gRPC callback threads) never wait on the disk. The queue is
// bounded (Options::max_queued lines); past it lines are dropped and counted.
//
// The destructor writes what was queued, for at most Options::exit_drain: a
// slow or stuck disk never holds the process's exit. Past it, the lines not
// written are dropped (counted, and said on stderr) and the writer thread,
// still blocked in the disk, is left to end with the process; it holds its
// own reference to what it touches. Unbuffered writes, so nothing is left
// for the C library to flush into that disk at exit.
#ifndef ACCORD_OBSERVE_EVENT_LOG_H_
#define ACCORD_OBSERVE_EVENT_LOG_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

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
    int64_t max_bytes = 64 << 20;                  // rotate when the file would pass this size
    int max_files = 3;                             // rotated files kept besides the live one
    size_t max_queued = 65536;                     // lines waiting for the writer thread
    absl::Duration exit_drain = absl::Seconds(2);  // the destructor's wait for the disk
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
  struct State;  // shared by the log and its writer thread (event_log.cc)
  explicit EventLog(std::shared_ptr<State> state) : state_(std::move(state)) {}

  std::shared_ptr<State> state_;
  std::thread writer_;
};

}  // namespace accord

#endif  // ACCORD_OBSERVE_EVENT_LOG_H_
