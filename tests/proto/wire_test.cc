// proto <-> core conversion (proto/wire.h): round trips of every message the
// agreement uses, the compact manifest form, a group's members in their
// canonical form, and precise errors for every malformed input a peer could
// send.
#include "proto/wire.h"

#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::wire {
namespace {

using ::testing::HasSubstr;

void ExpectInvalid(const absl::Status& s, std::vector<std::string> substrs) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const std::string& sub : substrs) EXPECT_THAT(s.message(), HasSubstr(sub)) << s;
}

// --- Bitsets -----------------------------------------------------------------

TEST(WireBitsTest, PackUnpackRoundTripAllLengths) {
  std::mt19937_64 rng(8);
  for (size_t n = 0; n <= 130; ++n) {
    std::vector<bool> bits(n);
    for (size_t i = 0; i < n; ++i) bits[i] = rng() & 1;
    const std::string packed = PackBits(bits);
    EXPECT_EQ(packed.size(), (n + 7) / 8);
    absl::StatusOr<std::vector<bool>> back = UnpackBits(packed, n, "t");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, bits);
  }
}

TEST(WireBitsTest, BitOrderIsLittleEndianByBit) {
  EXPECT_EQ(PackBits({true, false, false, false, false, false, false, false, false, true}),
            std::string("\x01\x02", 2));
}

TEST(WireBitsTest, WrongLengthIsRejected) {
  ExpectInvalid(UnpackBits(std::string(1, '\0'), 10, "layers.0 used_bits").status(),
                {"layers.0 used_bits", "bitset of 1 bytes for 10 entries (expected 2 bytes)"});
  ExpectInvalid(UnpackBits(std::string(3, '\0'), 10, "x").status(),
                {"bitset of 3 bytes for 10 entries (expected 2 bytes)"});
  ExpectInvalid(UnpackBits(std::string(1, '\0'), 0, "x").status(),
                {"bitset of 1 bytes for 0 entries (expected 0 bytes)"});
  ExpectInvalid(UnpackBits("", 1, "x").status(), {"expected 1 bytes"});
}

TEST(WireBitsTest, StrayHighBitsAreRejected) {
  ExpectInvalid(UnpackBits(std::string("\xff\x04", 2), 10, "x").status(),
                {"bits set past entry 10"});
  ExpectInvalid(UnpackBits(std::string("\x80", 1), 7, "x").status(), {"bits set past entry 7"});
  // Exactly full bytes have no stray bits to check.
  EXPECT_TRUE(UnpackBits(std::string("\xff", 1), 8, "x").ok());
}

TEST(WireBitsTest, RankSetRoundTripAndErrors) {
  for (int world : {1, 7, 8, 9, 64, 65, 130}) {
    RankSet s(world);
    for (int r = 0; r < world; r += 2) s.Add(r);
    s.Add(world - 1);
    absl::StatusOr<RankSet> back = RankSetFromBits(RankSetToBits(s), world, "ranks");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, s) << world;
  }
  ExpectInvalid(RankSetFromBits(std::string("\x08", 1), 3, "node 2 rank_bits").status(),
                {"node 2 rank_bits", "bits set past entry 3"});
  ExpectInvalid(RankSetFromBits(std::string(2, '\0'), 8, "r").status(), {"expected 1 bytes"});
}

// --- DTypes and policy -------------------------------------------------------

TEST(WireDTypeTest, FloatDTypesRoundTripWithEqualNumbers) {
  for (DType d : kAllDTypes) {
    EXPECT_EQ(static_cast<int>(DTypeToProto(d)), static_cast<int>(d));
    EXPECT_EQ(*DTypeFromProto(DTypeToProto(d)), d);
  }
  EXPECT_EQ(v1::FLOAT8_E4M3FN, 1);
  EXPECT_EQ(v1::FLOAT64, 6);
}

TEST(WireDTypeTest, NonFloatDTypesAreRejectedByName) {
  for (v1::DType d : {v1::INT8, v1::UINT8, v1::INT16, v1::INT32, v1::INT64, v1::BOOL, v1::COMPLEX64,
                      v1::COMPLEX128}) {
    ExpectInvalid(DTypeFromProto(d).status(),
                  {absl::StrCat("gradient dtype ", v1::DType_Name(d), " is not a float dtype")});
  }
  ExpectInvalid(DTypeFromProto(v1::DTYPE_UNSPECIFIED).status(), {"unset"});
  ExpectInvalid(DTypeFromProto(static_cast<v1::DType>(7)).status(), {"dtype number 7"});
  ExpectInvalid(DTypeFromProto(static_cast<v1::DType>(99)).status(), {"dtype number 99"});
}

