// The client's side of groups with members (docs/MEMBERS.md 2.4) against the
// in-process fake sidecar: validation before sending, the Welcome check,
// decisions checked over the member count, and the job's verdict.
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fake_sidecar.h"

namespace accord {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kLong = absl::Seconds(30);

GroupSpec Spec(const std::string& id, std::vector<int> members, int world) {
  GroupSpec spec{id, {{"w", 8, 64}, {"b", 8, 8}, {"v", 4, 16}}};
  absl::StatusOr<MemberSet> m = MemberSet::FromRanks(std::move(members), world);
  EXPECT_TRUE(m.ok()) << m.status();
  if (m.ok()) spec.members = std::make_shared<const MemberSet>(*std::move(m));
  return spec;
}

class ClientMembersTest : public ::testing::Test {
 protected:
  void StartFake(int world, bool members) {
    fake_ = std::make_unique<testing::FakeSidecar>(world);
    if (members) fake_->TakeMembers();
    fake_->Start();
    for (int r = 0; r < world; ++r) {
      ClientOptions o;
      o.socket_path = fake_->socket_path();
      o.job_id = "job";
      o.rank = r;
      o.world_size = world;
      o.connect_timeout = kLong;
      o.reconnect_grace = absl::ZeroDuration();
      absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
      ASSERT_TRUE(c.ok()) << c.status();
      clients_.push_back(*std::move(c));
    }
  }
  int Registrations() const {
    int n = 0;
    for (const v1::RankMessage& m : fake_->Received()) n += m.has_registration() ? 1 : 0;
    return n;
  }

  std::unique_ptr<testing::FakeSidecar> fake_;
  std::vector<std::unique_ptr<Client>> clients_;
};

// Two stages of 2 ranks each: each stage's group is answered and decided
// among its members alone, and the decision's layout is over 2 ranks (the
// client checks the fingerprint over the member count, not the job's 4).
TEST_F(ClientMembersTest, EachMemberSetRegistersAndDecidesWithoutTheOtherRanks) {
  StartFake(4, /*members=*/true);
  const GroupSpec stage0 = Spec("g@ranks0..1", {0, 1}, 4);
  const GroupSpec stage1 = Spec("g@ranks2..3", {2, 3}, 4);
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back(
        [&, r] { results[r] = clients_[r]->RegisterGroup(stage0, Policy(), absl::Now() + kLong); });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
  DecisionFuture f0 =
      clients_[0]->Submit({stage0.group_id, 0, {DType::kFloat32, std::nullopt, std::nullopt}});
  DecisionFuture f1 =
      clients_[1]->Submit({stage0.group_id, 0, {DType::kFloat32, DType::kFloat32, std::nullopt}});
  absl::StatusOr<Decision> d0 = clients_[0]->Wait(f0, absl::Now() + kLong);
  absl::StatusOr<Decision> d1 = clients_[1]->Wait(f1, absl::Now() + kLong);
  ASSERT_TRUE(d0.ok()) << d0.status();
  ASSERT_TRUE(d1.ok()) << d1.status();
  EXPECT_EQ(*d0, *d1);
  EXPECT_EQ(d0->included, (std::vector<bool>{true, true, false}));
  EXPECT_EQ(d0->layout_fingerprint, LayoutFingerprint(stage0, 2, d0->included, d0->wire_dtype));
  EXPECT_NE(d0->layout_fingerprint, LayoutFingerprint(stage0, 4, d0->included, d0->wire_dtype));
  // Stage 1 has not registered yet; its ranks were never waited for.
  EXPECT_FALSE(clients_[2]->Group(stage0.group_id).ok());
  threads.clear();
  for (int r = 2; r < 4; ++r) {
    threads.emplace_back([&, r] {
      results[r - 2] = clients_[r]->RegisterGroup(stage1, Policy(), absl::Now() + kLong);
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
  absl::StatusOr<GroupSpec> back = clients_[3]->Group(stage1.group_id);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, stage1);
}

TEST_F(ClientMembersTest, MembersWithoutThisRankOrOfAnotherJobAreRefusedBeforeSending) {
  StartFake(4, /*members=*/true);
  absl::Status s =
      clients_[0]->RegisterGroup(Spec("g@ranks2..3", {2, 3}, 4), Policy(), absl::Now() + kLong);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("rank 0 is not among its members (ranks 2-3)"));
  s = clients_[0]->RegisterGroup(Spec("g@ranks0..1", {0, 1}, 8), Policy(), absl::Now() + kLong);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("a job of 8 ranks"));
  // A batch with one bad registration sends none of them.
  s = clients_[0]->RegisterGroups(
      {{Spec("a@ranks0..1", {0, 1}, 4), Policy()}, {Spec("b@ranks1..2", {1, 2}, 4), Policy()}},
      absl::Now() + kLong);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("group \"b@ranks1..2\""));
  EXPECT_EQ(Registrations(), 0);
  EXPECT_FALSE(clients_[0]->Group("a@ranks0..1").ok());
}

