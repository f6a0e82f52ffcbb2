// MemberSet: construction and its errors, the canonical form and its round
// trip, IndexOf, tags, fingerprints; GroupSpec with members (equality,
// SpecFingerprint, CompareRegistration).
#include "core/members.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/group.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

MemberSet Set(std::vector<int> ranks, int world) {
  absl::StatusOr<MemberSet> s = MemberSet::FromRanks(std::move(ranks), world);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : *MemberSet::FromRanks({0}, 1);
}

void ExpectInvalid(const absl::Status& s, const std::vector<std::string>& parts) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const std::string& p : parts) EXPECT_THAT(s.message(), HasSubstr(p));
}

// A random non-empty subset of 0..world-1, ascending.
std::vector<int> RandomRanks(std::mt19937_64& rng, int world) {
  std::vector<int> ranks;
  while (ranks.empty()) {
    const int keep = 1 + static_cast<int>(rng() % 4);
    for (int r = 0; r < world; ++r) {
      if (rng() % keep == 0) ranks.push_back(r);
    }
  }
  return ranks;
}

TEST(MemberSetTest, FromRanksHoldsTheListAndAWorldSizedRankSet) {
  const MemberSet s = Set({1, 4, 70}, 72);
  EXPECT_EQ(s.ranks(), (std::vector<int>{1, 4, 70}));
  EXPECT_EQ(s.count(), 3);
  EXPECT_EQ(s.world_size(), 72);
  EXPECT_EQ(s.rank_set().world_size(), 72);
  EXPECT_EQ(s.rank_set().Members(), s.ranks());
  EXPECT_TRUE(s.Contains(70));
  EXPECT_FALSE(s.Contains(2));
  EXPECT_FALSE(s.AllRanks());
  EXPECT_TRUE(Set({0, 1, 2}, 3).AllRanks());
  EXPECT_EQ(s.Describe(), "ranks 1,4,70");
}

TEST(MemberSetTest, FromRanksRefusesBadInputNamingTheProblem) {
  ExpectInvalid(MemberSet::FromRanks({}, 4).status(), {"empty"});
  ExpectInvalid(MemberSet::FromRanks({0}, 0).status(), {"world size 0"});
  ExpectInvalid(MemberSet::FromRanks({0, 3, 2}, 4).status(),
                {"rank 2 at position 2 follows rank 3", "ascending"});
  ExpectInvalid(MemberSet::FromRanks({0, 2, 2}, 4).status(), {"rank 2 appears twice"});
  ExpectInvalid(MemberSet::FromRanks({-1, 2}, 4).status(), {"rank -1", "outside 0..3"});
  ExpectInvalid(MemberSet::FromRanks({1, 4}, 4).status(), {"rank 4 at position 1", "outside 0..3"});
}

TEST(MemberSetTest, FormIsArithmeticWheneverTheSetIsAProgression) {
  EXPECT_EQ(Set({3}, 8).Form(), (MembersForm{3, 1, 1, {}}));
  EXPECT_EQ(Set({1, 5}, 8).Form(), (MembersForm{1, 2, 4, {}}));
  EXPECT_EQ(Set({2, 3, 4}, 8).Form(), (MembersForm{2, 3, 1, {}}));
  EXPECT_EQ(Set({0, 3, 6}, 8).Form(), (MembersForm{0, 3, 3, {}}));
  EXPECT_EQ(Set({0, 1, 5}, 8).Form(), (MembersForm{0, 0, 0, {0, 1, 5}}));
}

TEST(MemberSetTest, EveryCanonicalFormRoundTrips) {
  std::mt19937_64 rng(44);
  for (int trial = 0; trial < 500; ++trial) {
    const int world = 2 + static_cast<int>(rng() % 140);
    std::vector<int> ranks = RandomRanks(rng, world);
    if (static_cast<int>(ranks.size()) == world) ranks.pop_back();
    const MemberSet s = Set(ranks, world);
    absl::StatusOr<MemberSet> back = MemberSet::FromForm(s.Form(), world);
    ASSERT_TRUE(back.ok()) << back.status() << " trial " << trial;
    EXPECT_EQ(*back, s);
    EXPECT_EQ(back->ranks(), ranks);
  }
}