TEST(WirePolicyTest, RoundTripsEveryPolicy) {
  std::vector<std::optional<DType>> reduces = {std::nullopt};
  for (DType d : kAllDTypes) reduces.push_back(d);
  for (const auto& reduce : reduces) {
    for (bool exact : {false, true}) {
      if (exact && !reduce) continue;
      for (Fp8TieBreak tie : {Fp8TieBreak::kBFloat16, Fp8TieBreak::kFloat16}) {
        Policy p;
        p.reduce_dtype = reduce;
        p.reduce_dtype_exact = exact;
        p.fp8_tie = tie;
        absl::StatusOr<Policy> back = PolicyFromProto(PolicyToProto(p));
        ASSERT_TRUE(back.ok()) << back.status();
        EXPECT_EQ(back->reduce_dtype, p.reduce_dtype);
        EXPECT_EQ(back->reduce_dtype_exact, p.reduce_dtype_exact);
        EXPECT_EQ(back->fp8_tie, p.fp8_tie);
      }
    }
  }
}

TEST(WirePolicyTest, DefaultsAndErrors) {
  absl::StatusOr<Policy> p = PolicyFromProto(v1::ReducePolicy());
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->reduce_dtype.has_value());
  EXPECT_EQ(p->fp8_tie, Fp8TieBreak::kBFloat16);  // unspecified = bf16
  v1::ReducePolicy bad;
  bad.set_reduce_dtype_exact(true);
  ExpectInvalid(PolicyFromProto(bad).status(), {"reduce_dtype_exact without a reduce_dtype"});
  bad.Clear();
  bad.set_reduce_dtype(v1::INT32);
  ExpectInvalid(PolicyFromProto(bad).status(), {"reduce policy: ", "INT32", "not a float"});
  bad.Clear();
  bad.set_fp8_tie(static_cast<v1::Fp8TieBreak>(7));
  ExpectInvalid(PolicyFromProto(bad).status(), {"unknown fp8 tie-break 7"});
}

// --- Group registration ------------------------------------------------------

TEST(WireGroupSpecTest, RoundTrip) {
  const GroupSpec spec{"layers.7",
                       {ParamSpec{"w", 16, 256}, ParamSpec{"b", 16, 16}, ParamSpec{"e", 0, 0},
                        ParamSpec{"z", 5, 0}}};
  Policy policy;
  policy.reduce_dtype = DType::kFloat32;
  const v1::GroupRegistration r = GroupSpecToProto(spec, policy);
  EXPECT_EQ(r.policy().reduce_dtype(), v1::FLOAT32);
  absl::StatusOr<GroupSpec> back = GroupSpecFromProto(r);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, spec);
  EXPECT_EQ(SpecFingerprint(*back), SpecFingerprint(spec));
}

TEST(WireGroupSpecTest, ValidatesWhileConverting) {
  v1::GroupRegistration r;
  r.set_group_id("g");
  auto* p = r.add_params();
  p->set_name("a");
  p->set_dim0(3);
  p->set_numel(7);
  ExpectInvalid(GroupSpecFromProto(r).status(),
                {"group \"g\" parameter 0 \"a\"", "numel is not a multiple of dim0"});
  p->set_numel(6);
  *r.add_params() = *p;
  ExpectInvalid(GroupSpecFromProto(r).status(), {"parameter 1 \"a\"", "name registered twice"});
  r.set_group_id("");
  ExpectInvalid(GroupSpecFromProto(r).status(), {"group id is empty"});
}

// --- Members -----------------------------------------------------------------

MemberSet Set(std::vector<int> ranks, int world) {
  absl::StatusOr<MemberSet> s = MemberSet::FromRanks(std::move(ranks), world);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : *MemberSet::FromRanks({0}, 1);
}

v1::Members ListForm(std::vector<int> ranks) {
  v1::Members m;
  for (int r : ranks) m.add_ranks(r);
  return m;
}

v1::Members ArithmeticForm(int start, int count, int stride) {
  v1::Members m;
  m.set_start(start);
  m.set_count(count);
  m.set_stride(stride);
  return m;
}

