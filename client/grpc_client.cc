// Client over gRPC: one RankService.Session stream to the node's sidecar.
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
// its ranks). SubmitBatch writes its batch
// on the caller's thread when no write is in flight and nothing is queued
// (the steady state), which saves a thread hand-off per round trip
// (docs/ARCHITECTURE.md, "Threading"); otherwise it queues for the writer.
// gRPC hands a write to the transport without waiting for the peer, so a
// direct write only blocks when HTTP/2 flow control is exhausted (the
// sidecar stopped reading).
// The stream is gRPC's synchronous one: one Read and one Write may run
// concurrently (`writing_` keeps writes one at a time); Finish runs only
// after the writer has stopped and no direct write is in flight.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "accord/v1/accord.grpc.pb.h"
#include "client/client.h"
#include "client/grpc_kv_store.h"
#include "core/log.h"
#include "core/sync.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/wire.h"

namespace accord {

// The one mutex of all futures of a client: a batch of decisions completes
// under one lock, and no mutex is created or destroyed per future (Abseil's
// deadlock detection, on in Debian's build, tracks every mutex it sees).
// Shared by the client and its futures, which may outlive it.
struct FutureHub {
  accord::Mutex mu;
};

struct DecisionFuture::State {
  State(std::shared_ptr<FutureHub> h, std::string g, int64_t s)
      : hub_owner(std::move(h)), hub(hub_owner.get()), group_id(std::move(g)), step(s) {}
  const std::shared_ptr<FutureHub> hub_owner;
  FutureHub* const hub;
  const std::string group_id;
  const int64_t step;
  bool done ABSL_GUARDED_BY(hub->mu) = false;
  // Read only once done (an empty-message placeholder until then).
  absl::StatusOr<Decision> result ABSL_GUARDED_BY(hub->mu);

  // Set (release) after `result` is written, which then never changes:
  // a reader that sees it true (acquire) may read `result` without the lock.
  std::atomic<bool> completed{false};

  void CompleteLocked(absl::StatusOr<Decision> r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hub->mu) {
    if (done) return;
    result = std::move(r);
    done = true;
    completed.store(true, std::memory_order_release);
  }
  // Only after `completed` was seen true.
  const absl::StatusOr<Decision>& CompletedResult() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return result;
  }
  void Complete(absl::StatusOr<Decision> r) {
    accord::MutexLock lock(&hub->mu);
    CompleteLocked(std::move(r));
  }
};

bool DecisionFuture::Ready() const {
  return state_ != nullptr && state_->completed.load(std::memory_order_acquire);
}

namespace {

constexpr char kClientVersion[] = "accord-client/0.1.0";
// How long closing the client waits for what it queued to be written.
constexpr absl::Duration kCloseFlush = absl::Seconds(1);

v1::RankMessage AdapterCountsMessage(const AdapterCounts& counts) {
  v1::RankMessage msg;
  v1::AdapterCounts* c = msg.mutable_adapter_counts();
  c->set_speculated(counts.speculated);
  c->set_repaired(counts.repaired);
  c->set_redone(counts.redone);
  return msg;
}

bool SamePolicy(const Policy& a, const Policy& b) {
  return a.reduce_dtype == b.reduce_dtype && a.reduce_dtype_exact == b.reduce_dtype_exact &&
         a.fp8_tie == b.fp8_tie && a.empty_group_dtype == b.empty_group_dtype;
}

// A channel to the sidecar's socket whose own reconnect backoff is capped
// like the session's (gRPC's default grows to 120 s), so that a key-value
// call after a sidecar restart finds it within a second.
std::shared_ptr<grpc::Channel> SidecarChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// A stream's channel: a connection attempt (the socket's connect and the
// sidecar's HTTP/2 settings) ends within a second instead of gRPC's 20 s, so
// an attempt that finds a sidecar stopped ends in time for the next one, or
// for the reconnect grace.
std::shared_ptr<grpc::Channel> SessionChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

class GrpcClient : public Client {
 public:
  explicit GrpcClient(const ClientOptions& options)
      : options_(options),
        target_(absl::StrCat("unix:", options.socket_path)),
        rng_(std::random_device()() ^ static_cast<uint64_t>(options.rank)) {
    channel_ = SidecarChannel(target_);
    kv_ = MakeGrpcKeyValueStore(channel_, absl::StrCat("the sidecar at ", options.socket_path),
                                options.job_id, options.token, options.rank, [this] {
                                  accord::MutexLock lock(&mu_);
                                  return ClosedStatus();
                                });
    accord::MutexLock lock(&mu_);
    scratch_.ranks = RankSet(options.world_size);
    scratch_.ranks.Add(options.rank);
  }

