// Soak: one coordinator, 2 sidecars, 8 single-rank processes plus 4
// processes of 16 rank threads each (72 ranks, each its own connection),
// running many steps of seeded random usage and dtypes across 4 groups.
// Checks: every rank got exactly one decision per (group, step) and the same
// digest of all of them; the daemons' resident memory after the run is
// within a fixed slack of what it was once the job was warm.
#include <algorithm>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::testing {
namespace {

constexpr int kSingles = 8;
constexpr int kMultis = 4;
constexpr int kThreads = 16;
constexpr int kWorld = kSingles + kMultis * kThreads;
constexpr int kGroups = 4;
// Resident memory may grow this much over a run (allocator caches, gRPC
// buffers that grew to their working size); a leak per step or per decision
// over thousands of steps exceeds it.
constexpr int64_t kRssSlackKiB = 16 * 1024;

int Steps() {
  int steps = 4000;
  if (const char* e = getenv("ACCORD_SOAK_STEPS"); e != nullptr) (void)absl::SimpleAtoi(e, &steps);
  return steps;
}

// "Start" memory is read at this step: after the coordinator's observe usage
// window (the last 1000 steps per group, CoordinatorOptions.usage_window_steps)
// has filled, since growing into that bounded window is by design.
int WarmStep(int steps) { return std::min(1200, steps / 2); }

int64_t RssKiB(int pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      int64_t kib = 0;
      (void)absl::SimpleAtoi(std::regex_replace(line, std::regex("[^0-9]"), ""), &kib);
      return kib;
    }
  }
  return -1;
}

TEST(SoakTest, ManyRanksManyStepsAgreeAndDaemonMemoryStaysFlat) {
  LocalClusterOptions o;
  o.num_sidecars = 2;
  o.echo = false;
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  LocalCluster& cluster = **c;
  const int steps = Steps();
  const absl::Time start = absl::Now();

  // Ranks 0..7 alternate between the sidecars; the threaded processes too.
  std::vector<std::unique_ptr<ChildProcess>> procs;
  auto spawn = [&](int first, int threads, int sidecar) {
    std::vector<std::string> argv = {ACCORD_SOAK_RANK,
                                     "--socket=" + cluster.sidecar_sockets()[sidecar],
                                     absl::StrCat("--first_rank=", first),
                                     absl::StrCat("--threads=", threads),
                                     absl::StrCat("--world=", kWorld),
                                     absl::StrCat("--groups=", kGroups),
                                     absl::StrCat("--steps=", steps),
                                     absl::StrCat("--warm_step=", WarmStep(steps)),
                                     "--seed=20240611"};
    absl::StatusOr<std::unique_ptr<ChildProcess>> p =
        ChildProcess::Spawn(argv, absl::StrCat("soak", first), /*echo=*/false);
    ASSERT_TRUE(p.ok()) << p.status();
    procs.push_back(*std::move(p));
  };
  for (int r = 0; r < kSingles; ++r) spawn(r, 1, r % 2);
  for (int k = 0; k < kMultis; ++k) spawn(kSingles + k * kThreads, kThreads, k % 2);
  ASSERT_EQ(procs.size(), static_cast<size_t>(kSingles + kMultis));

  // "Start" memory: once the job is warm (every rank connected, groups
  // registered, the usage window full; see WarmStep).
  ASSERT_TRUE(procs[0]->WaitForLine("soak warm", absl::Now() + absl::Seconds(120)).ok())
      << procs[0]->Output();
  const int64_t coord_start = RssKiB(cluster.coordinator_pid());
  const int64_t side_start[2] = {RssKiB(cluster.sidecar_pid(0)), RssKiB(cluster.sidecar_pid(1))};

  std::map<std::string, int> digests;
  for (auto& p : procs) {
    absl::StatusOr<int> code = p->Wait(absl::Now() + absl::Seconds(600));
    ASSERT_TRUE(code.ok()) << code.status();
    const std::string out = p->FinalOutput();
    EXPECT_EQ(*code, 0) << out;
    std::regex re("soak rank (\\d+) decisions (\\d+) digest ([0-9a-f]+)");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
         ++it) {
      EXPECT_EQ(std::stoll((*it)[2]), static_cast<int64_t>(steps) * kGroups)
          << "rank " << (*it)[1] << ": decisions lost or duplicated";
      ++digests[(*it)[3]];
    }
  }
  const int64_t coord_end = RssKiB(cluster.coordinator_pid());
  const int64_t side_end[2] = {RssKiB(cluster.sidecar_pid(0)), RssKiB(cluster.sidecar_pid(1))};
  ASSERT_EQ(digests.size(), 1u) << "ranks disagree";
  EXPECT_EQ(digests.begin()->second, kWorld);

  printf("soak: %d ranks (%d processes), %d steps x %d groups = %lld decisions per rank in %s\n",
         kWorld, kSingles + kMultis, steps, kGroups, static_cast<long long>(steps) * kGroups,
         absl::FormatDuration(absl::Now() - start).c_str());
  printf(
      "soak: VmRSS KiB coordinator %lld -> %lld, sidecar0 %lld -> %lld, sidecar1 %lld -> %lld"
      " (slack %lld)\n",
      static_cast<long long>(coord_start), static_cast<long long>(coord_end),
      static_cast<long long>(side_start[0]), static_cast<long long>(side_end[0]),
      static_cast<long long>(side_start[1]), static_cast<long long>(side_end[1]),
      static_cast<long long>(kRssSlackKiB));
  EXPECT_LE(coord_end, coord_start + kRssSlackKiB);
  EXPECT_LE(side_end[0], side_start[0] + kRssSlackKiB);
  EXPECT_LE(side_end[1], side_start[1] + kRssSlackKiB);
}

}  // namespace
}  // namespace accord::testing