void ExpectInvalidRequest(const absl::Status& s, std::vector<std::string> substrs) {
  ExpectInvalid(s, std::move(substrs));
  EXPECT_EQ(KindOf(s), v1::INVALID_REQUEST) << s;
}

TEST(WireMembersTest, ArithmeticSetsTravelInTheArithmeticForm) {
  v1::Members m = MembersToProto(Set({1, 5}, 8));
  EXPECT_EQ(m.start(), 1);
  EXPECT_EQ(m.count(), 2);
  EXPECT_EQ(m.stride(), 4);
  EXPECT_EQ(m.ranks_size(), 0);
  m = MembersToProto(Set({6}, 8));
  EXPECT_EQ(m.count(), 1);
  EXPECT_EQ(m.stride(), 1);
  m = MembersToProto(Set({0, 1, 5}, 8));
  EXPECT_EQ(m.count(), 0);
  EXPECT_EQ(std::vector<int>(m.ranks().begin(), m.ranks().end()), (std::vector<int>{0, 1, 5}));
}

TEST(WireMembersTest, EveryCanonicalFormRoundTripsAndEqualSetsAreEqualBytes) {
  std::mt19937_64 rng(2024);
  for (int trial = 0; trial < 300; ++trial) {
    const int world = 2 + static_cast<int>(rng() % 200);
    std::vector<int> ranks;
    const int keep = 1 + static_cast<int>(rng() % 5);
    for (int r = 0; r < world; ++r) {
      if (rng() % keep == 0) ranks.push_back(r);
    }
    if (ranks.empty()) ranks.push_back(static_cast<int>(rng() % world));
    if (static_cast<int>(ranks.size()) == world) ranks.pop_back();
    const MemberSet set = Set(ranks, world);
    const std::string bytes = MembersToProto(set).SerializeAsString();
    v1::Members parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes));
    absl::StatusOr<std::shared_ptr<const MemberSet>> back = MembersFromProto(parsed, world);
    ASSERT_TRUE(back.ok()) << back.status() << " trial " << trial;
    EXPECT_EQ((*back)->ranks(), ranks);
    EXPECT_EQ(MembersToProto(**back).SerializeAsString(), bytes);
  }
}

TEST(WireMembersTest, NonCanonicalFormsAreRefusedNamingTheProblem) {
  ExpectInvalidRequest(MembersFromProto(ListForm({0, 2, 4}), 8).status(),
                       {"ranks 0,2,4", "arithmetic progression", "arithmetic form"});
  ExpectInvalidRequest(MembersFromProto(ListForm({3, 7}), 8).status(), {"arithmetic"});
  ExpectInvalidRequest(MembersFromProto(ListForm({0, 1, 2, 3}), 4).status(),
                       {"every rank", "without members"});
  ExpectInvalidRequest(MembersFromProto(ArithmeticForm(0, 4, 1), 4).status(), {"every rank"});
  ExpectInvalidRequest(MembersFromProto(ListForm({0, 5, 3}), 8).status(),
                       {"rank 3", "follows rank 5", "ascending"});
  ExpectInvalidRequest(MembersFromProto(ListForm({0, 3, 3, 5}), 8).status(),
                       {"rank 3 appears twice"});
  ExpectInvalidRequest(MembersFromProto(ListForm({0, 1, 8}), 8).status(),
                       {"rank 8", "outside 0..7"});
  ExpectInvalidRequest(MembersFromProto(ListForm({-2, 1, 3}), 8).status(), {"rank -2"});
  ExpectInvalidRequest(MembersFromProto(ArithmeticForm(4, 3, 2), 8).status(), {"outside 0..7"});
  ExpectInvalidRequest(MembersFromProto(ArithmeticForm(0, 2, 0), 8).status(), {"stride"});
  ExpectInvalidRequest(MembersFromProto(v1::Members(), 8).status(), {"no ranks"});
  v1::Members both = ArithmeticForm(0, 2, 1);
  both.add_ranks(5);
  ExpectInvalidRequest(MembersFromProto(both, 8).status(), {"both"});
}

GroupSpec MemberSpec(std::shared_ptr<const MemberSet> members) {
  return GroupSpec{"fsdp/layers.0@ranks2..3",
                   {ParamSpec{"w", 16, 256}, ParamSpec{"b", 16, 16}},
                   std::move(members)};
}

