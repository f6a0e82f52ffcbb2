// Client over gRPC: one RankService.Session stream to the node's sidecar.
//
// Files by concern: grpc_client.cc (construction, Start, Close, Connect),
// grpc_client_connection.cc (the stream: writer, reader, hello, resume,
// reconnect; the phases are ClientConnection's, client/connection.h),
// grpc_client_submit.cc (registrations, manifests, decisions, Wait),
// grpc_kv_store.cc (the key-value rendezvous).
//
// Threads: the caller's threads (Register/Submit/Wait), a writer thread per
// stream that drains the outbox onto it, and the session thread that reads
// replies, completes futures and, when a stream ends, reconnects. Both
// background threads belong to GrpcClient and are joined in its destructor.
//
// Reconnect (docs/RELIABILITY.md, "Sidecar restart"): when a welcomed
// stream ends without an error from the sidecar (the sidecar was killed or
// restarted, or the stream dropped), the session thread opens a new stream
// with jittered exponential backoff (50 ms doubling up to 1 s, each wait drawn
// from [nominal/2, nominal]) until ClientOptions::reconnect_grace has passed
// since the end. Its hello carries RankResume: the run id from the last
// Welcome and, per group, the last step this rank holds a decision for; then
// every registration and every manifest without a decision go again, in
// full form. Calls made meanwhile queue. Past the grace every call fails with
// one error naming the node and the socket. Before the first welcome, a
// stream that cannot reach the sidecar is tried again, with the same
// backoff, until ClientOptions::connect_timeout (a sidecar may start after
// its ranks).
//
// SubmitBatch writes its batch on the caller's thread when no write is in
// flight and nothing is queued (the steady state), which saves a thread
// hand-off per round trip (docs/ARCHITECTURE.md, "Threading"); otherwise it
// queues for the writer. gRPC hands a write to the transport without waiting
// for the peer, so a direct write only blocks when HTTP/2 flow control is
// exhausted (the sidecar stopped reading). The stream is gRPC's synchronous
// one: one Read and one Write may run concurrently (`writing_` keeps writes
// one at a time); Finish runs only after the writer has stopped and no direct
// write is in flight (ClientConnection::StreamPhase::kOver).
#ifndef ACCORD_CLIENT_GRPC_CLIENT_H_
#define ACCORD_CLIENT_GRPC_CLIENT_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "accord/v1/accord.grpc.pb.h"
#include "client/client.h"
#include "client/connection.h"
#include "client/future_state.h"
#include "core/manifest.h"
#include "core/sync.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/sync_stream.h"

namespace accord {

// Thread-safe (one mutex, `mu_`).
class GrpcClient : public Client {
 public:
  explicit GrpcClient(const ClientOptions& options);
  // Writes what is queued (within a bound), stops the stream and joins the
  // session thread.
  ~GrpcClient() override;

  // Opens the stream, says hello and waits for the welcome.
  absl::Status Start();

  absl::Status RegisterGroup(const GroupSpec& spec, const Policy& policy,
                             absl::Time deadline) override;
  absl::Status RegisterGroups(const std::vector<std::pair<GroupSpec, Policy>>& groups,
                              absl::Time deadline) override;
  DecisionFuture Submit(const GroupSubmission& submission) override;
  using Client::SubmitBatch;
  std::vector<DecisionFuture> SubmitBatch(const std::vector<GroupSubmission>& batch,
                                          uint64_t sync_key) override;
  absl::StatusOr<Decision> Wait(const DecisionFuture& future, absl::Time deadline) override;
  std::optional<absl::Status> WaitVerdict(absl::Time deadline) override;
  KeyValueStore& kv() override { return *kv_; }
  absl::Status AddAdapterCounts(const AdapterCounts& more) override;
  const ClientOptions& options() const override { return options_; }
  absl::StatusOr<GroupSpec> Group(absl::string_view group_id) const override;

 private:
  enum class RegState { kPending, kOk, kFailed };
  struct Pending {
    int64_t step = 0;
    std::shared_ptr<DecisionFuture::State> state;
    std::shared_ptr<const std::vector<DTypeMask>> content;
  };
  // One registered group.
  struct GroupState {
    GroupSpec spec;
    Policy policy;
    uint64_t spec_fingerprint = 0;
    RegState reg = RegState::kPending;
    absl::Status reg_status;
    int64_t last_step = -1;            // last submitted step
    std::optional<uint64_t> last_key;  // key of the last full-form manifest on this stream
    // The last submitted content (guards repeats against key collisions),
    // shared with the pending steps that have it.
    std::shared_ptr<const std::vector<DTypeMask>> last_content;
    std::optional<Decision> last_decision;  // last successful decision received
    // The last step this rank holds a decision (or an error) for: what a
    // resume tells the sidecar (RankResume).
    int64_t decided_step = -1;
    // Submitted steps without a decision, ascending (steps only increase).
    std::deque<Pending> pending;
  };
  // The groups by id, and their ids in registration order (a resume sends
  // them again in that order).
  struct Groups {
    absl::flat_hash_map<std::string, GroupState> by_id;
    std::vector<std::string> order;
  };
  // The session stream, its channel (a fresh one per stream: no connection
  // backoff left from a previous sidecar process), stub and context.
  struct Stream {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::RankService::Stub> stub;
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::RankMessage, v1::RankReply>> rw;
  };
  // What SubmitBatch reuses instead of allocating: this rank's manifest (its
  // rank set built once) and batches the writer already sent, cleared.
  struct BatchBuffers {
    Manifest scratch;
    std::vector<std::unique_ptr<v1::ManifestBatch>> spare;
  };
  static constexpr size_t kMaxSpareBatches = 4;
  // What the session keeps across streams besides its groups.
  struct SessionFacts {
    // The totals of AddAdapterCounts, sent again on a resumed stream.
    std::optional<AdapterCounts> adapter_counts;
    bool welcome_members = false;  // the last Welcome's Welcome.members
    // The first error received that carries job_failed (WaitVerdict).
    std::optional<absl::Status> verdict;
  };

