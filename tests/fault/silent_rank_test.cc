// Silent ranks through the real daemons: a rank that is alive but never
// submits a step is named to every rank of the job within the coordinator's
// --deadline plus its progress grace, whatever its placement (alone on its
// node, beside node-mates that submitted, or with every node holding a
// silent rank), and a rank that skips a step after a coordinator restart
// fails the job as a whole with an error saying it skipped the step. See
// docs/ARCHITECTURE.md, "Silent ranks", and docs/RELIABILITY.md.
//
// Silent ranks are held at a FIFO gate (no timer); each rank prints the wall
// time of its submission and of its error (--print_times), from which the
// test checks the bound and prints the measured time.
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fault/gate.h"

namespace accord::testing {
namespace {

constexpr absl::Duration kDeadline = absl::Seconds(2);
// The coordinator's progress grace: min(1 s, deadline / 4).
constexpr absl::Duration kGrace = absl::Milliseconds(500);
// Scheduling on a loaded 2-core CI machine (and the sanitizer builds): the
// error must arrive within deadline + grace + kSlack of the step's first
// submission, and not before the deadline (less kEarly for print latency).
constexpr absl::Duration kSlack = absl::Milliseconds(1500);
constexpr absl::Duration kEarly = absl::Milliseconds(100);

class SilentRankTest : public ::testing::Test {
 protected:
  void StartCluster(int sidecars) {
    LocalClusterOptions o;
    o.num_sidecars = sidecars;
    o.coordinator_flags = {absl::StrCat("--deadline=", absl::FormatDuration(kDeadline))};
    o.sidecar_flags = {"--reconnect_max_backoff=500ms"};
    absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
  }

  std::vector<std::string> Command(const std::vector<int>& gated, int gate_step,
                                   const std::vector<std::string>& extra) {
    std::vector<std::string> cmd = {ACCORD_RANK_SCENARIO,
                                    "--socket={socket}",
                                    "--rank={rank}",
                                    "--world={world}",
                                    "--job={job}",
                                    "--local_rank={local_rank}",
                                    "--wait=30s",
                                    "--groups=1",
                                    "--params=2",
                                    "--print_times",
                                    absl::StrCat("--gate_ranks=", absl::StrJoin(gated, ",")),
                                    absl::StrCat("--gate_step=", gate_step),
                                    "--gate_fifo=" + gate_.path()};
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    return cmd;
  }

  // Starts `world` ranks, `gated` held before `step`; returns once those
  // wait at the gate and every other rank submitted `step`.
  std::vector<std::unique_ptr<ChildProcess>> StartWithGated(int world, const std::string& job,
                                                            const std::vector<int>& gated, int step,
                                                            std::vector<std::string> extra = {}) {
    absl::StatusOr<std::vector<std::unique_ptr<ChildProcess>>> procs =
        cluster_->StartRanks(Command(gated, step, extra), world, job);
    EXPECT_TRUE(procs.ok()) << procs.status();
    if (!procs.ok()) return {};
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    for (int r = 0; r < world; ++r) {
      const bool is_gated = std::find(gated.begin(), gated.end(), r) != gated.end();
      const std::string line = is_gated ? absl::StrCat("rank ", r, " waiting at gate step ", step)
                                        : absl::StrCat("rank ", r, " step ", step, " submitted");
      absl::StatusOr<std::string> got = (*procs)[r]->WaitForLine(line, deadline);
      EXPECT_TRUE(got.ok()) << got.status();
    }
    return *std::move(procs);
  }

  // The first "error CODE: message" a rank printed.
  static std::string FirstError(const std::string& output) {
    std::smatch m;
    if (std::regex_search(output, m, std::regex(": error ([A-Z_]+: [^\n]*)"))) return m[1];
    return "";
  }

  // The wall time (Unix ms) of "rank R time WHAT step S at_ms T"; -1: none.
  static int64_t TimeOf(const std::string& output, const std::string& what, int step) {
    std::smatch m;
    const std::regex re(absl::StrCat("rank \\d+ time ", what, " step ", step, " at_ms (\\d+)"));
    int64_t t = -1;
    if (std::regex_search(output, m, re)) (void)absl::SimpleAtoi(m[1].str(), &t);
    return t;
  }

  // The message every rank must get for a step that `missing` did not
  // submit and `submitted` did.
  static std::string Expected(const std::string& job, int step, const std::string& missing,
                              const std::string& who, const std::string& submitted) {
    return absl::StrCat("DEADLINE_EXCEEDED: job ", job, " group \"g0\" step ", step,
                        ": not every rank reported within ", absl::FormatDuration(kDeadline),
                        " of the step's first submission (--deadline); missing ranks ", missing,
                        ": ", who, "; ranks ", submitted,
                        " submitted it. Check the missing ranks' processes and their sidecars' "
                        "logs; the job is failed");
  }

  // Every rank in `waiting` (those that submitted `step` and wait for its
  // decision) gets `expected`, within the bound of the step's first
  // submission. Returns the slowest arrival, which the test prints.
  absl::Duration ExpectNamedInTime(std::vector<std::unique_ptr<ChildProcess>>& procs,
                                   const std::vector<int>& waiting, int step,
                                   const std::string& expected) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    int64_t first_submit = -1;
    for (int r : waiting) {
      EXPECT_TRUE(procs[r]->WaitForLine(absl::StrCat("rank ", r, " time error"), give_up).ok())
          << "rank " << r << " got no error:\n"
          << procs[r]->Output();
      const int64_t t = TimeOf(procs[r]->Output(), "submitted", step);
      EXPECT_GE(t, 0) << procs[r]->Output();
      if (t >= 0 && (first_submit < 0 || t < first_submit)) first_submit = t;
    }
    absl::Duration slowest = absl::ZeroDuration();
    for (int r : waiting) {
      const std::string out = procs[r]->Output();
      EXPECT_EQ(FirstError(out), expected) << "rank " << r << ":\n" << out;
      const int64_t t = TimeOf(out, "error", step);
      const absl::Duration took = absl::Milliseconds(t - first_submit);
      EXPECT_GE(took, kDeadline - kEarly) << "rank " << r << " failed before the deadline";
      EXPECT_LE(took, kDeadline + kGrace + kSlack)
          << "rank " << r << " named the silent rank too late";
      slowest = std::max(slowest, took);
    }
    return slowest;
  }