TEST(MemberSetTest, FromFormRefusesEveryNonCanonicalForm) {
  ExpectInvalid(MemberSet::FromForm({0, 0, 0, {0, 2, 4}}, 8).status(),
                {"ranks 0,2,4", "arithmetic progression (stride 2)", "arithmetic form"});
  ExpectInvalid(MemberSet::FromForm({0, 0, 0, {1, 6}}, 8).status(), {"stride 5"});
  ExpectInvalid(MemberSet::FromForm({0, 0, 0, {6}}, 8).status(), {"arithmetic form"});
  ExpectInvalid(MemberSet::FromForm({0, 0, 0, {0, 1, 2, 3}}, 4).status(),
                {"every rank", "without members"});
  ExpectInvalid(MemberSet::FromForm({0, 4, 1, {}}, 4).status(), {"every rank"});
  ExpectInvalid(MemberSet::FromForm({0, 2, 1, {0, 1}}, 4).status(), {"both"});
  ExpectInvalid(MemberSet::FromForm({0, 2, 0, {}}, 4).status(), {"stride is below 1"});
  ExpectInvalid(MemberSet::FromForm({2, 1, 3, {}}, 4).status(), {"single rank", "stride 1"});
  ExpectInvalid(MemberSet::FromForm({1, 2, 3, {}}, 4).status(), {"outside 0..3"});
  ExpectInvalid(MemberSet::FromForm({-1, 2, 1, {}}, 4).status(), {"outside 0..3"});
  ExpectInvalid(MemberSet::FromForm({0, 2, 1 << 30, {}}, 4).status(), {"outside 0..3"});
  ExpectInvalid(MemberSet::FromForm({0, -2, 1, {}}, 4).status(), {"count -2"});
  ExpectInvalid(MemberSet::FromForm({0, 0, 0, {}}, 4).status(), {"no ranks"});
  ExpectInvalid(MemberSet::FromForm({1, 0, 0, {0, 1, 3}}, 4).status(), {"start 1"});
  ExpectInvalid(MemberSet::FromForm({0, 0, 0, {0, 3, 1}}, 4).status(), {"ascending"});
  ExpectInvalid(MemberSet::FromForm({0, 0, 0, {0, 1, 1, 3}}, 4).status(), {"twice"});
  ExpectInvalid(MemberSet::FromForm({0, 0, 0, {0, 1, 9}}, 4).status(), {"rank 9", "outside"});
  ExpectInvalid(MemberSet::FromForm({0, 1, 1, {}}, 0).status(), {"world size 0"});
}

TEST(MemberSetTest, IndexOfIsThePositionAmongMembers) {
  for (const MemberSet& s : {Set({1, 5, 9, 13}, 16), Set({0, 2, 3, 7, 64, 65}, 70)}) {
    for (int i = 0; i < s.count(); ++i) EXPECT_EQ(s.IndexOf(s.ranks()[i]), i);
    for (int r = -1; r <= s.world_size(); ++r) {
      if (!s.Contains(r)) {
        EXPECT_EQ(s.IndexOf(r), -1) << r;
      }
    }
  }
}

TEST(MemberSetTest, TagNamesProgressionsAndHashesOtherLists) {
  EXPECT_EQ(Set({2, 3}, 4).Tag(), "ranks2..3");
  EXPECT_EQ(Set({5}, 8).Tag(), "ranks5..5");
  EXPECT_EQ(Set({1, 5}, 8).Tag(), "ranks1..5/4");
  EXPECT_EQ(Set({0, 8, 16, 24}, 32).Tag(), "ranks0..24/8");
  const MemberSet odd = Set({0, 1, 5}, 8);
  EXPECT_THAT(odd.Tag(), MatchesRegex("m[0-9a-f]{12}"));
  EXPECT_EQ(odd.Tag().substr(1),
            std::string(absl::StrFormat("%012x", odd.Fingerprint() & 0xffffffffffffull)));
  // From the list alone: the same on every member, whatever the job's size.
  EXPECT_EQ(odd.Tag(), Set({0, 1, 5}, 64).Tag());
  EXPECT_NE(odd.Tag(), Set({0, 1, 6}, 8).Tag());
}

