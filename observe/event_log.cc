#include "observe/event_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/sync.h"

namespace accord {

std::string JsonEscape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 2);
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

JsonObject& JsonObject::AddRaw(const std::string& key, const std::string& json) {
  absl::StrAppend(&body_, body_.empty() ? "" : ",", "\"", JsonEscape(key), "\":", json);
  return *this;
}
JsonObject& JsonObject::Add(const std::string& key, const std::string& value) {
  return AddRaw(key, absl::StrCat("\"", JsonEscape(value), "\""));
}
JsonObject& JsonObject::Add(const std::string& key, int64_t value) {
  return AddRaw(key, absl::StrCat(value));
}
JsonObject& JsonObject::Add(const std::string& key, double value) {
  if (!std::isfinite(value)) return AddRaw(key, "null");
  return AddRaw(key, absl::StrFormat("%.9g", value));
}
JsonObject& JsonObject::Add(const std::string& key, bool value) {
  return AddRaw(key, value ? "true" : "false");
}
JsonObject& JsonObject::Add(const std::string& key, const std::vector<int>& values) {
  std::string arr = "[";
  for (size_t i = 0; i < values.size(); ++i) absl::StrAppend(&arr, i ? "," : "", values[i]);
  arr += "]";
  return AddRaw(key, arr);
}
std::string JsonObject::ToString() const { return absl::StrCat("{", body_, "}"); }

// What the writer thread touches. The thread holds a reference, so an
// EventLog that gave up on a stuck disk may go away before it.
struct EventLog::State {
  explicit State(Options o) : options(std::move(o)) {}
  ~State() {
    if (fd >= 0) ::close(fd);
  }

  absl::Status OpenFile(int flags);
  void Rotate();
  // Writes `lines` in order, rotating at the size bound; stops early once
  // the log gave up (abandoned).
  void WriteLines(const std::deque<std::string>& lines);
  void WriteAll(const std::string& bytes);
  void WriterLoop();

  const Options options;
  // The writer thread's (and Open's before it starts).
  int fd = -1;
  int64_t size = 0;
  std::atomic<bool> abandoned{false};
  accord::Mutex mu;
  std::deque<std::string> queue ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
  bool writer_done ABSL_GUARDED_BY(mu) = false;
  int64_t queued ABSL_GUARDED_BY(mu) = 0;  // lines ever queued
  int64_t lines ABSL_GUARDED_BY(mu) = 0;   // lines ever written (or failed to)
  int64_t dropped ABSL_GUARDED_BY(mu) = 0;
};

absl::StatusOr<std::unique_ptr<EventLog>> EventLog::Open(const Options& options) {
  if (options.path.empty()) return absl::InvalidArgumentError("event log path is empty");
  if (options.max_bytes < 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("event log max size ", options.max_bytes, " bytes is below 1024"));
  }
  if (options.max_files < 1) {
    return absl::InvalidArgumentError("event log must keep at least 1 rotated file");
  }
  if (options.exit_drain < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("event log exit drain is negative");
  }
  auto state = std::make_shared<State>(options);
  if (absl::Status s = state->OpenFile(O_APPEND); !s.ok()) return s;
  std::unique_ptr<EventLog> log(new EventLog(state));
  log->writer_ = std::thread([state] { state->WriterLoop(); });
  return log;
}

EventLog::~EventLog() {
  State& s = *state_;
  bool drained;
  int64_t given_up = 0;
  {
    accord::MutexLock lock(&s.mu);
    s.stopping = true;
    auto done = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.writer_done; };
    drained = s.mu.AwaitWithTimeout(absl::Condition(&done), s.options.exit_drain);
    if (!drained) {
      // Lines the writer holds already are written or not as the disk
      // allows; the queued ones are dropped here.
      s.abandoned.store(true, std::memory_order_relaxed);
      given_up = static_cast<int64_t>(s.queue.size());
      s.dropped += given_up;
      s.queue.clear();
    }
  }
  if (drained) {
    writer_.join();
    return;
  }
  std::fprintf(stderr,
               "event log %s: the disk took no more within %s at exit; %lld queued lines "
               "dropped\n",
               s.options.path.c_str(), absl::FormatDuration(s.options.exit_drain).c_str(),
               static_cast<long long>(given_up));
  writer_.detach();
}

