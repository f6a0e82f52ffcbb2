#include "observe/event_log.h"

#include <cerrno>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

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

absl::StatusOr<std::unique_ptr<EventLog>> EventLog::Open(const Options& options) {
  if (options.path.empty()) return absl::InvalidArgumentError("event log path is empty");
  if (options.max_bytes < 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("event log max size ", options.max_bytes, " bytes is below 1024"));
  }
  if (options.max_files < 1) {
    return absl::InvalidArgumentError("event log must keep at least 1 rotated file");
  }
  std::unique_ptr<EventLog> log(new EventLog(options));
  if (absl::Status s = log->OpenFile(); !s.ok()) return s;
  log->writer_ = std::thread([raw = log.get()] { raw->WriterLoop(); });
  return log;
}

EventLog::~EventLog() {
  {
    accord::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (writer_.joinable()) writer_.join();
  if (file_ != nullptr) std::fclose(file_);
}

void EventLog::WriterLoop() {
  std::deque<std::string> batch;
  while (true) {
    {
      accord::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stopping_; };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, everything written
      batch.swap(queue_);
    }
    for (const std::string& line : batch) WriteLine(line);
    if (file_ != nullptr) std::fflush(file_);
    accord::MutexLock lock(&mu_);
    lines_ += static_cast<int64_t>(batch.size());
    batch.clear();
  }
}

void EventLog::Flush() {
  accord::MutexLock lock(&mu_);
  const int64_t target = queued_;
  auto done = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return lines_ + dropped_ >= target || stopping_;
  };
  mu_.Await(absl::Condition(&done));
}

absl::Status EventLog::OpenFile() {
  file_ = std::fopen(options_.path.c_str(), "a");
  if (file_ == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open event log ", options_.path, ": ", std::strerror(errno)));
  }
  std::fseek(file_, 0, SEEK_END);
  size_ = std::ftell(file_);
  return absl::OkStatus();
}

void EventLog::Rotate() {
  if (file_ != nullptr) std::fclose(file_);
  file_ = nullptr;
  for (int i = options_.max_files; i >= 1; --i) {
    const std::string from = i == 1 ? options_.path : absl::StrCat(options_.path, ".", i - 1);
    const std::string to = absl::StrCat(options_.path, ".", i);
    std::rename(from.c_str(), to.c_str());
  }
  file_ = std::fopen(options_.path.c_str(), "w");
  size_ = 0;
}

void EventLog::Write(const std::string& type, const JsonObject& fields) {
  const absl::Time now = absl::Now();
  std::string line =
      absl::StrCat("{\"ts\":\"", absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", now, absl::UTCTimeZone()),
                   "\",\"event\":\"", JsonEscape(type), "\"");
  const std::string body = fields.ToString();
  if (body.size() > 2) absl::StrAppend(&line, ",", body.substr(1, body.size() - 2));
  line += "}\n";
  accord::MutexLock lock(&mu_);
  ++queued_;
  if (queue_.size() >= options_.max_queued) {
    ++dropped_;
    return;
  }
  queue_.push_back(std::move(line));
}

void EventLog::WriteLine(const std::string& line) {
  if (size_ > 0 && size_ + static_cast<int64_t>(line.size()) > options_.max_bytes) Rotate();
  if (file_ == nullptr) return;
  std::fwrite(line.data(), 1, line.size(), file_);
  size_ += static_cast<int64_t>(line.size());
}

int64_t EventLog::lines_written() const {
  accord::MutexLock lock(&mu_);
  return lines_;
}

int64_t EventLog::lines_dropped() const {
  accord::MutexLock lock(&mu_);
  return dropped_;
}

}  // namespace accord
