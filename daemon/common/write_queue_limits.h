// Watermarks on a stream's write queue (see docs/ARCHITECTURE.md, "Bounds").
//
// A daemon never lets one slow reader grow its memory: past `low` queued
// messages the stream is reported as backing up (once, re-armed when the
// queue drains below low / 2); past `high` the reader is cut off: what is
// queued is dropped and the stream ends with RESOURCE_EXHAUSTED naming the
// limit, once the write already in flight completes.
//
// Pure and not thread-safe: QueuedStreamReactor calls it under its lock.
#ifndef ACCORD_DAEMON_COMMON_WRITE_QUEUE_LIMITS_H_
#define ACCORD_DAEMON_COMMON_WRITE_QUEUE_LIMITS_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace accord::daemon {

struct WriteQueueLimits {
  size_t low = 1024;    // --stream_queue_low_watermark
  size_t high = 16384;  // --stream_queue_high_watermark
};

class WriteQueueWatermarks {
 public:
  enum class Verdict { kOk, kBackingUp, kCutOff };

  explicit WriteQueueWatermarks(WriteQueueLimits limits = {}) : limits_(limits) {}

  // The queue now holds `queued` messages (after a push or a completed write).
  Verdict Update(size_t queued) {
    if (queued > limits_.high) return Verdict::kCutOff;
    if (!warned_ && queued > limits_.low) {
      warned_ = true;
      return Verdict::kBackingUp;
    }
    if (warned_ && queued < limits_.low / 2) warned_ = false;
    return Verdict::kOk;
  }

  // The status a cut-off reader's stream ends with.
  absl::Status CutOffStatus(const std::string& peer) const {
    return absl::ResourceExhaustedError(absl::StrCat(
        peer, " did not read its stream: more than ", limits_.high,
        " messages were queued for it (--stream_queue_high_watermark), so it was cut off "
        "instead of growing the daemon's memory; check that the process reads its replies "
        "(is it stopped or overloaded?) and reconnect"));
  }

  const WriteQueueLimits& limits() const { return limits_; }

 private:
  WriteQueueLimits limits_;
  bool warned_ = false;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_WRITE_QUEUE_LIMITS_H_
