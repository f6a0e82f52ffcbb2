// A broadcast serialized once for every stream (docs/ARCHITECTURE.md,
// "Threading"): the coordinator (and a relay) hand the same message object to
// every node stream of a job; SerializedOnce turns it into wire bytes the
// first time and gives every later stream the same bytes (a grpc::ByteBuffer
// copy shares the slices, it copies no data). One entry: broadcasts reach the
// streams one after another, so the entry is hit by every stream but the
// first; a message seen by one stream only costs what it cost before.
//
// Header-only: it needs grpcpp, which accord_daemon_common does not link.
// Thread-safe.
#ifndef ACCORD_DAEMON_COMMON_SERIALIZED_ONCE_H_
#define ACCORD_DAEMON_COMMON_SERIALIZED_ONCE_H_

#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "core/sync.h"
#include "grpcpp/support/byte_buffer.h"
// SerializationTraits for protobuf messages (moved out of codegen/ in newer gRPC).
#if __has_include("grpcpp/impl/proto_utils.h")
#include "grpcpp/impl/proto_utils.h"
#else
#include "grpcpp/impl/codegen/proto_utils.h"
#endif

namespace accord::daemon {

template <typename Message>
class SerializedOnce {
 public:
  // The wire bytes of `*message`; the same ByteBuffer object for the same
  // message object as the previous call.
  std::shared_ptr<const grpc::ByteBuffer> Get(const std::shared_ptr<const Message>& message) {
    accord::MutexLock l(&mu_);
    if (message == last_message_ && last_bytes_ != nullptr) {
      ++hits_;
      return last_bytes_;
    }
    auto bytes = std::make_shared<grpc::ByteBuffer>();
    bool own = false;
    if (!grpc::SerializationTraits<Message>::Serialize(*message, bytes.get(), &own).ok()) {
      return nullptr;  // larger than 2 GiB: the caller drops it
    }
    ++serializations_;
    last_message_ = message;  // held, so its address is not reused meanwhile
    last_bytes_ = std::move(bytes);
    return last_bytes_;
  }

  int64_t serializations() {
    accord::MutexLock l(&mu_);
    return serializations_;
  }
  int64_t hits() {
    accord::MutexLock l(&mu_);
    return hits_;
  }

 private:
  accord::Mutex mu_;
  std::shared_ptr<const Message> last_message_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const grpc::ByteBuffer> last_bytes_ ABSL_GUARDED_BY(mu_);
  int64_t serializations_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_SERIALIZED_ONCE_H_