  static std::deque<Pending>::iterator FindPending(GroupState& g, int64_t step);
  // The totals of AddAdapterCounts as a message (sent now and on a resume).
  static v1::RankMessage AdapterCountsMessage(const AdapterCounts& counts);

  // Submit and wait (grpc_client_submit.cc).
  // OK (and *group set), or the submission's error.
  absl::Status CheckSubmission(const GroupSubmission& sub, GroupState** group)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds `sub`'s manifest to `batch` (a repeat of the last full form when
  // the content is the same) and records it as pending with `state`.
  void AddManifestLocked(const GroupSubmission& sub, GroupState& g,
                         std::shared_ptr<DecisionFuture::State> state, v1::ManifestBatch* batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes `msg` on the caller's thread when nothing would be overtaken,
  // else queues it for the writer.
  void SendBatchLocked(v1::RankMessage msg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The spec as it is registered (members of every rank dropped), or
  // INVALID_ARGUMENT / FAILED_PRECONDITION for members this session cannot
  // register.
  absl::StatusOr<GroupSpec> CheckRegistrationLocked(const GroupSpec& spec) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Latches the first error that carries job_failed as the job's verdict.
  void NoteVerdictLocked(const v1::DecisionError& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends a group's registration unless it was sent before (with the same
  // spec and policy).
  absl::Status SendRegistrationLocked(const GroupSpec& spec, const Policy& policy)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for a sent registration's result.
  absl::Status AwaitRegistrationLocked(const GroupSpec& spec, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleRegistrationLocked(const v1::RegistrationResult& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleDecisionLocked(const v1::Decision& d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, hub_->mu);
  absl::StatusOr<Decision> DecodeDecision(const GroupState& g, const v1::Decision& d) const;
  // Completes every pending call and registration with `s`.
  void FailAllLocked(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps a written batch's manifests for the next SubmitBatch.
  void RecycleBatchLocked(v1::RankMessage* msg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The connection (grpc_client_connection.cc).
  void EnqueueLocked(v1::RankMessage msg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    outbox_.push_back(std::move(msg));
  }
  // Whether the caller may write its message itself: the stream is up, no
  // write is in flight and nothing queued would be overtaken.
  bool CanWriteDirectlyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WriterLoop();
  // The hello of a new stream; a resume says what this rank holds.
  v1::RankMessage HelloLocked(bool resume) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OpenStreamLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a resumed stream sends first: the resume hello, every registration
  // and every manifest still without a decision (full form, ascending step).
  void QueueResumeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs streams until the session is over: reads each one's replies, then
  // reconnects (NextStreamLocked) or fails every call.
  void SessionLoop();
  // After a stream ended with `s`: opens the next one (true), or closes the
  // session and fails every call (false).
  bool NextStreamLocked(const grpc::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleReply(const v1::RankReply& reply);
  void HandleWelcomeLocked(const v1::Welcome& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleErrorLocked(const v1::DecisionError& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ClientOptions options_;
  std::unique_ptr<KeyValueStore> kv_;
  mutable accord::Mutex mu_;
  // Replaced (under mu_) only by the session thread, between streams, when
  // neither the writer nor a caller writes. Read is used by the session
  // thread, Write by the writer or a caller (one at a time, `writing_`),
  // Finish by the session thread once both are done.
  Stream stream_;
  std::deque<v1::RankMessage> outbox_ ABSL_GUARDED_BY(mu_);
  ClientConnection conn_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a Write is in flight (writer or caller)
  Groups groups_ ABSL_GUARDED_BY(mu_);
  SessionFacts facts_ ABSL_GUARDED_BY(mu_);
  const std::shared_ptr<FutureHub> hub_;
  BatchBuffers buffers_ ABSL_GUARDED_BY(mu_);
  std::thread session_;
};

}  // namespace accord

#endif  // ACCORD_CLIENT_GRPC_CLIENT_H_