TEST(WireGroupSpecTest, MembersReachTheSpecAndBack) {
  for (const MemberSet& set : {Set({2, 3}, 8), Set({1, 5}, 8), Set({0, 1, 5}, 8)}) {
    const GroupSpec spec = MemberSpec(std::make_shared<const MemberSet>(set));
    v1::GroupRegistration r;
    ASSERT_TRUE(r.ParseFromString(GroupSpecToProto(spec, Policy()).SerializeAsString()));
    ASSERT_TRUE(r.has_members());
    absl::StatusOr<GroupSpec> back = GroupSpecFromProto(r, 8);
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_NE(back->members, nullptr);
    EXPECT_EQ(back->members->ranks(), set.ranks());
    EXPECT_EQ(*back, spec);
    EXPECT_EQ(SpecFingerprint(*back), SpecFingerprint(spec));
  }
}

TEST(WireGroupSpecTest, NoMembersAndEveryRankTravelAbsent) {
  const GroupSpec plain = MemberSpec(nullptr);
  const v1::GroupRegistration r = GroupSpecToProto(plain, Policy());
  EXPECT_FALSE(r.has_members());
  // Byte for byte the registration a 1-D rank sent before members existed.
  v1::GroupRegistration before;
  before.set_group_id(plain.group_id);
  for (const ParamSpec& p : plain.params) {
    v1::ParamSpec* out = before.add_params();
    out->set_name(p.name);
    out->set_dim0(p.dim0);
    out->set_numel(p.numel);
  }
  *before.mutable_policy() = PolicyToProto(Policy());
  EXPECT_EQ(r.SerializeAsString(), before.SerializeAsString());
  absl::StatusOr<GroupSpec> back = GroupSpecFromProto(r, 8);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->members, nullptr);
  // A set of every rank held in a spec is written as no members.
  const GroupSpec every = MemberSpec(std::make_shared<const MemberSet>(Set({0, 1, 2, 3}, 4)));
  EXPECT_FALSE(GroupSpecToProto(every, Policy()).has_members());
}

TEST(WireGroupSpecTest, NonCanonicalMembersAreRefusedNamingTheGroup) {
  v1::GroupRegistration r = GroupSpecToProto(MemberSpec(nullptr), Policy());
  *r.mutable_members() = ListForm({0, 2, 4});
  ExpectInvalidRequest(GroupSpecFromProto(r, 8).status(),
                       {"group \"fsdp/layers.0@ranks2..3\"", "arithmetic progression"});
  *r.mutable_members() = ArithmeticForm(0, 8, 1);
  ExpectInvalidRequest(GroupSpecFromProto(r, 8).status(), {"every rank"});
  *r.mutable_members() = ListForm({0, 1, 9});
  ExpectInvalidRequest(GroupSpecFromProto(r, 8).status(), {"rank 9", "outside 0..7"});
  // A malformed spec is named before its members.
  r.mutable_params(1)->set_name("w");
  ExpectInvalid(GroupSpecFromProto(r, 8).status(), {"name registered twice"});
}

TEST(WireGroupSpecTest, AReceiverWithoutMembersRefusesARegistrationWithMembers) {
  const GroupSpec spec = MemberSpec(std::make_shared<const MemberSet>(Set({2, 3}, 8)));
  ExpectInvalidRequest(GroupSpecFromProto(GroupSpecToProto(spec, Policy())).status(),
                       {"group \"fsdp/layers.0@ranks2..3\" has members"});
}

// The field numbers docs/MEMBERS.md 2.2 gives the new fields (evolution rules:
// never renumbered).
TEST(WireMembersTest, NewFieldsHaveTheirDocumentedNumbers) {
  EXPECT_EQ(v1::GroupRegistration::kMembersFieldNumber, 4);
  EXPECT_EQ(v1::ManifestBatch::kSyncKeyFieldNumber, 4);
  EXPECT_EQ(v1::Welcome::kBatchRepeatRecordsFieldNumber, 7);
  EXPECT_EQ(v1::Welcome::kMembersFieldNumber, 8);
  EXPECT_EQ(v1::KeyValueGetRequest::kExpectedFieldNumber, 9);
  v1::KeyValueGetRequest get;
  *get.mutable_expected() = MembersToProto(Set({1, 5}, 8));
  v1::KeyValueGetRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(get.SerializeAsString()));
  absl::StatusOr<std::shared_ptr<const MemberSet>> expected =
      MembersFromProto(parsed.expected(), 8);
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ((*expected)->ranks(), (std::vector<int>{1, 5}));
}