TEST(MemberSetTest, FingerprintsAreEqualForEqualSetsAndDifferOtherwise) {
  std::mt19937_64 rng(4242);
  std::vector<std::vector<int>> seen;
  std::vector<uint64_t> fingerprints;
  for (int trial = 0; trial < 300; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 100);
    const std::vector<int> ranks = RandomRanks(rng, world);
    const uint64_t f = Set(ranks, world).Fingerprint();
    EXPECT_EQ(f, Set(ranks, world).Fingerprint());
    for (size_t i = 0; i < seen.size(); ++i) {
      if (seen[i] == ranks) {
        EXPECT_EQ(fingerprints[i], f);
      } else {
        EXPECT_NE(fingerprints[i], f) << "trial " << trial;
      }
    }
    seen.push_back(ranks);
    fingerprints.push_back(f);
  }
}

TEST(MembersOfTest, EveryRankIsNullAndASubsetIsASet) {
  absl::StatusOr<std::shared_ptr<const MemberSet>> all = MembersOf({0, 1, 2, 3}, 4);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, nullptr);
  absl::StatusOr<std::shared_ptr<const MemberSet>> some = MembersOf({0, 3}, 4);
  ASSERT_TRUE(some.ok());
  ASSERT_NE(*some, nullptr);
  EXPECT_EQ((*some)->ranks(), (std::vector<int>{0, 3}));
  ExpectInvalid(MembersOf({3, 0}, 4).status(), {"ascending"});
  EXPECT_EQ(DescribeMembers(nullptr), "every rank");
  EXPECT_EQ(DescribeMembers(some->get()), "ranks 0,3");
}

GroupSpec SpecWith(std::shared_ptr<const MemberSet> members) {
  return GroupSpec{
      "fsdp/layers.0", {ParamSpec{"w", 4, 16}, ParamSpec{"b", 4, 4}}, std::move(members)};
}

std::shared_ptr<const MemberSet> Shared(std::vector<int> ranks, int world) {
  return std::make_shared<const MemberSet>(Set(std::move(ranks), world));
}

TEST(GroupSpecMembersTest, SpecsCompareMembersByValue) {
  EXPECT_EQ(SpecWith(Shared({1, 3}, 4)), SpecWith(Shared({1, 3}, 4)));
  EXPECT_FALSE(SpecWith(Shared({1, 3}, 4)) == SpecWith(Shared({1, 2}, 4)));
  EXPECT_FALSE(SpecWith(Shared({1, 3}, 4)) == SpecWith(nullptr));
  EXPECT_EQ(SpecWith(nullptr), SpecWith(nullptr));
}

TEST(GroupSpecMembersTest, SpecFingerprintFoldsInMembersOnlyWhenSet) {
  const uint64_t none = SpecFingerprint(SpecWith(nullptr));
  GroupSpec plain{"fsdp/layers.0", {ParamSpec{"w", 4, 16}, ParamSpec{"b", 4, 4}}};
  EXPECT_EQ(none, SpecFingerprint(plain));
  const uint64_t a = SpecFingerprint(SpecWith(Shared({1, 3}, 4)));
  EXPECT_EQ(a, SpecFingerprint(SpecWith(Shared({1, 3}, 4))));
  EXPECT_NE(a, none);
  EXPECT_NE(a, SpecFingerprint(SpecWith(Shared({1, 2}, 4))));
  EXPECT_NE(a, SpecFingerprint(SpecWith(Shared({1}, 4))));
}

TEST(GroupSpecMembersTest, CompareRegistrationNamesBothMemberSets) {
  absl::Status s =
      CompareRegistration(SpecWith(Shared({0, 1}, 4)), 0, SpecWith(Shared({0, 2}, 4)), 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("group \"fsdp/layers.0\""));
  EXPECT_THAT(s.message(), HasSubstr("rank 0 registered it with members ranks 0-1"));
  EXPECT_THAT(s.message(), HasSubstr("rank 2 with members ranks 0,2"));
  EXPECT_THAT(s.message(), HasSubstr("a group id must name one member set"));
  s = CompareRegistration(SpecWith(nullptr), 1, SpecWith(Shared({1, 3}, 4)), 3);
  EXPECT_THAT(s.message(), HasSubstr("with members every rank, rank 3 with members ranks 1,3"));
  EXPECT_TRUE(
      CompareRegistration(SpecWith(Shared({1, 3}, 4)), 1, SpecWith(Shared({1, 3}, 4)), 3).ok());
}

}  // namespace
}  // namespace accord
