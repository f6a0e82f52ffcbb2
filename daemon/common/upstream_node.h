// The node side of the upstream node protocol (docs/ARCHITECTURE.md, "The
// protocol on one page", sidecar -> coordinator), as both speakers of it use
// it: the sidecar towards the coordinator or a relay, and the relay towards
// the coordinator (or a relay above it). One class, so that the two cannot
// disagree on what a reconnect resends or when a batch repeat may go.
//
// UpstreamNode holds what the protocol asks the node to keep across its
// stream's reconnects: the job it speaks for (job id, world size, token, the
// run id and the node epoch; see "Runs"), the ranks it announced, whether
// the hello went on the current stream, the Welcome's flags, and the
// stream's previous ManifestBatch, which a batch repeat stands for
// (wire::StreamBatchRecord). Per group, its owner keeps the distinct
// registrations (GroupRegistrations), the manifests sent and not yet decided
// (InflightManifests) and whether the stream holds the group's previous
// manifest (RepeatFormOf); Connected() takes what they resend.
//
// Not thread-safe: its owner (Sidecar, Relay) calls it with its own lock
// held. The UpstreamSink is not owned.
#ifndef ACCORD_DAEMON_COMMON_UPSTREAM_NODE_H_
#define ACCORD_DAEMON_COMMON_UPSTREAM_NODE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "accord/v1/accord.pb.h"
#include "core/members.h"
#include "core/rank_set.h"
#include "daemon/common/upstream.h"
#include "proto/wire.h"

namespace accord::daemon {

// One group's registrations as the node forwarded them: one per distinct
// spec, in order of first arrival, each with the ranks that sent it. A
// reconnect resends one NodeRegistration per spec (the coordinator compares
// specs per rank), not one per registering rank or sidecar.
class GroupRegistrations {
 public:
  void Add(const v1::GroupRegistration& registration, const std::vector<int>& ranks);
  // Distinct specs so far, and the first one.
  size_t size() const { return variants_.size(); }
  const v1::GroupRegistration& first() const { return variants_.front().registration; }
  // Appends one NodeRegistration per spec with those of its ranks for which
  // `live(rank)` holds; a spec with none is left out.
  template <typename Live>
  void AppendResend(const Live& live, std::vector<v1::NodeMessage>* out) const {
    for (const Variant& v : variants_) {
      v1::NodeMessage m;
      for (int r : v.ranks) {
        if (live(r)) m.mutable_registration()->add_ranks(r);
      }
      if (!m.has_registration()) continue;
      *m.mutable_registration()->mutable_registration() = v.registration;
      out->push_back(std::move(m));
    }
  }

 private:
  struct Variant {
    v1::GroupRegistration registration;
    std::string bytes;  // registration, serialized (what tells specs apart)
    std::set<int> ranks;
  };
  std::vector<Variant> variants_;
};

class UpstreamNode;

// One group's manifests sent upstream and not yet decided, in full form, so
// that a new stream (or a receiver that cannot resolve a repeat) gets them
// again. Several may share a step (a relay's late contribution goes up
// alone). Those of the group's last decided step are kept too: a new stream
// gets them again flagged `decided`, for a coordinator that lost the run's
// state while some other node's copy of that decision was lost with its
// stream (docs/ARCHITECTURE.md, "Decisions across a coordinator restart").
class InflightManifests {
 public:
  // `full`: the manifest in full form, its step cleared (shared with the
  // owner's last full form); `announced`: how many ranks the node had
  // announced when it was built (UpstreamNode::announced), which is what a
  // manifest without rank_bits stands for; `decided`: it only speaks for
  // nodes that hold the step's decision (a relay's merge of flagged parts),
  // so every resend keeps `Manifest.decided`.
  void Add(int64_t step, std::shared_ptr<const v1::Manifest> full, size_t announced,
           bool decided = false);
  // `step` was decided: forgets every manifest of an earlier step, and keeps
  // those of `step` as the last decided step's (an older step answered again
  // changes nothing).
  void DropUpTo(int64_t step);
  // Appends those of `step`, with their step set, as they read on `node`'s
  // stream now: one without rank_bits built when fewer ranks were announced
  // gets the bits of those ranks among the group's `members` (null: every
  // rank; docs/ARCHITECTURE.md, "Whose ranks a manifest covers"). Whether
  // there was one.
  bool AppendStep(int64_t step, const UpstreamNode& node, const MemberSet* members,
                  v1::ManifestBatch* out) const;
  // Appends the last decided step's, flagged `decided`, then every undecided
  // one (AppendStep's form; ascending step).
  void AppendAll(const UpstreamNode& node, const MemberSet* members, v1::ManifestBatch* out) const;
  int64_t decided_step() const { return decided_step_; }
  // How many are of a step before `step`.
  size_t CountBefore(int64_t step) const;