// --- Manifests ---------------------------------------------------------------

Manifest MakeManifest(int64_t step, int world, std::vector<DTypeMask> dtypes,
                      std::vector<int> ranks) {
  Manifest m;
  m.step = step;
  m.dtypes = std::move(dtypes);
  m.ranks = RankSet(world);
  for (int r : ranks) m.ranks.Add(r);
  return m;
}

constexpr DTypeMask kBF = MaskOf(DType::kBFloat16);
constexpr DTypeMask kF32 = MaskOf(DType::kFloat32);

TEST(WireManifestTest, UniformFormIsChosenWhenUniform) {
  const Manifest m = MakeManifest(12, 4, {kBF, 0, kBF, kBF, 0, 0, 0, 0, kBF}, {0, 1, 3});
  v1::Manifest out;
  ManifestToProto("layers.0", m, /*with_ranks=*/true, &out);
  EXPECT_EQ(out.group_id(), "layers.0");
  EXPECT_EQ(out.step(), 12);
  EXPECT_EQ(out.uniform_dtype(), v1::BFLOAT16);
  EXPECT_TRUE(out.dtype_masks().empty());
  EXPECT_EQ(out.used_bits(), std::string("\x0d\x01", 2));
  EXPECT_EQ(out.cache_key(), ManifestKey(m));
  EXPECT_FALSE(out.repeat());
  absl::StatusOr<Manifest> back = ManifestFromProto(out, 9, 4, -1);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, m);
}

TEST(WireManifestTest, MasksFormWhenMixedOrMultiDType) {
  for (const std::vector<DTypeMask>& dtypes :
       {std::vector<DTypeMask>{kBF, kF32, 0}, std::vector<DTypeMask>{kBF | kF32, kBF | kF32},
        std::vector<DTypeMask>{0, kBF | kF32}}) {
    const Manifest m = MakeManifest(3, 2, dtypes, {0, 1});
    v1::Manifest out;
    ManifestToProto("g", m, true, &out);
    EXPECT_EQ(out.uniform_dtype(), v1::DTYPE_UNSPECIFIED);
    EXPECT_EQ(out.dtype_masks().size(), dtypes.size());
    absl::StatusOr<Manifest> back = ManifestFromProto(out, dtypes.size(), 2, -1);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, m);
  }
}

TEST(WireManifestTest, NothingUsedCarriesNoDType) {
  const Manifest m = MakeManifest(3, 2, {0, 0, 0}, {1});
  v1::Manifest out;
  ManifestToProto("g", m, true, &out);
  EXPECT_EQ(out.uniform_dtype(), v1::DTYPE_UNSPECIFIED);
  EXPECT_TRUE(out.dtype_masks().empty());
  absl::StatusOr<Manifest> back = ManifestFromProto(out, 3, 2, -1);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, m);
}

TEST(WireManifestTest, RandomRoundTrips) {
  std::mt19937_64 rng(77);
  for (int trial = 0; trial < 500; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 130);
    const size_t n = rng() % 40;
    std::vector<DTypeMask> dtypes(n);
    const bool uniformish = rng() % 2;
    for (DTypeMask& d : dtypes) {
      if (rng() % 3 == 0) continue;
      d = uniformish ? kBF : static_cast<DTypeMask>(rng() & kValidDTypeMask);
    }
    std::vector<int> ranks = {static_cast<int>(rng() % world)};
    for (int r = 0; r < world; ++r) {
      if (rng() % 4 == 0) ranks.push_back(r);
    }
    const Manifest m = MakeManifest(static_cast<int64_t>(rng() % 100000), world, dtypes, ranks);
    v1::Manifest out;
    ManifestToProto("g", m, true, &out);
    absl::StatusOr<Manifest> back = ManifestFromProto(out, n, world, -1);
    ASSERT_TRUE(back.ok()) << "trial " << trial << ": " << back.status();
    EXPECT_EQ(*back, m) << "trial " << trial;
    // Through the serialized bytes too.
    v1::Manifest parsed;
    ASSERT_TRUE(parsed.ParseFromString(out.SerializeAsString()));
    EXPECT_EQ(*ManifestFromProto(parsed, n, world, -1), m);
  }
}

