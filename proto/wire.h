// Conversion between accord.v1 messages and core types. The only code that
// knows both; every message that came over a socket passes through here and
// is validated before core sees it.
#ifndef ACCORD_PROTO_WIRE_H_
#define ACCORD_PROTO_WIRE_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "accord/v1/accord.pb.h"
#include "core/decide.h"
#include "core/group.h"
#include "core/hash.h"
#include "core/manifest.h"
#include "core/members.h"

namespace accord::wire {

// Trailing metadata on a key-value call's UNAVAILABLE that a daemon answered
// because the coordinator above it is lost (--upstream_loss_limit): an
// answer, final, never sent again by a forwarder below or by the client
// (docs/RELIABILITY.md, "Node above lost").
inline constexpr char kLostAboveMetadataKey[] = "accord-lost-above";
// Trailing metadata on a key-value call's error whose words are the job's
// verdict, the same for every rank that gets it: the run failed or ended, or
// a wait reached the coordinator's --deadline. Forwarders pass it on, and the
// client reports the words as they are, without its own prefix (its key, its
// sidecar's socket), so every rank of a run ends with one text
// (docs/RELIABILITY.md, "Chaos"). A call refused for kLostAboveMetadataKey is
// one too.
inline constexpr char kJobVerdictMetadataKey[] = "accord-job-verdict";

// Bitsets: bit i is bit (i % 8) of byte (i / 8).
std::string PackBits(const std::vector<bool>& bits);
// INVALID_ARGUMENT (naming `what`) when the length is not ceil(n/8) bytes or
// bits past n are set.
absl::StatusOr<std::vector<bool>> UnpackBits(const std::string& bytes, size_t n,
                                             absl::string_view what);
std::string RankSetToBits(const RankSet& ranks);
absl::StatusOr<RankSet> RankSetFromBits(const std::string& bytes, int world_size,
                                        absl::string_view what);

// DType numbers; non-float and unknown values give INVALID_ARGUMENT.
absl::StatusOr<DType> DTypeFromProto(v1::DType d);
v1::DType DTypeToProto(DType d);

absl::StatusOr<Policy> PolicyFromProto(const v1::ReducePolicy& p);
v1::ReducePolicy PolicyToProto(const Policy& p);

// A group's members in a job of `world_size` ranks, in the canonical form
// only (MemberSet::FromForm): INVALID_ARGUMENT with kind INVALID_REQUEST
// naming the problem for a list that is arithmetic, a set of every rank
// (sent as no members), an unsorted list, a duplicate, a rank out of range.
absl::StatusOr<std::shared_ptr<const MemberSet>> MembersFromProto(const v1::Members& m,
                                                                  int world_size);
// The form as sent, not validated (MemberSet::FromForm validates it against
// a world size, for a receiver that learns the world size later).
MembersForm MembersFormFromProto(const v1::Members& m);
v1::Members MembersToProto(const MemberSet& members);

// Validates (ValidateGroupSpec, MembersFromProto) while converting; the
// registration's members become GroupSpec::members (null when absent).
// Errors name the group.
absl::StatusOr<GroupSpec> GroupSpecFromProto(const v1::GroupRegistration& r, int world_size);
// The same for a receiver that does not take groups with members: a
// registration with members is INVALID_ARGUMENT with kind INVALID_REQUEST.
absl::StatusOr<GroupSpec> GroupSpecFromProto(const v1::GroupRegistration& r);
// Members are written when the spec has them and they are not every rank
// (the canonical form).
v1::GroupRegistration GroupSpecToProto(const GroupSpec& spec, const Policy& policy);

// Full-form manifest -> core. `world_size` sizes the rank set. When
// `sender_rank` >= 0 the message is a rank's own and must not carry
// rank_bits; the set is {sender_rank}. Otherwise rank_bits is required.
// Repeat-form messages are rejected here: the caller resolves them from its
// cache first. Errors are INVALID_ARGUMENT naming group, step and field.
absl::StatusOr<Manifest> ManifestFromProto(const v1::Manifest& m, size_t num_params, int world_size,
                                           int sender_rank);
// The dtypes of a full-form manifest: ManifestFromProto's checks and errors
// for step, used_bits and dtypes, without building a rank set. `out` is
// resized to num_params (its capacity is reused).
absl::Status ManifestDTypesFromProto(const v1::Manifest& m, size_t num_params,
                                     std::vector<DTypeMask>* out);
// The same into `out[0..num_params)`, which the caller sized.
absl::Status ManifestDTypesFromProto(const v1::Manifest& m, size_t num_params, DTypeMask* out);
// Core -> full-form message, compact (uniform_dtype) when possible. Includes
// rank_bits when `with_ranks`.
void ManifestToProto(absl::string_view group_id, const Manifest& m, bool with_ranks,
                     v1::Manifest* out);

// ManifestBatch.repeat_batch_key: a stable hash of a batch's (group_id,
// cache_key) pairs in order. Never 0 (0 means "not a batch repeat").
class BatchKeyHasher {
 public:
  void Add(absl::string_view group_id, uint64_t cache_key);
  uint64_t Finish() const;

