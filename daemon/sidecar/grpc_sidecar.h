// gRPC adapters for the sidecar: the RankService and the key-value forwarder
// served on the Unix socket, and the upstream stream to the coordinator. They
// only convert and move bytes; the logic is in Sidecar.
#ifndef ACCORD_DAEMON_SIDECAR_GRPC_SIDECAR_H_
#define ACCORD_DAEMON_SIDECAR_GRPC_SIDECAR_H_

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/time/time.h"
#include "accord/v1/accord.grpc.pb.h"
#include "core/sync.h"
#include "daemon/common/upstream_health.h"
#include "daemon/common/write_queue_limits.h"
#include "daemon/sidecar/key_ledger.h"
#include "daemon/sidecar/sidecar.h"
#include "daemon/sidecar/sidecar_jobs.h"
#include "grpcpp/grpcpp.h"

namespace accord::daemon {

class RankSessionReactor;

// RankService.Session: one reactor per rank process, driving `sessions`
// (the daemon's SidecarJobs, or one Sidecar in tests).
class RankGrpcService final : public v1::RankService::CallbackService {
 public:
  // `queue_limits`: the watermarks of each rank stream's write queue
  // (write_queue_limits.h).
  explicit RankGrpcService(RankSessionHandler* sessions, WriteQueueLimits queue_limits = {})
      : sidecar_(sessions), queue_limits_(queue_limits) {}
  grpc::ServerBidiReactor<v1::RankMessage, v1::RankReply>* Session(
      grpc::CallbackServerContext* context) override;
  // Ends every rank stream (UNAVAILABLE) after its queued replies.
  void FinishAll();

 private:
  friend class RankSessionReactor;
  void Remove(RankSessionReactor* r);
  RankSessionHandler* const sidecar_;
  const WriteQueueLimits queue_limits_;
  accord::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<RankSessionReactor*> live_ ABSL_GUARDED_BY(mu_);
};

// KeyValueService on the socket: forwards to the coordinator (the request
// already names its job); with --job only that job's keys pass. With a
// `token` (the sidecar's job token) a request carrying a different non-empty
// token is refused (PERMISSION_DENIED) and requests go upstream with `token`;
// the coordinator then checks it belongs to the request's job.
class KeyValueForwarder final : public v1::KeyValueService::CallbackService {
 public:
  // `slack`: how long a forwarded request may take beyond its own wait.
  // From the first Set on, watches `coordinator`'s connection from a thread
  // of its own: when it is ready again after it was lost, the Sets kept in the KeyLedger go up
  // again (a restarted coordinator has lost its keys).
  KeyValueForwarder(std::shared_ptr<grpc::Channel> coordinator, std::string only_job,
                    std::string token = "", absl::Duration slack = absl::Seconds(30));
  ~KeyValueForwarder() override;
  // Requests of a job served here go upstream stamped with its current
  // launch's run, node and epoch (SidecarJobs::CurrentRun); set before
  // serving. Not owned.
  // Also says which kept runs are still served here (a job's current run).
  void SetJobs(SidecarJobs* jobs);
  // The run of a job served here ("" while not known yet; nullopt: the job
  // is not served here): a relay's own, or SetJobs's. Kept Sets of other runs
  // are dropped, and those made before their run was known go up naming it
  // (docs/RELIABILITY.md, "Keys across a coordinator restart"). Unset, all
  // are kept, until the bound. Set before serving; must outlive the forwarder.
  void SetRunOf(std::function<std::optional<std::string>(const std::string& job_id)> run_of) {
    run_of_ = std::move(run_of);
  }
  // Whether the node above answers (not owned; null: calls wait for it
  // until their own deadline). While it does not, a call waits for it at
  // most until it counts as lost, then ends with the loss's words.
  void SetHealth(UpstreamHealth* health) { calls_->health = health; }
  // Ends every call still waiting upstream (UNAVAILABLE) and refuses new
  // ones: the sidecar stops, and must not wait for a coordinator that does
  // not answer.
  void Stop();
  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* context,
                                const v1::KeyValueSetRequest* request,
                                v1::KeyValueSetResponse* response) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context,
                                const v1::KeyValueGetRequest* request,
                                v1::KeyValueGetResponse* response) override;

 private:
  template <typename Request>
  void Stamp(Request* request) const;
  // OK, or PERMISSION_DENIED for a request token that is not the sidecar's.
  grpc::Status CheckToken(const std::string& job_id, const std::string& token) const;

  // Sends the kept Sets again after the connection came back.
  void WatchUpstream();
  // Sends those of `waiting` whose run is known, and drops those no longer
  // served here; leaves the others.
  void SetAgain(std::vector<v1::KeyValueSetRequest>* waiting);
  // Whether a kept run is still served here (run_of_; all, without one).
  bool Live(const std::string& job_id, const std::string& run_id) const;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KeyValueService::Stub> stub_;
  const std::string only_job_;
  const std::string token_;
  const absl::Duration slack_;
  SidecarJobs* jobs_ = nullptr;
  std::function<std::optional<std::string>(const std::string&)> run_of_;

 public:
  // The calls in flight upstream, shared with each call (which may end
  // after the forwarder is gone).
  struct Calls {
    UpstreamHealth* health = nullptr;
    // The channel to the node above (the node's stream's), whose state an
    // attempt reads as it starts.
    std::shared_ptr<grpc::Channel> channel;
    accord::Mutex mu;
    bool stopping ABSL_GUARDED_BY(mu) = false;
    absl::flat_hash_set<std::shared_ptr<grpc::ClientContext>> live ABSL_GUARDED_BY(mu);
    KeyLedger ledger;
  };

 private:
  std::shared_ptr<Calls> calls_ = std::make_shared<Calls>();
  std::once_flag watch_once_;
  std::thread watcher_;  // from the first Set on
};