TEST(WireManifestTest, RankOwnManifestSpeaksForSender) {
  const Manifest m = RankManifest(4, 5, 8, {DType::kBFloat16, std::nullopt});
  v1::Manifest out;
  ManifestToProto("g", m, /*with_ranks=*/false, &out);
  EXPECT_TRUE(out.rank_bits().empty());
  absl::StatusOr<Manifest> back = ManifestFromProto(out, 2, 8, 5);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, m);
}

v1::Manifest Valid() {
  v1::Manifest m;
  ManifestToProto("layers.2", MakeManifest(41, 4, {kBF, 0, kF32}, {0, 2}), true, &m);
  return m;
}

TEST(WireManifestTest, MalformedManifestsAreRejectedPrecisely) {
  const std::string where = "manifest for group \"layers.2\" step 41";
  ASSERT_TRUE(ManifestFromProto(Valid(), 3, 4, -1).ok());

  v1::Manifest m = Valid();
  m.set_uniform_dtype(v1::BFLOAT16);
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(),
                {where, "both uniform_dtype and dtype_masks are set"});

  m = Valid();
  m.clear_dtype_masks();
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(),
                {where, "parameters are used but no dtype is given"});

  for (char bad : {'\x80', '\x01', '\x81'}) {
    m = Valid();
    (*m.mutable_dtype_masks())[2] = bad;
    ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(),
                  {where, "parameter 2 has a non-float or unknown dtype (mask 0x"});
  }

  m = Valid();
  m.set_dtype_masks(std::string("\x10\x00", 2));
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(),
                {where, "2 dtype entries for 3 parameters"});

  m = Valid();
  (*m.mutable_dtype_masks())[1] = static_cast<char>(kBF);
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(),
                {where, "parameter 1 is unused but has a dtype"});

  m = Valid();
  (*m.mutable_dtype_masks())[0] = 0;
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(),
                {where, "parameter 0 is used but has no dtype"});

  // Bitsets of the wrong length and with stray high bits.
  ExpectInvalid(ManifestFromProto(Valid(), 9, 4, -1).status(),
                {where + " used_bits", "bitset of 1 bytes for 9 entries (expected 2 bytes)"});
  m = Valid();
  m.set_used_bits(std::string("\x0d", 1));  // bit 3 set, only 3 params
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(),
                {where + " used_bits", "bits set past entry 3"});
  m = Valid();
  m.set_rank_bits(std::string("\x15", 1));  // rank 4 in a world of 4
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(),
                {where + " rank_bits", "bits set past entry 4"});
  m = Valid();
  m.set_rank_bits(std::string("\x05\x00", 2));
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(),
                {where + " rank_bits", "bitset of 2 bytes for 4 entries"});
  m = Valid();
  m.set_rank_bits(std::string("\x00", 1));
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(), {where, "speaks for no rank"});
  m = Valid();
  m.clear_rank_bits();
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(), {where + " rank_bits"});

  // A rank's own manifest.
  ExpectInvalid(ManifestFromProto(Valid(), 3, 4, 1).status(),
                {where, "a rank's manifest must not carry rank_bits"});
  m = Valid();
  m.clear_rank_bits();
  ExpectInvalid(ManifestFromProto(m, 3, 4, 4).status(), {where, "rank 4 outside world size 4"});

  // Non-float uniform dtype.
  m = Valid();
  m.clear_dtype_masks();
  m.set_uniform_dtype(v1::INT32);
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(),
                {where, "gradient dtype INT32 is not a float dtype"});

  m = Valid();
  m.set_repeat(true);
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(),
                {where, "repeat form must be resolved against the sender's cache"});

  m = Valid();
  m.set_step(-3);
  ExpectInvalid(ManifestFromProto(m, 3, 4, -1).status(), {"step -3", "negative step"});
}

// --- Decisions and errors ----------------------------------------------------

TEST(WireDecisionTest, RandomRoundTrips) {
  std::mt19937_64 rng(4);
  for (int trial = 0; trial < 200; ++trial) {
    Decision d;
    d.step = static_cast<int64_t>(rng() % 1000);
    d.wire_dtype = kAllDTypes[rng() % kNumDTypes];
    d.included.resize(rng() % 70);
    int n = 0;
    for (size_t i = 0; i < d.included.size(); ++i) {
      d.included[i] = rng() & 1;
      n += d.included[i] ? 1 : 0;
    }
    d.layout_fingerprint = rng();
    v1::DecisionOk ok;
    DecisionToProto(d, &ok);
    EXPECT_EQ(ok.num_included(), n);
    absl::StatusOr<Decision> back = DecisionFromProto(d.step, ok, d.included.size());
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, d);
  }
}

