// The accord client: linked into each training process (one per rank).
//
// Protocol, from the rank's side (see proto/accord/v1/accord.proto,
// RankService):
//   1. Connect opens one Session stream to the node's sidecar over its Unix
//      socket and says hello (job, rank, world size, local rank, token).
//   2. RegisterGroup sends each group's spec once; the coordinator checks it
//      is identical on every rank.
//   3. Submit sends a manifest per group and step and returns at once; the
//      library's own thread receives decisions and completes futures.
//   4. Wait blocks the calling thread (never a gRPC thread) until the
//      decision, an error, or the deadline.
//   5. When the stream ends without an error (sidecar restarted, stream
//      dropped), the library reconnects within ClientOptions::reconnect_grace
//      and resumes: calls in flight get the decisions they would have got.
//
// Thread-safety: Client is thread-safe; the intended use is one training
// thread plus the library's own background thread. No user code runs on
// gRPC threads.
#ifndef ACCORD_CLIENT_CLIENT_H_
#define ACCORD_CLIENT_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/kv_store.h"
#include "core/decide.h"
#include "core/group.h"

namespace accord {

struct ClientOptions {
  std::string socket_path;  // the sidecar's Unix socket
  std::string job_id;
  int rank = -1;
  int world_size = 0;
  int local_rank = 0;
  std::string token;  // the job's token, when the deployment requires one
  // How long Connect waits for the sidecar's welcome, trying again (with
  // backoff) while nothing serves the socket yet.
  absl::Duration connect_timeout = absl::Seconds(30);
  // When the stream to the sidecar ends (the sidecar was restarted, or the
  // stream dropped), how long the client keeps reconnecting, with jittered
  // backoff, before every call fails (docs/RELIABILITY.md, "Sidecar
  // restart"). The default matches the coordinator's --node_reconnect_grace.
  // Zero: no reconnect; the session ends with the stream.
  absl::Duration reconnect_grace = absl::Seconds(10);
  // The launch this process belongs to (RankHello.launch_id): the same for
  // the rank processes a launcher started together, another for a process
  // started again. Empty: ACCORD_LAUNCH_ID, else torchrun's
  // TORCHELASTIC_RUN_ID and TORCHELASTIC_RESTART_COUNT, else none.
  std::string launch_id;
};

// The launch id the environment gives (ClientOptions::launch_id), "" when
// none.
std::string LaunchIdFromEnvironment();

// The DEADLINE_EXCEEDED that Wait and RegisterGroup(s) return when the
// caller's deadline passes before the result: this rank's wait ended, nothing
// was decided or failed, and waiting or registering again waits for the same
// result. It carries kLocalTimeoutPayloadUrl; the coordinator's
// DEADLINE_EXCEEDED (ranks that never submitted or registered) does not, so
// callers tell them apart with IsLocalTimeout, never by the message.
inline constexpr char kLocalTimeoutPayloadUrl[] = "type.accord.dev/accord.client.LocalTimeout";
inline absl::Status LocalTimeoutError(absl::string_view message) {
  absl::Status status = absl::DeadlineExceededError(message);
  status.SetPayload(kLocalTimeoutPayloadUrl, absl::Cord("1"));
  return status;
}
inline bool IsLocalTimeout(const absl::Status& status) {
  return status.GetPayload(kLocalTimeoutPayloadUrl).has_value();
}

// A submitted manifest's eventual decision. Cheap to copy.
class DecisionFuture {
 public:
  struct State;
  DecisionFuture() = default;
  explicit DecisionFuture(std::shared_ptr<State> state) : state_(std::move(state)) {}
  bool valid() const { return state_ != nullptr; }
  // True once the decision or an error has arrived.
  bool Ready() const;
  const std::shared_ptr<State>& state() const { return state_; }