 private:
  StableHasher hasher_;
};

// The previous manifest batch of a node stream, kept on both ends of it. The
// sender (a sidecar or a relay upstream) sends the same batch again in
// repeat form as one batch repeat record (ManifestBatch.repeat_step +
// repeat_batch_key); the receiver (a relay, for its sidecars) expands that
// record back (ExpandAt). The coordinator keeps the same record per stream
// (docs/ARCHITECTURE.md, "Repeat waves"), so each end must Record every
// manifest batch the stream carries, in order, and start a new stream from
// the batch resent on it (or none).
class StreamBatchRecord {
 public:
  void Record(const v1::ManifestBatch& batch);
  void Clear() { Record(v1::ManifestBatch()); }
  size_t size() const { return entries_.size(); }
  // Whether entry i names (group_id, cache_key).
  bool Matches(size_t i, absl::string_view group_id, uint64_t cache_key) const {
    return entries_[i].second == cache_key && entries_[i].first == group_id;
  }
  // Whether `batch` is the recorded batch again: every manifest in repeat
  // form at one step, the same groups and keys in the same order.
  bool RepeatedBy(const v1::ManifestBatch& batch) const;
  // The batch repeat record standing for the recorded batch at `step`
  // (only when size() > 0).
  v1::NodeMessage RepeatAt(int64_t step) const;
  // What a batch repeat at `step` stands for, on the receiving side: the
  // recorded entries in repeat form at `step`.
  v1::ManifestBatch ExpandAt(int64_t step) const;
  // BatchKeyHasher over the entries (0: nothing recorded).
  uint64_t key() const { return key_; }

 private:
  std::vector<std::pair<std::string, uint64_t>> entries_;
  uint64_t key_ = 0;
};

void DecisionToProto(const Decision& d, v1::DecisionOk* out);
// INVALID_ARGUMENT on a malformed decision (bitset length, dtype).
absl::StatusOr<Decision> DecisionFromProto(int64_t step, const v1::DecisionOk& ok,
                                           size_t num_params);

// Typed errors (docs/ARCHITECTURE.md, "Errors"). An absl::Status carries
// its ErrorKind as a payload, so callers branch on the kind, never on the
// message text.
inline constexpr char kErrorKindPayloadUrl[] = "type.accord.dev/accord.v1.ErrorKind";
// `status` with `kind` attached (unchanged for OK or ERROR_KIND_UNSPECIFIED).
absl::Status WithKind(absl::Status status, v1::ErrorKind kind);
// The kind `status` carries; ERROR_KIND_UNSPECIFIED when none.
v1::ErrorKind KindOf(const absl::Status& status);
// The one table from error kind to canonical code (kUnknown for
// ERROR_KIND_UNSPECIFIED and values this build does not know).
absl::StatusCode CodeOfKind(v1::ErrorKind kind);
// A status of `kind`, with the kind's code from CodeOfKind and `message`.
absl::Status KindError(v1::ErrorKind kind, absl::string_view message);

// Structured errors. MakeError takes the code and message of `status` (and
// its kind when `kind` is unspecified); ErrorToStatus keeps the message and
// the canonical code and attaches the kind.
v1::DecisionError MakeError(v1::ErrorKind kind, const absl::Status& status);
absl::Status ErrorToStatus(const v1::DecisionError& e);

}  // namespace accord::wire

#endif  // ACCORD_PROTO_WIRE_H_