 private:
  struct Entry {
    int64_t step = 0;
    std::shared_ptr<const v1::Manifest> full;
    size_t announced = 0;
    bool decided = false;
  };
  static void AppendEntry(const Entry& e, const UpstreamNode& node, const MemberSet* members,
                          v1::ManifestBatch* out);
  std::vector<Entry> entries_;  // ascending step, arrival order within one
  int64_t decided_step_ = -1;   // the last decided step, and its manifests
  std::vector<Entry> decided_;
};

// One rank whose used parameters differ from its node's merged usage, as
// v1::RankUsage carries it: bit i of `used_bits` is set when parameter i has
// a gradient.
struct RankUsageBits {
  int rank = 0;
  std::string used_bits;
  bool operator==(const RankUsageBits&) const = default;
};
// A node manifest's per-rank detail: the ranks whose usage differs, ascending.
using UsageDetail = std::vector<RankUsageBits>;

// What besides the cache key tells two node manifests apart (the key covers
// dtypes and ranks only): the ranks named (rank_bits, empty when the hello's
// ranks) and the per-rank detail.
struct ManifestShape {
  std::string rank_bits;
  UsageDetail detail;
  bool operator==(const ManifestShape&) const = default;
};

// Whether the stream holds a group's previous manifest, so that the next one
// with the same content may go in repeat form (cache key only). `Shape` is
// what besides the key tells two manifests apart (rank bits, rank detail).
template <typename Shape>
class RepeatFormOf {
 public:
  // Whether a manifest with `key` and `shape` may go in repeat form.
  bool Repeats(uint64_t key, const Shape& shape) const {
    return held_ && key == key_ && shape == shape_;
  }
  // A manifest went, in either form: the stream's previous one now.
  void Sent(uint64_t key, const Shape& shape) {
    held_ = true;
    key_ = key;
    if (!(shape == shape_)) shape_ = shape;
  }
  // The stream does not hold it (a new stream; a repeat it could not resolve).
  void Forget() { held_ = false; }
  bool held() const { return held_; }
  uint64_t key() const { return key_; }

 private:
  bool held_ = false;
  uint64_t key_ = 0;
  Shape shape_{};
};

// NodeProgress{partial} (docs/ARCHITECTURE.md, "Silent ranks"): some of the
// node's ranks (`reported`) submitted (group, step) `waited` ago, and the
// others did not.
v1::NodeMessage PartialReport(absl::string_view group_id, int64_t step, absl::Duration waited,
                              const std::vector<int>& reported);

class UpstreamNode {
 public:
  explicit UpstreamNode(std::string node_id) : node_id_(std::move(node_id)) {}

  void SetSink(UpstreamSink* sink) { sink_ = sink; }
  UpstreamSink* sink() const { return sink_; }
  // Sends a message as is (dropped while the stream is down).
  void Send(v1::NodeMessage message);

  // The job: none until StartJob; EndJob forgets it with the stream's
  // batch record and Welcome flags.
  bool has_job() const { return !job_.job_id.empty(); }
  const std::string& node_id() const { return node_id_; }
  const std::string& job_id() const { return job_.job_id; }
  const std::string& run_id() const { return job_.run_id; }
  const std::string& token() const { return job_.token; }
  int world_size() const { return job_.world_size; }
  uint64_t epoch() const { return job_.epoch; }
  // Starts speaking for a job; `resume_run_id`: the run to rejoin (RESUME),
  // "" for a new one; `resume_epoch`: the node epoch of the incarnation its
  // resuming ranks belong to (0: a fresh one is drawn).
  void StartJob(absl::string_view job_id, int world_size, absl::string_view token,
                absl::string_view resume_run_id = "", uint64_t resume_epoch = 0);
  void EndJob();