 private:
  std::shared_ptr<State> state_;
};

// What one rank holds for one group at one step.
struct GroupSubmission {
  std::string group_id;
  int64_t step = 0;
  // One entry per registered parameter, in group order: the gradient's dtype,
  // or std::nullopt when this rank has no gradient for it.
  std::vector<std::optional<DType>> grad_dtypes;
};

// What a framework adapter counts (accord.torch: speculative reduce-scatters
// and their repairs), for the sidecar's metrics.
struct AdapterCounts {
  int64_t speculated = 0;
  int64_t repaired = 0;
  int64_t redone = 0;
};

class Client {
 public:
  virtual ~Client() = default;

  // Connects to the sidecar and joins the job. UNAVAILABLE when the socket
  // cannot be reached (names the path), PERMISSION_DENIED for a bad token,
  // ALREADY_EXISTS when the rank already joined, INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  // Registers a group (once per job). Returns when the coordinator has checked
  // the registration against every member (spec.members; null: every rank):
  // FAILED_PRECONDITION naming the first differing parameter (or member set)
  // and the ranks on mismatch; INVALID_ARGUMENT for a bad spec, members of
  // another world size or members without this rank; FAILED_PRECONDITION
  // before anything is sent for members when the sidecar's Welcome lacks
  // Welcome.members; DEADLINE_EXCEEDED naming the members that did not
  // register it within the coordinator's --deadline of its first
  // registration (or, when `deadline` passes first, a LocalTimeoutError
  // saying that no result came). Members of every rank are registered as none.
  virtual absl::Status RegisterGroup(const GroupSpec& spec, const Policy& policy,
                                     absl::Time deadline) = 0;
  // Registers many groups: every registration is sent before any result is
  // awaited, so all of them cost one round trip. The first error, in the
  // order given; the same errors as RegisterGroup.
  virtual absl::Status RegisterGroups(const std::vector<std::pair<GroupSpec, Policy>>& groups,
                                      absl::Time deadline) = 0;

  // Submits one manifest; never blocks on the network. Errors in the
  // submission itself (unknown group, wrong entry count, step going
  // backwards) complete the future with that error.
  virtual DecisionFuture Submit(const GroupSubmission& submission) = 0;
  // Submits many groups in one message.
  std::vector<DecisionFuture> SubmitBatch(const std::vector<GroupSubmission>& batch) {
    return SubmitBatch(batch, /*sync_key=*/0);
  }
  // The same; a non-zero `sync_key` marks the message as one of this rank's
  // releases: the sidecar sends the node manifests completed by the n-th
  // releases with one key of its ranks upstream together (docs/MEMBERS.md
  // 2.11). Ranks pass equal keys only when they run the same action list.
  virtual std::vector<DecisionFuture> SubmitBatch(const std::vector<GroupSubmission>& batch,
                                                  uint64_t sync_key) = 0;

  // Waits for a decision. The same Decision on every rank, or the same error
  // on every rank (missing ranks past the coordinator's deadline, mismatched
  // registration, ...). A LocalTimeoutError when `deadline` passes first;
  // UNAVAILABLE when the sidecar is gone.
  virtual absl::StatusOr<Decision> Wait(const DecisionFuture& future, absl::Time deadline) = 0;

  // The job's verdict: blocks until the session latches an error carrying
  // job_failed (from any reply) and returns it, or the error the session
  // closed with when it closed without one; nullopt when `deadline` passes
  // first (the job has not failed as far as this rank knows).
  virtual std::optional<absl::Status> WaitVerdict(absl::Time deadline) = 0;

  // The job-scoped key-value rendezvous (served by the coordinator, reached
  // through the sidecar), for collective bootstrap.
  virtual KeyValueStore& kv() = 0;

  // Adds `more` to the adapter's counts (every adapter of this process adds
  // to one tally) and sends the totals to the sidecar; never blocks; the
  // totals are sent again on a resumed stream. INVALID_ARGUMENT unless
  // 0 <= redone <= repaired <= speculated in `more`.
  virtual absl::Status AddAdapterCounts(const AdapterCounts& more) = 0;

  virtual const ClientOptions& options() const = 0;
  // The spec registered for a group, or NOT_FOUND.
  virtual absl::StatusOr<GroupSpec> Group(absl::string_view group_id) const = 0;
};

}  // namespace accord

#endif  // ACCORD_CLIENT_CLIENT_H_
