// Release coalescing by sync_key through the real daemons (docs/MEMBERS.md
// 2.11, "One record per node per step"): a coordinator and two sidecars as
// processes, in-process ranks of a TP 2 x DP 4 job (world 8). Sidecar s
// serves ranks 4s..4s+3, so each node holds ranks of both dp member sets
// ({0, 2, 4, 6} and {1, 3, 5, 7}). With one sync_key on every rank's release
// each node sends one batch per step, and the steady step arrives at the
// coordinator as one batch repeat per node (its batches= and batch_repeats=
// counts, printed at exit); without a key each member set goes up on its own.
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::testing {
namespace {

constexpr int kWorld = 8;
constexpr int kNodes = 2;
constexpr int kSteps = 20;

std::unique_ptr<LocalCluster> StartCluster() {
  LocalClusterOptions o;
  o.num_sidecars = kNodes;
  o.coordinator_flags = {"--metrics_port=-1", "--deadline=20s"};
  o.sidecar_flags = {"--metrics_port=-1"};
  o.echo = false;
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Rank r's dp group: the ranks of its TP coordinate.
GroupSpec DpGroup(int rank) {
  const int tp = rank % 2;
  GroupSpec spec{absl::StrCat("fsdp/root@ranks", tp, "..", tp + 6, "/2"),
                 {ParamSpec{"w", 4, 8}, ParamSpec{"b", 4, 4}}};
  spec.members = std::make_shared<const MemberSet>(
      *MemberSet::FromRanks({tp, tp + 2, tp + 4, tp + 6}, kWorld));
  return spec;
}

// Registers, then runs every step as one release batch with `sync_key`,
// waiting for each decision before the next step.
absl::Status RunRank(const LocalCluster& cluster, int rank, uint64_t sync_key) {
  ClientOptions o;
  o.socket_path = cluster.sidecar_sockets()[rank / 4];
  o.job_id = absl::StrCat("sync-", sync_key);
  o.rank = rank;
  o.world_size = kWorld;
  o.local_rank = rank % 4;
  o.connect_timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  if (!c.ok()) return c.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  const GroupSpec spec = DpGroup(rank);
  if (absl::Status s = (*c)->RegisterGroup(spec, Policy(), deadline); !s.ok()) return s;
  for (int64_t step = 0; step < kSteps; ++step) {
    std::vector<DecisionFuture> f = (*c)->SubmitBatch(
        {GroupSubmission{spec.group_id, step, {DType::kBFloat16, std::nullopt}}}, sync_key);
    absl::StatusOr<Decision> d = (*c)->Wait(f[0], deadline);
    if (!d.ok()) return d.status();
  }
  return absl::OkStatus();
}

// The value of `name=` in the coordinator's exit stats line.
int64_t Stat(const std::string& output, const std::string& name) {
  const std::string needle = absl::StrCat(" ", name, "=");
  const size_t at = output.rfind(needle);
  if (at == std::string::npos) return -1;
  const size_t begin = at + needle.size();
  const size_t end = output.find_first_not_of("0123456789", begin);
  int64_t v = -1;
  if (!absl::SimpleAtoi(output.substr(begin, end - begin), &v)) return -1;
  return v;
}

struct Counts {
  int64_t batches = -1;
  int64_t batch_repeats = -1;
};

Counts RunJob(uint64_t sync_key) {
  std::unique_ptr<LocalCluster> cluster = StartCluster();
  if (cluster == nullptr) return {};
  std::vector<absl::Status> done(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] { done[r] = RunRank(*cluster, r, sync_key); });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(done[r].ok()) << "rank " << r << ": " << done[r];
  const std::string out = cluster->StopCoordinator();
  return Counts{Stat(out, "batches"), Stat(out, "batch_repeats")};
}

TEST(SyncKeyTest, SteadyStepsArriveAsOneBatchRepeatPerNode) {
  const Counts c = RunJob(0x5eed);
  ASSERT_GE(c.batches, 0) << "no stats line from the coordinator";
  // The first steps may go up per member set: a class is the ranks that
  // sent its key so far, and these ranks are not coupled as TP peers are
  // (one member set may run a step ahead before the other's ranks sent
  // their first release). Then one batch per node per step, a batch repeat
  // from the second on.
  EXPECT_LE(c.batches + c.batch_repeats, kNodes * (kSteps + 3))
      << c.batches << " batches, " << c.batch_repeats << " batch repeats";
  EXPECT_GE(c.batch_repeats, kNodes * (kSteps - 4))
      << c.batches << " batches, " << c.batch_repeats << " batch repeats";
}

TEST(SyncKeyTest, WithoutAKeyEachMemberSetGoesUpOnItsOwn) {
  const Counts c = RunJob(0);
  ASSERT_GE(c.batches, 0) << "no stats line from the coordinator";
  EXPECT_EQ(c.batches + c.batch_repeats, 2 * kNodes * kSteps);
}

}  // namespace
}  // namespace accord::testing