  // Announces ranks: the hello (every announced rank) when none went on this
  // stream yet, else a RankEvent join per rank not announced before or
  // announced and left since.
  void AnnounceRanks(const std::vector<int>& ranks);
  // Reports a rank's leave (RankEvent, with `cause` when not empty). The
  // rank stays announced (below).
  void LeaveRank(int rank, int64_t last_step, const std::string& cause = "");
  // Forwards a RankEvent as is, announcing its rank or marking it left.
  void ForwardRankEvent(const v1::RankEvent& event);
  // The ranks the receiving end attributes to this node on the current
  // stream: the hello's and every join since. A leave does not take a rank
  // out, at either end: the coordinator and a relay keep a rank that left as
  // the node's, marked left. So a manifest without rank_bits, which stands
  // for "every rank of the node", means this one set at both ends
  // (docs/ARCHITECTURE.md, "Whose ranks a manifest covers"). A new stream's
  // hello lists every announced rank, left or not: a receiver that saw the
  // leave keeps it marked; announcing the rank again sends a join.
  const std::set<int>& announced() const { return announced_; }
  // Whether `ranks` is exactly the announced set: a manifest of these ranks
  // may leave its rank_bits out.
  bool IsAnnounced(const RankSet& ranks) const { return ranks == announced_set_; }
  // The same for a group of `members` (null: every rank): a manifest of the
  // group without rank_bits stands for the announced ranks among its
  // members (docs/MEMBERS.md 2.5), at both ends.
  bool IsAnnounced(const RankSet& ranks, const MemberSet* members) const;
  // The same for ranks given ascending.
  bool IsAnnounced(const std::vector<int>& ascending, const MemberSet* members) const;
  // The first `n` ranks announced, in announce order (the announced set
  // only grows while a job is served, so a count names a set of the past),
  // and those of them among `members` (null: every rank).
  RankSet FirstAnnounced(size_t n) const;
  RankSet FirstAnnounced(size_t n, const MemberSet* members) const;

  // A new stream is up: queues (UpstreamSink::Reset) the hello,
  // `registrations` and `inflight` (one batch, also the stream's previous
  // batch) when there is a job, else nothing. No batch repeat until the
  // stream's Welcome offers them.
  void Connected(std::vector<v1::NodeMessage> registrations, v1::ManifestBatch inflight);
  // The stream's Welcome: its flags, and its run id (when there is a job).
  void OnWelcome(const v1::Welcome& welcome);
  bool welcomed() const { return stream_.welcomed; }
  bool batch_repeat() const { return stream_.batch_repeat; }
  // Whether the node above takes groups with members (Welcome.members of
  // its last Welcome; kept across reconnects); nullopt before the job's
  // first Welcome.
  std::optional<bool> takes_members() const { return stream_.members; }
  int64_t deadline_ms() const { return stream_.deadline_ms; }

  // Sends a manifest batch (none when empty): as one batch repeat record
  // when it is the stream's previous batch again and the Welcome offered
  // them (returns true), else as is, recorded as the previous batch.
  bool SendBatch(v1::ManifestBatch batch);
  // For a caller that compares before it builds a batch: the previous batch,
  // the record "step `step` repeats it", and a batch known not to repeat it.
  const wire::StreamBatchRecord& previous_batch() const { return stream_.previous; }
  void SendBatchRepeat(int64_t step);
  void SendNewBatch(v1::NodeMessage batch);

 private:
  // The current stream's hello (recorded as sent), which attributes the
  // announced ranks to the node.
  v1::NodeMessage StartStreamHello();
  void Announce(int rank);

  struct Job {
    std::string job_id;
    int world_size = 0;
    std::string token;
    std::string run_id;  // from a resuming node or the Welcome; "" before
    uint64_t epoch = 0;  // drawn at StartJob
  };
  // What holds for the current stream only.
  struct Stream {
    bool hello_sent = false;
    bool welcomed = false;
    bool batch_repeat = false;
    int64_t deadline_ms = 0;      // the last Welcome's (kept across reconnects)
    std::optional<bool> members;  // the last Welcome's (kept across reconnects)
    wire::StreamBatchRecord previous;
  };

  const std::string node_id_;
  UpstreamSink* sink_ = nullptr;
  Job job_;
  Stream stream_;
  std::set<int> announced_;          // announced() (ascending)
  RankSet announced_set_;            // the same, as a set
  std::vector<int> announce_order_;  // the same, in announce order
  std::set<int> left_;               // announced ranks whose leave went up, not back since
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COMMON_UPSTREAM_NODE_H_