void EventLog::State::WriterLoop() {
  std::deque<std::string> batch;
  while (true) {
    {
      accord::MutexLock lock(&mu);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !queue.empty() || stopping; };
      mu.Await(absl::Condition(&ready));
      if (queue.empty() || abandoned.load(std::memory_order_relaxed)) {
        writer_done = true;  // stopping, everything written (or given up)
        return;
      }
      batch.swap(queue);
    }
    WriteLines(batch);
    accord::MutexLock lock(&mu);
    lines += static_cast<int64_t>(batch.size());
    batch.clear();
  }
}

void EventLog::Flush() {
  State& s = *state_;
  accord::MutexLock lock(&s.mu);
  const int64_t target = s.queued;
  auto done = [&s, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
    return s.lines + s.dropped >= target || s.stopping;
  };
  s.mu.Await(absl::Condition(&done));
}

absl::Status EventLog::State::OpenFile(int flags) {
  fd = ::open(options.path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | flags, 0644);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open event log ", options.path, ": ", std::strerror(errno)));
  }
  struct stat st;
  size = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) ? static_cast<int64_t>(st.st_size) : 0;
  return absl::OkStatus();
}

void EventLog::State::Rotate() {
  if (fd >= 0) ::close(fd);
  fd = -1;
  for (int i = options.max_files; i >= 1; --i) {
    const std::string from = i == 1 ? options.path : absl::StrCat(options.path, ".", i - 1);
    const std::string to = absl::StrCat(options.path, ".", i);
    std::rename(from.c_str(), to.c_str());
  }
  if (!OpenFile(O_TRUNC).ok()) fd = -1;
  size = 0;
}

void EventLog::State::WriteAll(const std::string& bytes) {
  size_t off = 0;
  while (fd >= 0 && off < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // a full or failing disk: the lines are lost, the log goes on
    off += static_cast<size_t>(n);
  }
}

void EventLog::State::WriteLines(const std::deque<std::string>& batch) {
  std::string pending;
  for (const std::string& line : batch) {
    if (abandoned.load(std::memory_order_relaxed)) return;
    const int64_t n = static_cast<int64_t>(line.size());
    if (size > 0 && size + n > options.max_bytes) {
      WriteAll(pending);
      pending.clear();
      Rotate();
    }
    pending += line;
    size += n;
    // One write per ~64 KiB, so a slow disk is given up on between writes.
    if (pending.size() >= (64 << 10)) {
      WriteAll(pending);
      pending.clear();
    }
  }
  WriteAll(pending);
}

void EventLog::Write(const std::string& type, const JsonObject& fields) {
  const absl::Time now = absl::Now();
  std::string line =
      absl::StrCat("{\"ts\":\"", absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", now, absl::UTCTimeZone()),
                   "\",\"event\":\"", JsonEscape(type), "\"");
  const std::string body = fields.ToString();
  if (body.size() > 2) absl::StrAppend(&line, ",", body.substr(1, body.size() - 2));
  line += "}\n";
  State& s = *state_;
  accord::MutexLock lock(&s.mu);
  ++s.queued;
  if (s.queue.size() >= s.options.max_queued) {
    ++s.dropped;
    return;
  }
  s.queue.push_back(std::move(line));
}

int64_t EventLog::lines_written() const {
  accord::MutexLock lock(&state_->mu);
  return state_->lines;
}

int64_t EventLog::lines_dropped() const {
  accord::MutexLock lock(&state_->mu);
  return state_->dropped;
}

}  // namespace accord