TEST(WireDecisionTest, MalformedDecisionsAreRejected) {
  Decision d;
  d.wire_dtype = DType::kBFloat16;
  d.included = {true, false, true};
  v1::DecisionOk ok;
  DecisionToProto(d, &ok);
  ExpectInvalid(DecisionFromProto(0, ok, 9).status(),
                {"decision included_bits", "expected 2 bytes"});
  ok.set_included_bits(std::string("\x0f", 1));
  ExpectInvalid(DecisionFromProto(0, ok, 3).status(), {"bits set past entry 3"});
  DecisionToProto(d, &ok);
  ok.set_wire_dtype(v1::BOOL);
  ExpectInvalid(DecisionFromProto(0, ok, 3).status(), {"decision: ", "BOOL"});
  ok.set_wire_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectInvalid(DecisionFromProto(0, ok, 3).status(), {"decision: ", "unset"});
}

TEST(WireErrorTest, ErrorRoundTripKeepsCodeAndMessage) {
  const absl::Status s = absl::FailedPreconditionError("missing ranks 2,5-7");
  const v1::DecisionError e = MakeError(v1::MISSING_RANKS, s);
  EXPECT_EQ(e.kind(), v1::MISSING_RANKS);
  EXPECT_EQ(e.param_index(), -1);
  EXPECT_EQ(ErrorToStatus(e).code(), s.code());
  EXPECT_EQ(ErrorToStatus(e).message(), s.message());
  EXPECT_EQ(KindOf(ErrorToStatus(e)), v1::MISSING_RANKS);
  v1::DecisionError odd = e;
  odd.set_code(99);
  EXPECT_EQ(ErrorToStatus(odd).code(), absl::StatusCode::kUnknown);
  odd.set_code(0);  // OK is not an error: never turn an error into success
  EXPECT_EQ(ErrorToStatus(odd).code(), absl::StatusCode::kUnknown);
}

// Callers branch on the kind a status carries, never on its text.
TEST(WireErrorTest, KindTravelsInTheStatusPayloadNotInTheMessage) {
  EXPECT_EQ(KindOf(absl::InvalidArgumentError("gradient dtype INT32 is not a float dtype")),
            v1::ERROR_KIND_UNSPECIFIED);
  const absl::Status non_float = DTypeFromProto(v1::INT32).status();
  EXPECT_EQ(KindOf(non_float), v1::NON_FLOAT_DTYPE);
  v1::Manifest m;
  m.set_group_id("g");
  m.set_used_bits(std::string(1, '\x01'));
  m.set_uniform_dtype(v1::INT64);
  std::vector<DTypeMask> out;
  EXPECT_EQ(KindOf(ManifestDTypesFromProto(m, 1, &out)), v1::NON_FLOAT_DTYPE);
  m.set_uniform_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(KindOf(ManifestDTypesFromProto(m, 1, &out)), v1::ERROR_KIND_UNSPECIFIED);
  // MakeError takes the kind from the status when not given one.
  EXPECT_EQ(MakeError(v1::ERROR_KIND_UNSPECIFIED, non_float).kind(), v1::NON_FLOAT_DTYPE);
  EXPECT_TRUE(WithKind(absl::OkStatus(), v1::LIMIT_EXCEEDED).ok());
}

TEST(WireErrorTest, EveryKindHasOneCanonicalCode) {
  for (int k = v1::ErrorKind_MIN; k <= v1::ErrorKind_MAX; ++k) {
    const auto kind = static_cast<v1::ErrorKind>(k);
    const absl::Status s = KindError(kind, "x");
    if (kind == v1::ERROR_KIND_UNSPECIFIED) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnknown);
      continue;
    }
    EXPECT_NE(CodeOfKind(kind), absl::StatusCode::kUnknown) << v1::ErrorKind_Name(kind);
    EXPECT_EQ(s.code(), CodeOfKind(kind));
    EXPECT_EQ(KindOf(s), kind);
  }
  EXPECT_EQ(CodeOfKind(v1::MISSING_RANKS), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(CodeOfKind(v1::DUPLICATE_RANK), absl::StatusCode::kAlreadyExists);
}

}  // namespace
}  // namespace accord::wire
