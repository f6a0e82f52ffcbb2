// A group's members: the ranks of the job that reduce it (docs/MEMBERS.md
// 2.1, 2.3). A null `const MemberSet*` (or shared_ptr) means every rank of
// the job.
#ifndef ACCORD_CORE_MEMBERS_H_
#define ACCORD_CORE_MEMBERS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/rank_set.h"

namespace accord {

// The canonical form a member set travels in (accord.v1.Members): the
// arithmetic form (count >= 1 ranks start, start + stride, ...) whenever the
// set is an arithmetic progression, which every set of one or two ranks is
// (one rank: stride 1); otherwise the list form (count == 0, start == 0,
// stride == 0, `ranks` strictly ascending). Equal sets have equal forms.
struct MembersForm {
  int start = 0;
  int count = 0;
  int stride = 0;
  std::vector<int> ranks;

  friend bool operator==(const MembersForm&, const MembersForm&) = default;
};

// A sorted, duplicate-free, non-empty list of ranks of a job of `world_size`
// ranks. Immutable; cheap to share as std::shared_ptr<const MemberSet>.
class MemberSet {
 public:
  // INVALID_ARGUMENT naming the problem when world_size < 1, the list is
  // empty, not ascending, has a duplicate or a rank outside
  // 0..world_size-1. A list of every rank is accepted (see MembersOf).
  static absl::StatusOr<MemberSet> FromRanks(std::vector<int> ranks, int world_size);
  // The canonical form only: INVALID_ARGUMENT naming the problem for a form
  // FromRanks refuses, a list that is an arithmetic progression, an
  // arithmetic form with a bad count, stride or range, a form that mixes
  // both, and a set of every rank (written as no members).
  static absl::StatusOr<MemberSet> FromForm(const MembersForm& form, int world_size);

  MembersForm Form() const;
  const std::vector<int>& ranks() const { return ranks_; }
  // World-sized: the members among the job's ranks.
  const RankSet& rank_set() const { return rank_set_; }
  int world_size() const { return rank_set_.world_size(); }
  int count() const { return static_cast<int>(ranks_.size()); }
  bool Contains(int rank) const { return rank_set_.Contains(rank); }
  // Every rank of the job is a member.
  bool AllRanks() const { return count() == world_size(); }
  // The rank's position among the members (0..count()-1); -1 for a rank that
  // is not a member.
  int IndexOf(int rank) const;
  // `ranks<a>..<b>` for consecutive ranks, `ranks<a>..<b>/<s>` for an
  // arithmetic progression of stride s > 1, else `m` and the low 48 bits of
  // Fingerprint() as 12 hex digits. Computed from the list alone.
  std::string Tag() const;
  // A deterministic 64-bit hash of the list, the same on every machine and
  // build: StableHasher (core/hash.h) over AddBytes("members"), AddU64(count),
  // then AddU64 of each rank in order. Independent of the world size.
  uint64_t Fingerprint() const;
  // "ranks 0-3,8" for error messages.
  std::string Describe() const;

  friend bool operator==(const MemberSet& a, const MemberSet& b) {
    return a.world_size() == b.world_size() && a.ranks_ == b.ranks_;
  }

 private:
  MemberSet(std::vector<int> ranks, RankSet rank_set);

  std::vector<int> ranks_;
  RankSet rank_set_;
  int stride_ = 0;  // > 0: an arithmetic progression of this stride; 0: none
};

// The members as a spec holds them: null when `ranks` is every rank of the
// job (the canonical "every rank"), else the set. FromRanks' errors.
absl::StatusOr<std::shared_ptr<const MemberSet>> MembersOf(std::vector<int> ranks, int world_size);

// Whether two member sets are equal; null is every rank and equals only null.
bool SameMembers(const MemberSet* a, const MemberSet* b);

// "ranks 2-3" for a set, "every rank" for null.
std::string DescribeMembers(const MemberSet* members);

}  // namespace accord

#endif  // ACCORD_CORE_MEMBERS_H_