TEST_F(ClientMembersTest, ASidecarWithoutMembersInItsWelcomeIsRefusedBeforeSending) {
  StartFake(2, /*members=*/false);
  absl::Status s =
      clients_[0]->RegisterGroup(Spec("g@ranks0", {0}, 2), Policy(), absl::Now() + kLong);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("group \"g@ranks0\" has members (ranks 0) but the sidecar "
                                     "or coordinator is older than groups with members"));
  EXPECT_EQ(Registrations(), 0);
}

// Members of every rank are the canonical "every rank": sent absent, so an
// older sidecar takes them, and the registered spec has no members.
TEST_F(ClientMembersTest, MembersOfEveryRankAreRegisteredAsNone) {
  StartFake(1, /*members=*/false);
  ASSERT_TRUE(clients_[0]->RegisterGroup(Spec("g", {0}, 1), Policy(), absl::Now() + kLong).ok());
  ASSERT_EQ(Registrations(), 1);
  for (const v1::RankMessage& m : fake_->Received()) {
    if (m.has_registration()) {
      EXPECT_FALSE(m.registration().has_members());
    }
  }
  absl::StatusOr<GroupSpec> back = clients_[0]->Group("g");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->members, nullptr);
}

TEST_F(ClientMembersTest, WaitVerdictReturnsTheFirstErrorThatCarriesJobFailed) {
  StartFake(2, /*members=*/true);
  EXPECT_EQ(clients_[1]->WaitVerdict(absl::Now() + absl::Milliseconds(20)), std::nullopt);
  // An error about one group's step that is not the job's failure is no verdict.
  v1::DecisionError e;
  e.set_kind(v1::INVALID_MANIFEST);
  e.set_code(static_cast<int>(absl::StatusCode::kInvalidArgument));
  e.set_message("bad manifest");
  e.set_group_id("other");
  fake_->SendErrorToAll(e);
  EXPECT_EQ(clients_[1]->WaitVerdict(absl::Now() + absl::Milliseconds(20)), std::nullopt);
  // The job's failure, pushed with nothing pending on this rank.
  e.set_kind(v1::MISSING_RANKS);
  e.set_code(static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  e.set_message("job \"job\": rank 3 did not submit group \"g@ranks2..3\" step 4");
  e.set_group_id("g@ranks2..3");
  e.set_job_failed(true);
  fake_->SendErrorToAll(e);
  std::optional<absl::Status> v = clients_[1]->WaitVerdict(absl::Now() + kLong);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(v->message(), HasSubstr("rank 3 did not submit"));
  // Later errors do not replace it.
  e.set_message("another");
  fake_->SendErrorToAll(e);
  v = clients_[1]->WaitVerdict(absl::Now() + kLong);
  ASSERT_TRUE(v.has_value());
  EXPECT_THAT(v->message(), HasSubstr("rank 3 did not submit"));
}

}  // namespace
}  // namespace accord