// The long-lived CoordinatorService.Session stream. Owns a reader thread
// (connects, reconnects with exponential backoff capped at `max_backoff`,
// feeds the Sidecar) and a writer thread (drains the queue). Both stop in
// Stop() or the destructor, after what is queued is written (bounded).
class GrpcUpstream final : public UpstreamSink {
 public:
  // `handler`: the Sidecar, or a relay's upstream side.
  GrpcUpstream(std::shared_ptr<grpc::Channel> channel, UpstreamHandler* handler,
               absl::Duration max_backoff);
  ~GrpcUpstream() override;
  void Start();
  void Stop();

  void Send(v1::NodeMessage message) override;
  void Reset(std::vector<v1::NodeMessage> messages) override;
  void Reconnect() override;

 private:
  void ReadLoop();
  void WriteLoop();

  std::unique_ptr<v1::CoordinatorService::Stub> stub_;
  UpstreamHandler* const handler_;
  const absl::Duration max_backoff_;
  accord::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool reconnect_requested_ ABSL_GUARDED_BY(mu_) = false;  // Reconnect() called
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  // The current call: its context (set while it is being opened and read),
  // its stream (set once the handler was told of it), whether the writer is
  // writing to it outside the lock, and whether it is to end (Reconnect) and
  // was half-closed once its queue was written.
  struct Call {
    uint64_t id = 0;
    grpc::ClientContext* context = nullptr;
    grpc::ClientReaderWriter<v1::NodeMessage, v1::CoordinatorMessage>* stream = nullptr;
    bool writing = false;
    bool ending = false;
    bool half_closed = false;
  };
  // Writes what is queued, then half-closes the call; cancels it when the
  // coordinator has not finished it within a bound.
  void EndCallLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits up to `bound` for call `id` to end (or the stream to stop); false
  // when it has not.
  bool AwaitCallEndLocked(uint64_t id, absl::Duration bound) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Call call_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::NodeMessage> queue_ ABSL_GUARDED_BY(mu_);
  std::thread reader_;
  std::thread writer_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_SIDECAR_GRPC_SIDECAR_H_
