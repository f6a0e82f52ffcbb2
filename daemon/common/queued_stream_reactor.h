// The write side shared by the daemons' server bidi streams (the
// coordinator's sidecar sessions, the sidecar's rank sessions): messages are
// queued and written one at a time (gRPC allows one write in flight), and the
// stream finishes once the writes queued before the end are done and either
// the end was requested or the peer stopped sending. The queue has
// watermarks (write_queue_limits.h): a reader that falls `high` messages
// behind is cut off with RESOURCE_EXHAUSTED instead of growing memory.
//
// Header-only: it needs grpcpp, which accord_daemon_common does not link.
#ifndef ACCORD_DAEMON_COMMON_QUEUED_STREAM_REACTOR_H_
#define ACCORD_DAEMON_COMMON_QUEUED_STREAM_REACTOR_H_

#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "core/log.h"
#include "core/sync.h"
#include "daemon/common/write_queue_limits.h"
#include "grpcpp/support/server_callback.h"
#include "grpcpp/support/status.h"

namespace accord::daemon {

template <typename Request, typename Response>
class QueuedStreamReactor : public grpc::ServerBidiReactor<Request, Response> {
 public:
  void OnWriteDone(bool ok) override {
    accord::MutexLock l(&write_mu_);
    queue_.pop_front();
    watermarks_.Update(queue_.size());
    if (!ok) {
      // The peer is gone: nothing more can be written.
      write_failed_ = true;
      queue_.clear();
    }
    if (!queue_.empty()) {
      this->StartWrite(queue_.front().get());
      return;
    }
    writing_ = false;
    MaybeFinishLocked();
  }

 protected:
  // Queues `message` for writing. Dropped once the stream finished or a
  // write failed, and, unless `after_end` is set, once the end was requested.
  void Enqueue(std::shared_ptr<const Response> message, bool after_end) {
    accord::MutexLock l(&write_mu_);
    if (finished_ || write_failed_ || cut_off_ || (end_requested_ && !after_end)) return;
    queue_.push_back(std::move(message));
    switch (watermarks_.Update(queue_.size())) {
      case WriteQueueWatermarks::Verdict::kOk:
        break;
      case WriteQueueWatermarks::Verdict::kBackingUp:
        ACCORD_LOG(WARNING) << peer_ << " is slow to read its stream: " << queue_.size()
                            << " messages queued (--stream_queue_low_watermark="
                            << watermarks_.limits().low << ")";
        break;
      case WriteQueueWatermarks::Verdict::kCutOff: {
        const absl::Status cut = watermarks_.CutOffStatus(peer_);
        ACCORD_LOG(ERROR) << cut.message();
        cut_off_ = true;
        // Keep only the write in flight; the stream ends after it.
        if (writing_) {
          queue_.erase(queue_.begin() + 1, queue_.end());
        } else {
          queue_.clear();
        }
        end_requested_ = true;
        end_status_ =
            grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, std::string(cut.message()));
        MaybeFinishLocked();
        return;
      }
    }
    if (!writing_) {
      writing_ = true;
      this->StartWrite(queue_.front().get());
    }
  }

  // Ends the stream with `status` once the queued writes are done. The first
  // request's status is the one the peer sees.
  void EndAfterWrites(grpc::Status status) {
    accord::MutexLock l(&write_mu_);
    if (!end_requested_) {
      end_requested_ = true;
      end_status_ = std::move(status);
    }
    MaybeFinishLocked();
  }

  // Sets the watermarks and how the peer is named in their messages; call
  // from the constructor, before anything is queued.
  void SetWriteQueueLimits(WriteQueueLimits limits, std::string peer) {
    accord::MutexLock l(&write_mu_);
    watermarks_ = WriteQueueWatermarks(limits);
    peer_ = std::move(peer);
  }

  // Whether the peer was cut off for not reading (see SetWriteQueueLimits).
  bool CutOff() {
    accord::MutexLock l(&write_mu_);
    return cut_off_;
  }

  bool EndRequested() {
    accord::MutexLock l(&write_mu_);
    return end_requested_;
  }

  // The read side is over (the peer half-closed, the read failed, or the
  // reactor stopped reading): finish with OK, unless an end was requested,
  // once the queued writes are done.
  void ReadEnded() {
    accord::MutexLock l(&write_mu_);
    read_ended_ = true;
    MaybeFinishLocked();
  }

  // Finishes at once (a stream refused before anything was queued).
  void FinishNow(grpc::Status status) {
    accord::MutexLock l(&write_mu_);
    if (finished_) return;
    finished_ = true;
    this->Finish(std::move(status));
  }

 private:
  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) {
    if (finished_ || writing_ || !(read_ended_ || end_requested_)) return;
    finished_ = true;
    this->Finish(end_requested_ ? end_status_ : grpc::Status::OK);
  }

  accord::Mutex write_mu_;
  std::deque<std::shared_ptr<const Response>> queue_ ABSL_GUARDED_BY(write_mu_);
  bool writing_ ABSL_GUARDED_BY(write_mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(write_mu_) = false;
  bool read_ended_ ABSL_GUARDED_BY(write_mu_) = false;
  bool end_requested_ ABSL_GUARDED_BY(write_mu_) = false;
  bool finished_ ABSL_GUARDED_BY(write_mu_) = false;
  grpc::Status end_status_ ABSL_GUARDED_BY(write_mu_);
  bool cut_off_ ABSL_GUARDED_BY(write_mu_) = false;
  WriteQueueWatermarks watermarks_ ABSL_GUARDED_BY(write_mu_);
  std::string peer_ ABSL_GUARDED_BY(write_mu_) = "the peer";
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_QUEUED_STREAM_REACTOR_H_