  // Releases the gated ranks: each submits the failed step and gets the same
  // error from its sidecar at once.
  void ExpectGatedGetTheSameError(std::vector<std::unique_ptr<ChildProcess>>& procs,
                                  const std::vector<int>& gated, const std::string& expected) {
    ASSERT_TRUE(gate_.Release());
    std::vector<RankResult> results =
        LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(60));
    for (int r : gated) {
      EXPECT_NE(results[r].exit_code, 0) << results[r].output;
      EXPECT_EQ(FirstError(results[r].output), expected) << "rank " << r << ":\n"
                                                         << results[r].output;
    }
  }

  static void Report(const std::string& topology, absl::Duration took) {
    std::printf("[timing] %s: silent rank named after %s (deadline %s, grace %s)\n",
                topology.c_str(), absl::FormatDuration(took).c_str(),
                absl::FormatDuration(kDeadline).c_str(), absl::FormatDuration(kGrace).c_str());
    std::fflush(stdout);
  }

  Gate gate_;
  std::unique_ptr<LocalCluster> cluster_;
};

// Two nodes, one rank each: rank 1 (alone on node1) never submits step 1.
TEST_F(SilentRankTest, AloneOnItsNodeIsNamedToEveryRankWithinTheDeadline) {
  StartCluster(2);
  auto procs = StartWithGated(/*world=*/2, "alone", /*gated=*/{1}, /*step=*/1);
  ASSERT_EQ(procs.size(), 2u);
  const std::string expected =
      Expected("alone", 1, "1", "rank 1 (last step 0, node \"node1\")", "0");
  Report("alone on its node", ExpectNamedInTime(procs, {0}, 1, expected));
  ExpectGatedGetTheSameError(procs, {1}, expected);
}

// One node, three ranks: rank 1 never submits step 1 while its node-mates
// did, so no node manifest for step 1 ever leaves the node; the sidecar's
// partial-step report starts the coordinator's clock.
TEST_F(SilentRankTest, BesideNodeMatesThatSubmittedIsNamedToEveryRankWithinTheDeadline) {
  StartCluster(1);
  auto procs = StartWithGated(/*world=*/3, "beside", /*gated=*/{1}, /*step=*/1);
  ASSERT_EQ(procs.size(), 3u);
  const std::string expected =
      Expected("beside", 1, "1", "rank 1 (last step 0, node \"node0\")", "0,2");
  Report("beside node-mates that submitted", ExpectNamedInTime(procs, {0, 2}, 1, expected));
  ExpectGatedGetTheSameError(procs, {1}, expected);
}

// Two nodes of two ranks, one silent rank on each: no node sends a manifest
// for step 1.
TEST_F(SilentRankTest, OneOnEveryNodeAreAllNamedToEveryRankWithinTheDeadline) {
  StartCluster(2);
  auto procs = StartWithGated(/*world=*/4, "every", /*gated=*/{1, 3}, /*step=*/1);
  ASSERT_EQ(procs.size(), 4u);
  const std::string expected =
      Expected("every", 1, "1,3",
               "rank 1 (last step 0, node \"node0\"), rank 3 (last step 0, node \"node1\")", "0,2");
  Report("a silent rank on every node", ExpectNamedInTime(procs, {0, 2}, 1, expected));
  ExpectGatedGetTheSameError(procs, {1, 3}, expected);
}

// The coordinator is killed and restarted between steps 1 and 2; then rank 1
// skips step 2 (its counter moved on) and submits step 3 while rank 0
// submits step 2. Nothing can ever complete step 2, so the job fails as a
// whole: rank 0 (waiting for step 2) gets MISSING_RANKS saying rank 1
// skipped it, rank 1 (waiting for step 3) the same message as JOB_FAILED.
TEST_F(SilentRankTest, StepSkippedAfterACoordinatorRestartFailsTheWholeJobNamingTheSkipper) {
  StartCluster(1);
  auto procs = StartWithGated(/*world=*/2, "skip", /*gated=*/{0, 1}, /*step=*/2,
                              {"--steps=5", "--skip_rank=1", "--skip_step=2"});
  ASSERT_EQ(procs.size(), 2u);
  cluster_->KillCoordinator();
  ASSERT_TRUE(cluster_->RestartCoordinator().ok());
  ASSERT_TRUE(gate_.Release());
  const std::string expected = Expected(
      "skip", 2, "1", "rank 1 (last step 3, node \"node0\", past this step: it skipped it)", "0");
  Report("a step skipped after a coordinator restart", ExpectNamedInTime(procs, {0}, 2, expected));
  std::vector<RankResult> results = LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(60));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_THAT(results[1].output, ::testing::HasSubstr("rank 1 skips step 2"));
  EXPECT_THAT(results[1].output, ::testing::HasSubstr("rank 1 step 3 group g0: error"));
  EXPECT_EQ(FirstError(results[1].output), expected) << results[1].output;
  for (const RankResult& r : results) EXPECT_NE(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace accord::testing
