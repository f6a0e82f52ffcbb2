#include "core/members.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/hash.h"

namespace accord {
namespace {

// The common stride of an ascending list: 1 for one rank, 0 when the list is
// not an arithmetic progression.
int StrideOf(const std::vector<int>& ranks) {
  if (ranks.size() < 2) return 1;
  const int stride = ranks[1] - ranks[0];
  for (size_t i = 2; i < ranks.size(); ++i) {
    if (ranks[i] - ranks[i - 1] != stride) return 0;
  }
  return stride;
}

absl::Status CheckArithmeticForm(const MembersForm& form, int world_size) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("members (start ", form.start, ", count ",
                                                   form.count, ", stride ", form.stride,
                                                   "): ", why));
  };
  if (!form.ranks.empty()) return bad("both the arithmetic and the list form are set");
  if (form.stride < 1) return bad("the stride is below 1");
  if (form.count == 1 && form.stride != 1) return bad("a single rank is written with stride 1");
  const int64_t last =
      int64_t{form.start} + (int64_t{form.count} - 1) * static_cast<int64_t>(form.stride);
  if (form.start < 0 || last >= world_size) {
    return bad(absl::StrCat("ranks outside 0..", world_size - 1, " of the job"));
  }
  return absl::OkStatus();
}

absl::Status CheckListForm(const MembersForm& form) {
  if (form.start != 0 || form.stride != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "members: a list of ", form.ranks.size(), " ranks with start ", form.start, " and stride ",
        form.stride, " set; the list form has count, start and stride 0"));
  }
  if (form.ranks.empty()) {
    return absl::InvalidArgumentError("members: no ranks (count 0 and an empty list)");
  }
  return absl::OkStatus();
}

}  // namespace

MemberSet::MemberSet(std::vector<int> ranks, RankSet rank_set)
    : ranks_(std::move(ranks)), rank_set_(std::move(rank_set)), stride_(StrideOf(ranks_)) {}

absl::StatusOr<MemberSet> MemberSet::FromRanks(std::vector<int> ranks, int world_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("members: world size ", world_size, " is below 1"));
  }
  if (ranks.empty()) return absl::InvalidArgumentError("members: the list of ranks is empty");
  RankSet set(world_size);
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    if (r < 0 || r >= world_size) {
      return absl::InvalidArgumentError(absl::StrCat("members: rank ", r, " at position ", i,
                                                     " is outside 0..", world_size - 1,
                                                     " of the job"));
    }
    if (i > 0 && r == ranks[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("members: rank ", r, " appears twice"));
    }
    if (i > 0 && r < ranks[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("members: rank ", r, " at position ", i,
                                                     " follows rank ", ranks[i - 1],
                                                     "; the list must be ascending"));
    }
    set.Add(r);
  }
  return MemberSet(std::move(ranks), std::move(set));
}

absl::StatusOr<MemberSet> MemberSet::FromForm(const MembersForm& form, int world_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("members: world size ", world_size, " is below 1"));
  }
  if (form.count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("members: count ", form.count, " is negative"));
  }
  std::vector<int> ranks;
  if (form.count > 0) {
    if (absl::Status s = CheckArithmeticForm(form, world_size); !s.ok()) return s;
    ranks.reserve(form.count);
    for (int i = 0; i < form.count; ++i) ranks.push_back(form.start + i * form.stride);
  } else {
    if (absl::Status s = CheckListForm(form); !s.ok()) return s;
    ranks = form.ranks;
  }
  absl::StatusOr<MemberSet> set = FromRanks(std::move(ranks), world_size);
  if (!set.ok()) return set.status();
  if (set->AllRanks()) {
    return absl::InvalidArgumentError(
        absl::StrCat("members: every rank of the job (", world_size,
                     " ranks) is written as no members; send the group without members"));
  }
  if (form.count == 0 && set->stride_ > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "members: the list ", set->Describe(), " is an arithmetic progression (stride ",
        set->stride_, "); send it in the arithmetic form (start, count, stride)"));
  }
  return set;
}

MembersForm MemberSet::Form() const {
  MembersForm form;
  if (stride_ > 0) {
    form.start = ranks_.front();
    form.count = count();
    form.stride = stride_;
  } else {
    form.ranks = ranks_;
  }
  return form;
}

int MemberSet::IndexOf(int rank) const {
  if (!Contains(rank)) return -1;
  if (stride_ > 0) return (rank - ranks_.front()) / stride_;
  return static_cast<int>(std::lower_bound(ranks_.begin(), ranks_.end(), rank) - ranks_.begin());
}

std::string MemberSet::Tag() const {
  if (stride_ == 1) return absl::StrCat("ranks", ranks_.front(), "..", ranks_.back());
  if (stride_ > 1) return absl::StrCat("ranks", ranks_.front(), "..", ranks_.back(), "/", stride_);
  return absl::StrFormat("m%012x", Fingerprint() & 0xffffffffffffull);
}

uint64_t MemberSet::Fingerprint() const {
  StableHasher h;
  h.AddBytes("members");
  h.AddU64(ranks_.size());
  for (int r : ranks_) h.AddU64(static_cast<uint64_t>(r));
  return h.Finish();
}

std::string MemberSet::Describe() const { return absl::StrCat("ranks ", FormatRanks(ranks_)); }

absl::StatusOr<std::shared_ptr<const MemberSet>> MembersOf(std::vector<int> ranks, int world_size) {
  absl::StatusOr<MemberSet> set = MemberSet::FromRanks(std::move(ranks), world_size);
  if (!set.ok()) return set.status();
  if (set->AllRanks()) return std::shared_ptr<const MemberSet>();
  return std::make_shared<const MemberSet>(*std::move(set));
}

bool SameMembers(const MemberSet* a, const MemberSet* b) {
  if (a == nullptr || b == nullptr) return a == b;
  return *a == *b;
}

std::string DescribeMembers(const MemberSet* members) {
  return members == nullptr ? "every rank" : members->Describe();
}

}  // namespace accord
