// Groups with members through the real daemons (docs/MEMBERS.md): a
// coordinator, two sidecars as processes (each serving one rank of each
// stage), optionally one accord-relay in front of them, and in-process ranks
// (each its own connection, as a rank process would have). A 2-stage x 2-DP
// job: stage 0 is ranks {0, 1}, stage 1 ranks {2, 3}; sidecar 0 serves ranks
// 0 and 2, sidecar 1 ranks 1 and 3.
//  - Each stage registers and decides among its own members only: stage 0
//    registers its groups in one order and runs its steps to the end before
//    stage 1 registers its groups in the opposite order (no wait across
//    member sets).
//  - A silent member of stage 0 is named (MISSING_RANKS) to its member set;
//    every rank, of either stage, ends with the job's failure in the same
//    words. A member that leaves mid-step is named at once, likewise.
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"

namespace accord::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 4;
constexpr int kSteps = 3;

std::unique_ptr<LocalCluster> StartCluster(bool relay) {
  LocalClusterOptions o;
  o.num_sidecars = 2;
  o.sidecars_per_relay = relay ? 2 : 0;
  o.coordinator_flags = {"--metrics_port=-1", "--deadline=2s"};
  o.sidecar_flags = {"--metrics_port=-1"};
  o.echo = false;
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Rank r's stage: 0 for ranks 0 and 1, 1 for ranks 2 and 3.
int StageOf(int rank) { return rank / 2; }

std::shared_ptr<const MemberSet> StageMembers(int stage) {
  return std::make_shared<const MemberSet>(
      *MemberSet::FromRanks({2 * stage, 2 * stage + 1}, kWorld));
}

// The stage's groups, with ids made unique per member set as accord.torch
// makes them: the FSDP root's and the step watch's.
GroupSpec StageGroup(int stage, const std::string& base) {
  GroupSpec spec{absl::StrCat(base, "@ranks", 2 * stage, "..", 2 * stage + 1),
                 {ParamSpec{"w", 4, 8}, ParamSpec{"b", 4, 4}, ParamSpec{"p", 4, 4}}};
  spec.members = StageMembers(stage);
  return spec;
}

// Rank r's usage: stage 0 uses w (rank 1 also b), stage 1 uses p only.
std::vector<std::optional<DType>> UsageOf(int rank) {
  if (StageOf(rank) == 1) return {std::nullopt, std::nullopt, DType::kBFloat16};
  return {DType::kBFloat16, rank == 1 ? std::optional(DType::kBFloat16) : std::nullopt,
          std::nullopt};
}

std::vector<bool> IncludedIn(int stage) {
  return stage == 0 ? std::vector<bool>{true, true, false} : std::vector<bool>{false, false, true};
}

// Ranks are spread so that each sidecar serves one rank of each stage.
absl::StatusOr<std::unique_ptr<Client>> Connect(const LocalCluster& cluster, const std::string& job,
                                                int rank) {
  ClientOptions c;
  c.socket_path = cluster.sidecar_sockets()[rank % 2];
  c.job_id = job;
  c.rank = rank;
  c.world_size = kWorld;
  c.local_rank = rank / 2;
  c.connect_timeout = absl::Seconds(60);
  return Client::Connect(c);
}

std::vector<std::unique_ptr<Client>> ConnectAll(const LocalCluster& cluster,
                                                const std::string& job) {
  std::vector<std::unique_ptr<Client>> clients;
  for (int r = 0; r < kWorld; ++r) {
    absl::StatusOr<std::unique_ptr<Client>> c = Connect(cluster, job, r);
    EXPECT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
    if (!c.ok()) return {};
    clients.push_back(*std::move(c));
  }
  return clients;
}

// Registers the rank's stage groups one by one (each waits for its result),
// the FSDP group first on stage 0 and last on stage 1.
absl::Status RegisterStage(Client& c, int rank, absl::Time deadline) {
  const int stage = StageOf(rank);
  std::vector<GroupSpec> order = {StageGroup(stage, "fsdp/root"), StageGroup(stage, "~step")};
  if (stage == 1) std::swap(order[0], order[1]);
  for (const GroupSpec& spec : order) {
    if (absl::Status s = c.RegisterGroup(spec, Policy(), deadline); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Steps [first, last) of the rank's stage FSDP group; each decision must
// include exactly what the stage's members use.
absl::Status RunSteps(Client& c, int rank, int64_t first, int64_t last, absl::Time deadline) {
  const int stage = StageOf(rank);
  const std::string fsdp = StageGroup(stage, "fsdp/root").group_id;
  for (int64_t step = first; step < last; ++step) {
    absl::StatusOr<Decision> d =
        c.Wait(c.Submit(GroupSubmission{fsdp, step, UsageOf(rank)}), deadline);
    if (!d.ok()) return d.status();
    if (d->included != IncludedIn(stage)) {
      return absl::InternalError(absl::StrCat("rank ", rank, " step ", step,
                                              ": the decision includes other parameters than "
                                              "its stage's members use"));
    }
  }
  return absl::OkStatus();
}

// Runs `body(rank)` on a thread per rank in `ranks`; one status per rank.
template <typename Body>
std::vector<absl::Status> OnRanks(const std::vector<int>& ranks, const Body& body) {
  std::vector<absl::Status> out(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] { out[i] = body(ranks[i]); });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

class MembersTest : public ::testing::TestWithParam<bool> {};

TEST_P(MembersTest, EachStageRegistersAndDecidesAmongItsMembersInEitherOrder) {
  std::unique_ptr<LocalCluster> cluster = StartCluster(GetParam());
  ASSERT_NE(cluster, nullptr);
  std::vector<std::unique_ptr<Client>> clients = ConnectAll(*cluster, "stages");
  ASSERT_EQ(clients.size(), static_cast<size_t>(kWorld));
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  auto whole_run = [&](int r) -> absl::Status {
    if (absl::Status s = RegisterStage(*clients[r], r, deadline); !s.ok()) return s;
    return RunSteps(*clients[r], r, 0, kSteps, deadline);
  };
  // Stage 0 finishes before stage 1 registers anything: nothing of stage 0
  // waits for stage 1's ranks.
  for (const std::vector<int>& stage : {std::vector<int>{0, 1}, std::vector<int>{2, 3}}) {
    const std::vector<absl::Status> done = OnRanks(stage, whole_run);
    for (size_t i = 0; i < stage.size(); ++i) {
      EXPECT_TRUE(done[i].ok()) << "rank " << stage[i] << ": " << done[i];
    }
  }
  for (const std::unique_ptr<Client>& c : clients) {
    EXPECT_FALSE(c->WaitVerdict(absl::Now()).has_value()) << "the job did not fail";
  }
}

// Rank 1 stops submitting at step 1: its member rank 0 gets MISSING_RANKS
// naming it; stage 1's ranks, whose own steps were decided, and rank 1
// itself get the job's failure in the same words.
TEST_P(MembersTest, ASilentMemberIsNamedToItsMemberSetAndEveryRankGetsTheJobsFailure) {
  std::unique_ptr<LocalCluster> cluster = StartCluster(GetParam());
  ASSERT_NE(cluster, nullptr);
  std::vector<std::unique_ptr<Client>> clients = ConnectAll(*cluster, "silent");
  ASSERT_EQ(clients.size(), static_cast<size_t>(kWorld));
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  std::vector<absl::Status> ran = OnRanks({0, 1, 2, 3}, [&](int r) -> absl::Status {
    if (absl::Status s = RegisterStage(*clients[r], r, deadline); !s.ok()) return s;
    return RunSteps(*clients[r], r, 0, r == 1 ? 1 : 2, deadline);
  });
  const absl::Status& named = ran[0];
  ASSERT_FALSE(named.ok());
  EXPECT_EQ(wire::KindOf(named), v1::MISSING_RANKS) << named;
  EXPECT_THAT(named.message(), HasSubstr("rank 1 "));
  EXPECT_THAT(named.message(), HasSubstr("fsdp/root@ranks0..1"));
  for (int r : {1, 2, 3}) EXPECT_TRUE(ran[r].ok()) << "rank " << r << ": " << ran[r];
  for (int r = 0; r < kWorld; ++r) {
    std::optional<absl::Status> verdict = clients[r]->WaitVerdict(deadline);
    ASSERT_TRUE(verdict.has_value()) << "rank " << r << " never learned the job's failure";
    EXPECT_FALSE(verdict->ok());
    EXPECT_THAT(verdict->message(), HasSubstr(std::string(named.message())))
        << "rank " << r << ": " << *verdict;
    if (r >= 2) {
      EXPECT_EQ(wire::KindOf(*verdict), v1::JOB_FAILED) << "rank " << r << ": " << *verdict;
    }
  }
}

// Rank 1 leaves (its stream ends, as when its process is killed) while
// rank 0 waits for step 1: named at once to rank 0; the other stage's
// ranks get the job's failure.
TEST_P(MembersTest, AMemberThatLeavesMidStepIsNamedAtOnceAndTheOtherStageGetsTheFailure) {
  std::unique_ptr<LocalCluster> cluster = StartCluster(GetParam());
  ASSERT_NE(cluster, nullptr);
  std::vector<std::unique_ptr<Client>> clients = ConnectAll(*cluster, "leaves");
  ASSERT_EQ(clients.size(), static_cast<size_t>(kWorld));
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  std::vector<absl::Status> ran = OnRanks({0, 1, 2, 3}, [&](int r) -> absl::Status {
    if (absl::Status s = RegisterStage(*clients[r], r, deadline); !s.ok()) return s;
    return RunSteps(*clients[r], r, 0, 1, deadline);
  });
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(ran[r].ok()) << "rank " << r << ": " << ran[r];
  const DecisionFuture waiting =
      clients[0]->Submit(GroupSubmission{StageGroup(0, "fsdp/root").group_id, 1, UsageOf(0)});
  clients[1].reset();
  absl::StatusOr<Decision> named = clients[0]->Wait(waiting, deadline);
  ASSERT_FALSE(named.ok());
  EXPECT_EQ(wire::KindOf(named.status()), v1::MISSING_RANKS) << named.status();
  EXPECT_THAT(named.status().message(), HasSubstr("rank 1 "));
  for (int r : {2, 3}) {
    std::optional<absl::Status> verdict = clients[r]->WaitVerdict(deadline);
    ASSERT_TRUE(verdict.has_value()) << "rank " << r << " never learned the job's failure";
    EXPECT_EQ(wire::KindOf(*verdict), v1::JOB_FAILED) << *verdict;
    EXPECT_THAT(verdict->message(), HasSubstr(std::string(named.status().message())));
  }
}

INSTANTIATE_TEST_SUITE_P(DirectAndBehindARelay, MembersTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? std::string("BehindARelay") : std::string("Direct");
                         });

}  // namespace
}  // namespace accord::testing