  ~GrpcClient() override {
    {
      accord::MutexLock lock(&mu_);
      // What is queued (an adapter's last counts) is written first, within
      // a bound.
      auto written = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return (outbox_.empty() && !writing_) || !welcomed_ || read_ended_ || closed_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&written), kCloseFlush);
      stopping_ = true;
      if (ctx_ != nullptr) ctx_->TryCancel();
    }
    if (session_.joinable()) session_.join();
  }

  // Opens the stream, says hello and waits for the welcome.
  absl::Status Start() {
    {
      accord::MutexLock lock(&mu_);
      connect_deadline_ = absl::Now() + options_.connect_timeout;
      OpenStreamLocked();
      outbox_.push_back(HelloLocked(/*resume=*/false));
    }
    session_ = std::thread([this] { SessionLoop(); });

    accord::MutexLock lock(&mu_);
    auto answered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return welcomed_ || closed_ || !fatal_.ok();
    };
    mu_.AwaitWithDeadline(absl::Condition(&answered), connect_deadline_);
    if (!fatal_.ok()) return fatal_;
    if (closed_) return closed_status_;
    if (!welcomed_) {
      return absl::DeadlineExceededError(
          absl::StrCat("no welcome from the sidecar at ", options_.socket_path, " within ",
                       absl::FormatDuration(options_.connect_timeout), " (job \"", options_.job_id,
                       "\", rank ", options_.rank,
                       "); check that accord-sidecar is healthy and connected to "
                       "its coordinator"));
    }
    return absl::OkStatus();
  }

  absl::Status RegisterGroup(const GroupSpec& spec, const Policy& policy,
                             absl::Time deadline) override {
    return RegisterGroups({{spec, policy}}, deadline);
  }

  absl::Status RegisterGroups(const std::vector<std::pair<GroupSpec, Policy>>& groups,
                              absl::Time deadline) override {
    for (const auto& [spec, policy] : groups) {
      if (absl::Status s = ValidateGroupSpec(spec); !s.ok()) return s;
    }
    accord::MutexLock lock(&mu_);
    if (absl::Status s = ClosedStatus(); !s.ok()) return s;
    for (const auto& [spec, policy] : groups) {
      if (absl::Status s = SendRegistrationLocked(spec, policy); !s.ok()) return s;
    }
    for (const auto& [spec, policy] : groups) {
      if (absl::Status s = AwaitRegistrationLocked(spec, deadline); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  DecisionFuture Submit(const GroupSubmission& submission) override {
    return SubmitBatch({submission}).front();
  }

  std::vector<DecisionFuture> SubmitBatch(const std::vector<GroupSubmission>& batch) override {
    std::vector<DecisionFuture> out;
    out.reserve(batch.size());
    v1::RankMessage msg;
    accord::MutexLock lock(&mu_);
    // A batch the writer already sent, cleared: its manifests and strings are
    // reused instead of allocated again.
    if (!spare_batches_.empty()) {
      msg.set_allocated_manifests(spare_batches_.back().release());
      spare_batches_.pop_back();
    }
    v1::ManifestBatch* mb = msg.mutable_manifests();
    const absl::Status closed = ClosedStatus();
    for (const GroupSubmission& sub : batch) {
      auto state = std::make_shared<DecisionFuture::State>(hub_, sub.group_id, sub.step);
      out.emplace_back(state);
      if (!closed.ok()) {
        state->Complete(closed);
        continue;
      }
      GroupState* found = nullptr;
      absl::Status s = CheckSubmission(sub, &found);
      if (!s.ok()) {
        state->Complete(s);
        continue;
      }
      GroupState& g = *found;
      // This rank's manifest, built in scratch_ (its rank set is made once).
      scratch_.step = sub.step;
      scratch_.dtypes.resize(sub.grad_dtypes.size());
      for (size_t i = 0; i < sub.grad_dtypes.size(); ++i) {
        scratch_.dtypes[i] = sub.grad_dtypes[i] ? MaskOf(*sub.grad_dtypes[i]) : DTypeMask{0};
      }
      v1::Manifest* pm = mb->add_manifests();
      // The key is a function of the content (the rank set is fixed): the
      // same content as the last full form is a repeat of its key.
      if (g.last_key.has_value() && *g.last_content == scratch_.dtypes) {
        pm->set_group_id(sub.group_id);
        pm->set_step(sub.step);
        pm->set_cache_key(*g.last_key);
        pm->set_repeat(true);
      } else {
        wire::ManifestToProto(sub.group_id, scratch_, /*with_ranks=*/false, pm);
        g.last_key = pm->cache_key();
      }
      if (g.last_content == nullptr || *g.last_content != scratch_.dtypes) {
        g.last_content = std::make_shared<const std::vector<DTypeMask>>(scratch_.dtypes);
      }
      g.last_step = sub.step;
      // The content stays with the step until its decision: a resume resends it.
      g.pending.push_back(Pending{sub.step, std::move(state), g.last_content});
    }
    if (mb->manifests_size() == 0) return out;
    if (!CanWriteDirectlyLocked()) {
      EnqueueLocked(std::move(msg));
      return out;
    }
    writing_ = true;
    mu_.Unlock();
    const bool ok = stream_->Write(msg);
    mu_.Lock();
    writing_ = false;
    RecycleBatchLocked(&msg);
    // A failed write means the stream is broken: the reader sees it end.
    if (!ok) ctx_->TryCancel();
    return out;
  }

  absl::StatusOr<Decision> Wait(const DecisionFuture& future, absl::Time deadline) override {
    if (!future.valid()) {
      return absl::InvalidArgumentError("Wait on an empty DecisionFuture (not from Submit)");
    }
    DecisionFuture::State* st = future.state().get();
    // Usually the decision is already there (a batch completes at once): no lock.
    if (st->completed.load(std::memory_order_acquire)) return st->CompletedResult();
    accord::MutexLock lock(&st->hub->mu);
    st->hub->mu.AwaitWithDeadline(absl::Condition(&st->done), deadline);
    if (!st->done) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no decision for group \"", st->group_id, "\" step ", st->step, " (job \"",
          options_.job_id, "\", rank ", options_.rank,
          ") before the caller's deadline; the coordinator reports ranks that never submitted "
          "once its own deadline passes"));
    }
    return st->result;
  }

  KeyValueStore& kv() override { return *kv_; }

  absl::Status AddAdapterCounts(const AdapterCounts& more) override {
    if (more.redone < 0 || more.redone > more.repaired || more.repaired > more.speculated) {
      return absl::InvalidArgumentError(absl::StrCat(
          "adapter counts must hold 0 <= redone <= repaired <= speculated; got speculated=",
          more.speculated, " repaired=", more.repaired, " redone=", more.redone));
    }
    accord::MutexLock lock(&mu_);
    if (absl::Status s = ClosedStatus(); !s.ok()) return s;
    AdapterCounts& total = adapter_counts_.emplace(adapter_counts_.value_or(AdapterCounts{}));
    total.speculated += more.speculated;
    total.repaired += more.repaired;
    total.redone += more.redone;
    EnqueueLocked(AdapterCountsMessage(total));
    return absl::OkStatus();
  }
  const ClientOptions& options() const override { return options_; }

  absl::StatusOr<GroupSpec> Group(absl::string_view group_id) const override {
    accord::MutexLock lock(&mu_);
    auto it = groups_.find(group_id);
    if (it == groups_.end() || it->second.reg != RegState::kOk) {
      return absl::NotFoundError(
          absl::StrCat("group \"", group_id, "\" is not registered on rank ", options_.rank));
    }
    return it->second.spec;
  }

 private:
  enum class RegState { kPending, kOk, kFailed };
  struct Pending {
    int64_t step = 0;
    std::shared_ptr<DecisionFuture::State> state;
    std::shared_ptr<const std::vector<DTypeMask>> content;
  };
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

  static auto FindPending(GroupState& g, int64_t step) {
    return std::find_if(g.pending.begin(), g.pending.end(),
                        [step](const Pending& p) { return p.step == step; });
  }

  absl::Status ClosedStatus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!fatal_.ok()) return fatal_;
    if (closed_) return closed_status_;
    return absl::OkStatus();
  }

  // OK (and *group set), or the submission's error.
  absl::Status CheckSubmission(const GroupSubmission& sub, GroupState** group)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = groups_.find(sub.group_id);
    if (it == groups_.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("manifest for group \"", sub.group_id, "\" step ", sub.step, " on rank ",
                       options_.rank, ": the group is not registered; call RegisterGroup first"));
    }
    const GroupState& g = it->second;
    if (g.reg == RegState::kFailed) return g.reg_status;
    if (g.reg != RegState::kOk) {
      return absl::FailedPreconditionError(absl::StrCat(
          "manifest for group \"", sub.group_id, "\" step ", sub.step, " on rank ", options_.rank,
          ": the group's registration has not completed; wait for RegisterGroup to return"));
    }
    if (sub.grad_dtypes.size() != g.spec.params.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest for group \"", sub.group_id, "\" step ", sub.step, " on rank ",
                       options_.rank, ": ", sub.grad_dtypes.size(),
                       " entries but the group registered ", g.spec.params.size(), " parameters"));
    }
    if (sub.step < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest for group \"", sub.group_id, "\": negative step ", sub.step));
    }
    if (sub.step <= g.last_step) {
      return absl::InvalidArgumentError(absl::StrCat(
          "manifest for group \"", sub.group_id, "\" step ", sub.step, " on rank ", options_.rank,
          ": steps must increase; this rank already submitted step ", g.last_step));
    }
    *group = &it->second;
    return absl::OkStatus();
  }

  // Sends a group's registration unless it was sent before (with the same
  // spec and policy).
  absl::Status SendRegistrationLocked(const GroupSpec& spec, const Policy& policy)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = groups_.find(spec.group_id);
    if (it != groups_.end()) {
      if (!(it->second.spec == spec) || !SamePolicy(it->second.policy, policy)) {
        return absl::AlreadyExistsError(absl::StrCat(
            "group \"", spec.group_id, "\" was already registered by rank ", options_.rank,
            " with a different spec or policy; register each group once per job"));
      }
      return absl::OkStatus();
    }
    GroupState& g = groups_[spec.group_id];
    group_order_.push_back(spec.group_id);
    g.spec = spec;
    g.policy = policy;
    g.spec_fingerprint = SpecFingerprint(spec);
    v1::RankMessage msg;
    *msg.mutable_registration() = wire::GroupSpecToProto(spec, policy);
    EnqueueLocked(std::move(msg));
    return absl::OkStatus();
  }

  // Waits for a sent registration's result. The group is looked up by id at
  // each check: groups_ may rehash while the lock is released.
  absl::Status AwaitRegistrationLocked(const GroupSpec& spec, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto state = [this, &spec]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return groups_.find(spec.group_id)->second.reg;
    };
    auto done = [this, &state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return state() != RegState::kPending || closed_ || !fatal_.ok();
    };
    mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
    const GroupState& g = groups_.find(spec.group_id)->second;
    if (g.reg == RegState::kOk) return absl::OkStatus();
    if (g.reg == RegState::kFailed) return g.reg_status;
    if (absl::Status s = ClosedStatus(); !s.ok()) return s;
    return absl::DeadlineExceededError(
        absl::StrCat("no registration result for group \"", spec.group_id, "\" (job \"",
                     options_.job_id, "\", rank ", options_.rank,
                     ") before the caller's deadline; the coordinator answers once every "
                     "rank registered the group, and names the ranks that did not once its own "
                     "--deadline passes after the group's first registration: check that all "
                     "ranks register it"));
  }

  void EnqueueLocked(v1::RankMessage msg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    outbox_.push_back(std::move(msg));
  }

  // Whether the caller may write its message itself: the stream is up, no
  // write is in flight and nothing queued would be overtaken.
  bool CanWriteDirectlyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return welcomed_ && !writing_ && outbox_.empty() && !read_ended_ && !stopping_;
  }

  // Keeps a written batch's manifests for the next SubmitBatch.
  void RecycleBatchLocked(v1::RankMessage* msg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!msg->has_manifests() || spare_batches_.size() >= kMaxSpareBatches) return;
    std::unique_ptr<v1::ManifestBatch> batch(msg->release_manifests());
    batch->Clear();
    spare_batches_.push_back(std::move(batch));
  }

  void WriterLoop() {
    accord::MutexLock lock(&mu_);
    while (true) {
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return (!outbox_.empty() && !writing_) || read_ended_ || stopping_;
      };
      mu_.Await(absl::Condition(&ready));
      if (read_ended_ || stopping_) break;
      v1::RankMessage msg = std::move(outbox_.front());
      outbox_.pop_front();
      writing_ = true;
      mu_.Unlock();
      const bool ok = stream_->Write(msg);
      mu_.Lock();
      writing_ = false;
      if (!ok) break;  // the reader sees the stream end
      RecycleBatchLocked(&msg);
    }
    writer_done_ = true;
  }

  // The hello of a new stream; a resume says what this rank holds.
  v1::RankMessage HelloLocked(bool resume) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    v1::RankMessage hello;
    v1::RankHello* h = hello.mutable_hello();
    h->set_job_id(options_.job_id);
    h->set_rank(options_.rank);
    h->set_world_size(options_.world_size);
    h->set_local_rank(options_.local_rank);
    h->set_token(options_.token);
    h->set_client_version(kClientVersion);
    h->set_reconnects(options_.reconnect_grace > absl::ZeroDuration());
    h->set_launch_id(options_.launch_id);
    if (resume) {
      v1::RankResume* r = h->mutable_resume();
      r->set_run_id(run_id_);
      r->set_node_epoch(node_epoch_);
      r->set_holds_local_decisions(holds_local_decisions_);
      for (const std::string& id : group_order_) {
        v1::GroupResume* gr = r->add_groups();
        gr->set_group_id(id);
        gr->set_decided_step(groups_.find(id)->second.decided_step);
      }
    }
    return hello;
  }

  // A new stream on a new channel (a fresh channel has no connection
  // backoff left from the previous sidecar process).
  void OpenStreamLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    session_channel_ = SessionChannel(target_);
    stub_ = v1::RankService::NewStub(session_channel_);
    ctx_ = std::make_unique<grpc::ClientContext>();
    // The hello goes with the first write, on the writer's thread: creating
    // the stream then never waits for a connection (gRPC waits up to 20 s for
    // a sidecar that accepts but does not answer, a stopped one), so neither
    // the connect timeout nor this lock depends on gRPC's.
    ctx_->set_initial_metadata_corked(true);
    if (stopping_) ctx_->TryCancel();
    stream_ = stub_->Session(ctx_.get());
    read_ended_ = false;
    writer_done_ = false;
    welcomed_ = false;
  }

  // What a resumed stream sends first: the resume hello, every registration
  // and every manifest still without a decision (full form, ascending step).
  void QueueResumeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    outbox_.clear();
    outbox_.push_back(HelloLocked(/*resume=*/true));
    struct Resend {
      int64_t step;
      size_t order;
      const std::string* group_id;
      const Pending* pending;
    };
    std::vector<Resend> resend;
    for (size_t i = 0; i < group_order_.size(); ++i) {
      GroupState& g = groups_.find(group_order_[i])->second;
      if (g.reg == RegState::kFailed) continue;
      v1::RankMessage reg;
      *reg.mutable_registration() = wire::GroupSpecToProto(g.spec, g.policy);
      outbox_.push_back(std::move(reg));
      // The new sidecar knows no previous content: repeats start again.
      g.last_key.reset();
      for (const Pending& p : g.pending) resend.push_back(Resend{p.step, i, &group_order_[i], &p});
    }
    if (adapter_counts_.has_value()) outbox_.push_back(AdapterCountsMessage(*adapter_counts_));
    if (resend.empty()) return;
    std::sort(resend.begin(), resend.end(), [](const Resend& a, const Resend& b) {
      return a.step != b.step ? a.step < b.step : a.order < b.order;
    });
    v1::RankMessage batch;
    Manifest m;
    m.ranks = RankSet(options_.world_size);
    m.ranks.Add(options_.rank);
    for (const Resend& r : resend) {
      m.step = r.step;
      m.dtypes = *r.pending->content;
      wire::ManifestToProto(*r.group_id, m, /*with_ranks=*/false,
                            batch.mutable_manifests()->add_manifests());
    }
    outbox_.push_back(std::move(batch));
  }

  // Runs streams until the session is over: reads each one's replies, then
  // reconnects (NextStreamLocked) or fails every call.
  void SessionLoop() {
    while (true) {
      std::thread writer([this] { WriterLoop(); });
      v1::RankReply reply;
      while (stream_->Read(&reply)) HandleReply(reply);
      {
        accord::MutexLock lock(&mu_);
        read_ended_ = true;
        // Finish must not overlap a write: the writer's or a caller's.
        auto writes_over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return writer_done_ && !writing_;
        };
        mu_.Await(absl::Condition(&writes_over));
      }
      writer.join();
      const grpc::Status s = stream_->Finish();
      accord::MutexLock lock(&mu_);
      if (!NextStreamLocked(s)) return;
    }
  }

  // Before the first welcome, a stream that could not reach the sidecar
  // (none yet at the socket, or one restarting) is tried again with backoff
  // until the connect timeout: a sidecar may start after its ranks. Any
  // other end closes the session.
  template <typename Close>
  bool FirstStreamEndedLocked(const grpc::Status& s, Close& close)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto unreachable = [&] {
      return absl::UnavailableError(absl::StrCat(
          "cannot reach the sidecar at ", options_.socket_path, " (job \"", options_.job_id,
          "\", rank ", options_.rank, ") within ", absl::FormatDuration(options_.connect_timeout),
          " (the connect timeout): ", s.error_message(),
          "; check that accord-sidecar runs on this node with --socket=", options_.socket_path));
    };
    if (!fatal_.ok()) return close(fatal_);
    if (stopping_) return close(absl::CancelledError("the client is shutting down"));
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE) return close(unreachable());
    if (!first_miss_logged_) {
      first_miss_logged_ = true;
      ACCORD_LOG(INFO) << "rank " << options_.rank << ": no sidecar answers at "
                       << options_.socket_path << " yet (" << s.error_message()
                       << "); trying again until the connect timeout";
    }
    const absl::Duration wait = NextBackoffLocked();
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
    if (absl::Now() + wait >= connect_deadline_ ||
        mu_.AwaitWithTimeout(absl::Condition(&stop), wait)) {
      return close(stopping_ ? absl::CancelledError("the client is shutting down") : unreachable());
    }
    OpenStreamLocked();
    outbox_.clear();
    outbox_.push_back(HelloLocked(/*resume=*/false));
    return true;
  }

  // The next reconnect wait: equal jitter (ranks that lost the same sidecar
  // spread their attempts) over a nominal backoff that doubles up to a cap.
  absl::Duration NextBackoffLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Duration wait =
        backoff_ / 2 + std::uniform_real_distribution<double>(0, 1)(rng_) * (backoff_ / 2);
    backoff_ = std::min(backoff_ * 2, kMaxBackoff);
    return wait;
  }

  // After a stream ended with `s`: opens the next one (true), or closes the
  // session and fails every call (false).
  bool NextStreamLocked(const grpc::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const bool was_welcomed = welcomed_;
    welcomed_ = false;
    const std::string detail = s.ok() ? std::string() : absl::StrCat(": ", s.error_message());
    auto close = [&](absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      closed_status_ = std::move(why);
      closed_ = true;
      FailAllLocked(fatal_.ok() ? closed_status_ : fatal_);
      return false;
    };
    if (!ever_welcomed_) return FirstStreamEndedLocked(s, close);
    if (!fatal_.ok()) return close(fatal_);
    if (stopping_) return close(absl::CancelledError("the client is shutting down"));
    if (options_.reconnect_grace <= absl::ZeroDuration()) {
      return close(absl::UnavailableError(absl::StrCat(
          "sidecar at ", options_.socket_path, " closed the connection (job \"", options_.job_id,
          "\", rank ", options_.rank, ")", detail,
          "; this client does not reconnect (ClientOptions.reconnect_grace is 0), so this "
          "rank's session is over: restart the job")));
    }
    const absl::Time now = absl::Now();
    if (was_welcomed || !lost_at_.has_value()) {
      lost_at_ = now;
      last_try_ = false;
      backoff_ = kFirstBackoff;
      ACCORD_LOG(WARNING) << "rank " << options_.rank << ": the stream to the sidecar at "
                          << options_.socket_path << " ended" << detail
                          << "; reconnecting for up to "
                          << absl::FormatDuration(options_.reconnect_grace);
    }
    const absl::Time give_up = *lost_at_ + options_.reconnect_grace;
    const absl::Duration wait = NextBackoffLocked();
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
    mu_.AwaitWithDeadline(absl::Condition(&stop), std::min(give_up, absl::Now() + wait));
    if (stopping_) return close(absl::CancelledError("the client is shutting down"));
    // The sidecar is judged gone only by an attempt that finds it gone once
    // the grace is over: a rank that was itself stopped past the grace (its
    // sidecar came back meanwhile) tries before it judges (chaos seed 7005).
    if (absl::Now() >= give_up && last_try_) {
      // The same text on every rank of the node (no rank in it).
      return close(absl::UnavailableError(absl::StrCat(
          "job ", options_.job_id, ": the sidecar of node \"", node_id_, "\" at ",
          options_.socket_path, " closed its ranks' connections and did not come back within ",
          absl::FormatDuration(options_.reconnect_grace),
          " (the client's reconnect grace, ClientOptions.reconnect_grace), so this node's ranks "
          "cannot take part: check accord-sidecar on this node (its log, --socket=",
          options_.socket_path, ") and restart the job")));
    }
    last_try_ = absl::Now() >= give_up;
    OpenStreamLocked();
    QueueResumeLocked();
    return true;
  }

  void HandleReply(const v1::RankReply& reply) {
    accord::MutexLock lock(&mu_);
    switch (reply.body_case()) {
      case v1::RankReply::kWelcome:
        welcomed_ = true;
        ever_welcomed_ = true;
        node_id_ = reply.welcome().node_id();
        if (!reply.welcome().run_id().empty()) run_id_ = reply.welcome().run_id();
        if (reply.welcome().node_epoch() != 0) node_epoch_ = reply.welcome().node_epoch();
        if (lost_at_.has_value()) {
          ACCORD_LOG(INFO) << "rank " << options_.rank << ": resumed with the sidecar at "
                           << options_.socket_path << " after "
                           << absl::FormatDuration(absl::Now() - *lost_at_);
          lost_at_.reset();
        }
        break;
      case v1::RankReply::kRegistration:
        HandleRegistrationLocked(reply.registration());
        break;
      case v1::RankReply::kDecisions: {
        // Every future of the reply completes under one lock of the hub.
        accord::MutexLock hub_lock(&hub_->mu);
        for (const v1::Decision& d : reply.decisions().decisions()) HandleDecisionLocked(d);
        break;
      }
      case v1::RankReply::kError:
        HandleErrorLocked(reply.error());
        break;
      case v1::RankReply::BODY_NOT_SET:
        ACCORD_LOG(WARNING) << "empty reply from the sidecar at " << options_.socket_path
                            << "; ignored";
        break;
    }
  }

  void HandleRegistrationLocked(const v1::RegistrationResult& r)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = groups_.find(r.group_id());
    // A group registered again on a resumed stream is answered again.
    if (it != groups_.end() && it->second.reg == RegState::kOk) return;
    if (it == groups_.end() || it->second.reg != RegState::kPending) {
      ACCORD_LOG(WARNING) << "unexpected registration result for group \"" << r.group_id()
                          << "\" on rank " << options_.rank << "; ignored";
      return;
    }
    GroupState& g = it->second;
    if (r.has_error() &&
        (r.error().kind() != v1::ERROR_KIND_UNSPECIFIED || r.error().code() != 0)) {
      g.reg = RegState::kFailed;
      g.reg_status = wire::ErrorToStatus(r.error());
    } else if (r.spec_fingerprint() != 0 && r.spec_fingerprint() != g.spec_fingerprint) {
      g.reg = RegState::kFailed;
      g.reg_status = absl::FailedPreconditionError(absl::StrCat(
          "group \"", r.group_id(), "\": the coordinator's spec fingerprint ",
          absl::Hex(r.spec_fingerprint()), " differs from rank ", options_.rank, "'s ",
          absl::Hex(g.spec_fingerprint), "; check that every rank registers the same parameters"));
    } else {
      g.reg = RegState::kOk;
    }
  }

  void HandleDecisionLocked(const v1::Decision& d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, hub_->mu) {
    auto it = groups_.find(d.group_id());
    if (it == groups_.end()) {
      ACCORD_LOG(WARNING) << "decision for unknown group \"" << d.group_id() << "\" step "
                          << d.step() << " on rank " << options_.rank << "; ignored";
      return;
    }
    GroupState& g = it->second;
    // A decision this rank already holds, sent again after it resumed.
    if (d.step() <= g.decided_step) return;
    if (d.local()) holds_local_decisions_ = true;
    absl::StatusOr<Decision> result = DecodeDecision(g, d);
    if (result.ok()) {
      if (d.same_as_previous()) {
        g.last_decision->step = result->step;  // the same content
      } else {
        g.last_decision = *result;
      }
    }
    auto p = FindPending(g, d.step());
    if (p == g.pending.end()) {
      ACCORD_LOG(WARNING) << "decision for group \"" << d.group_id() << "\" step " << d.step()
                          << " that rank " << options_.rank << " is not waiting for; ignored";
      return;
    }
    p->state->CompleteLocked(std::move(result));
    g.decided_step = std::max(g.decided_step, d.step());
    g.pending.erase(p);
  }

  absl::StatusOr<Decision> DecodeDecision(const GroupState& g, const v1::Decision& d) const {
    const auto where = [&] {
      return absl::StrCat("decision for group \"", d.group_id(), "\" step ", d.step(), " (job \"",
                          options_.job_id, "\", rank ", options_.rank, ")");
    };
    if (d.has_error()) return wire::ErrorToStatus(d.error());
    if (d.same_as_previous()) {
      if (!g.last_decision.has_value()) {
        return absl::InternalError(absl::StrCat(
            where(),
            " says 'same as previous' but this rank has no previous decision for the "
            "group; check that the sidecar and coordinator versions match the client"));
      }
      Decision out = *g.last_decision;
      out.step = d.step();
      return out;
    }
    if (!d.has_ok()) {
      return absl::InternalError(absl::StrCat(where(), " carries neither a result nor an error"));
    }
    absl::StatusOr<Decision> dec = wire::DecisionFromProto(d.step(), d.ok(), g.spec.params.size());
    if (!dec.ok()) {
      return absl::InternalError(absl::StrCat("malformed ", where(), ": ", dec.status().message()));
    }
    int n = 0;
    for (bool b : dec->included) n += b ? 1 : 0;
    if (d.ok().num_included() != n) {
      return absl::InternalError(absl::StrCat("malformed ", where(), ": num_included ",
                                              d.ok().num_included(), " but ", n,
                                              " bits are set in included_bits"));
    }
    const uint64_t local =
        LayoutFingerprint(g.spec, options_.world_size, dec->included, dec->wire_dtype);
    if (local != dec->layout_fingerprint) {
      return absl::InternalError(absl::StrCat(
          where(), ": layout fingerprint ", absl::Hex(dec->layout_fingerprint),
          " differs from the one this rank computes (", absl::Hex(local),
          ") for the registered spec; check that every rank runs the same accord version and "
          "registered the same world size"));
    }
    return dec;
  }

  void HandleErrorLocked(const v1::DecisionError& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::Status s = wire::ErrorToStatus(e);
    if (s.ok()) s = absl::UnknownError("the sidecar sent an error without a code");
    // An error about one group (and step) completes only what it names.
    if (!e.group_id().empty()) {
      auto it = groups_.find(e.group_id());
      if (it != groups_.end()) {
        GroupState& g = it->second;
        auto p = FindPending(g, e.step());
        if (p != g.pending.end()) {
          p->state->Complete(s);
          g.decided_step = std::max(g.decided_step, e.step());
          g.pending.erase(p);
          return;
        }
        if (g.reg == RegState::kPending) {
          g.reg = RegState::kFailed;
          g.reg_status = s;
          return;
        }
      }
    }
    if (lost_at_.has_value() && e.kind() == v1::DUPLICATE_RANK) {
      // The sidecar has not yet seen this rank's previous stream end: the
      // next attempt of the resume goes through.
      ACCORD_LOG(INFO) << "rank " << options_.rank << ": " << s << "; trying again";
      return;
    }
    ACCORD_LOG(ERROR) << "rank " << options_.rank << ": " << s;
    fatal_ = s;
    FailAllLocked(s);
  }

  void FailAllLocked(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto& [id, g] : groups_) {
      for (Pending& p : g.pending) p.state->Complete(s);
      g.pending.clear();
      if (g.reg == RegState::kPending) {
        g.reg = RegState::kFailed;
        g.reg_status = s;
      }
    }
  }

  static constexpr absl::Duration kFirstBackoff = absl::Milliseconds(50);
  static constexpr absl::Duration kMaxBackoff = absl::Seconds(1);

  const ClientOptions options_;
  const std::string target_;
  std::shared_ptr<grpc::Channel> channel_;  // key-value calls
  std::unique_ptr<KeyValueStore> kv_;
  mutable accord::Mutex mu_;
  // The session stream, its channel, stub and context: replaced (under mu_)
  // only by the session thread, between streams, when neither the writer nor
  // a caller writes. Read is used by the session thread, Write by the writer
  // or a caller (one at a time, `writing_`), Finish by the session thread once
  // both are done.
  std::shared_ptr<grpc::Channel> session_channel_;
  std::unique_ptr<v1::RankService::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::RankMessage, v1::RankReply>> stream_;

  std::deque<v1::RankMessage> outbox_ ABSL_GUARDED_BY(mu_);
  bool welcomed_ ABSL_GUARDED_BY(mu_) = false;  // the current stream was welcomed
  bool ever_welcomed_ ABSL_GUARDED_BY(mu_) = false;
  // Until then a stream that cannot reach the sidecar is tried again.
  absl::Time connect_deadline_ ABSL_GUARDED_BY(mu_);
  bool first_miss_logged_ ABSL_GUARDED_BY(mu_) = false;
  std::string node_id_ ABSL_GUARDED_BY(mu_);
  std::string run_id_ ABSL_GUARDED_BY(mu_);       // Welcome.run_id: named by a resume
  uint64_t node_epoch_ ABSL_GUARDED_BY(mu_) = 0;  // Welcome.node_epoch: given back by a resume
  // While reconnecting: whether the attempt under way began past the grace
  // (the last one).
  bool last_try_ ABSL_GUARDED_BY(mu_) = false;
  // Set while reconnecting: when the last welcomed stream ended.
  std::optional<absl::Time> lost_at_ ABSL_GUARDED_BY(mu_);
  absl::Duration backoff_ ABSL_GUARDED_BY(mu_) = kFirstBackoff;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  // A decision made by the sidecar alone was received (Decision.local).
  bool holds_local_decisions_ ABSL_GUARDED_BY(mu_) = false;
  // The totals of AddAdapterCounts, sent again on a resumed stream.
  std::optional<AdapterCounts> adapter_counts_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool read_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool writer_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a Write is in flight (writer or caller)
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status closed_status_ ABSL_GUARDED_BY(mu_);
  absl::Status fatal_ ABSL_GUARDED_BY(mu_);  // a session/job-wide error from the sidecar
  absl::flat_hash_map<std::string, GroupState> groups_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> group_order_ ABSL_GUARDED_BY(mu_);  // registration order
  const std::shared_ptr<FutureHub> hub_ = std::make_shared<FutureHub>();
  static constexpr size_t kMaxSpareBatches = 4;
  std::vector<std::unique_ptr<v1::ManifestBatch>> spare_batches_ ABSL_GUARDED_BY(mu_);
  // This rank's manifest, reused by SubmitBatch (rank set built once).
  Manifest scratch_ ABSL_GUARDED_BY(mu_);

  std::thread session_;
};

absl::Status ValidateOptions(const ClientOptions& o) {
  if (o.socket_path.empty()) {
    return absl::InvalidArgumentError(
        "ClientOptions.socket_path is empty; pass the sidecar's "
        "Unix socket path");
  }
  if (o.job_id.empty()) return absl::InvalidArgumentError("ClientOptions.job_id is empty");
  if (o.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.world_size is ", o.world_size, "; it must be at least 1"));
  }
  if (o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.rank ", o.rank, " is outside 0..", o.world_size - 1));
  }
  if (o.local_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.local_rank ", o.local_rank, " is negative"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string LaunchIdFromEnvironment() {
  if (const char* id = std::getenv("ACCORD_LAUNCH_ID"); id != nullptr && *id != '\0') return id;
  // torchrun gives every worker of one start the same run id and restart
  // count; a restart counts up. Its run id is "none" unless --rdzv-id set
  // one (or --standalone drew one): the same for every launch, so no id.
  const char* run = std::getenv("TORCHELASTIC_RUN_ID");
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (run == nullptr || *run == '\0' || std::string_view(run) == "none" || restart == nullptr) {
    return "";
  }
  return absl::StrCat("torchrun:", run, ":", restart);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  ClientOptions resolved = options;
  if (resolved.launch_id.empty()) resolved.launch_id = LaunchIdFromEnvironment();
  auto client = std::make_unique<GrpcClient>(resolved);
  if (absl::Status s = client->Start(); !s.ok()) return s;
  return std::unique_ptr<Client>(std::move(client));
}

}  // namespace accord
