// Faults around a relay, through the real daemons (docs/RELIABILITY.md,
// "Relay faults"): a silent rank behind a relay is named to every rank with
// the exact error and within the deadline bound; a relay killed mid-step and
// restarted on its address resumes the job with the same decisions, and so
// does a coordinator restarted behind relays; a relay
// killed for good gives the other relays' ranks one UNAVAILABLE naming it;
// a coordinator killed for good behind relays ends every rank at the relays'
// --upstream_loss_limit with one error;
// a relay whose upstream connection is cut (decisions lost on the way)
// loses nothing. Ranks are held before a step at a FIFO gate; nothing waits
// on a timer.
#include <signal.h>

#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fault/cuttable_proxy.h"
#include "tests/fault/gate.h"

namespace accord::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 8;

class RelayFaultTest : public ::testing::Test {
 protected:
  // `sidecars` sidecars, `per_relay` of them behind each relay.
  void StartCluster(int sidecars, int per_relay, std::vector<std::string> coordinator_flags = {},
                    std::vector<std::string> relay_flags = {}) {
    LocalClusterOptions o;
    o.num_sidecars = sidecars;
    o.sidecars_per_relay = per_relay;
    o.coordinator_flags = std::move(coordinator_flags);
    o.sidecar_flags = {"--reconnect_max_backoff=500ms"};
    o.relay_flags = {"--reconnect_max_backoff=500ms"};
    o.relay_flags.insert(o.relay_flags.end(), relay_flags.begin(), relay_flags.end());
    absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
  }

  std::vector<std::string> Command(const std::vector<int>& gated, int step,
                                   const std::vector<std::string>& extra) const {
    std::vector<std::string> cmd = {ACCORD_RANK_SCENARIO,
                                    "--socket={socket}",
                                    "--rank={rank}",
                                    "--world={world}",
                                    "--job={job}",
                                    "--local_rank={local_rank}",
                                    "--wait=30s",
                                    absl::StrCat("--gate_ranks=", absl::StrJoin(gated, ",")),
                                    absl::StrCat("--gate_step=", step),
                                    "--gate_fifo=" + gate_.path()};
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    return cmd;
  }

  // Starts `world` ranks with `gated` held before `step`; returns once those
  // wait at the gate and every other rank submitted `step`.
  std::vector<std::unique_ptr<ChildProcess>> StartGated(int world, const std::string& job,
                                                        const std::vector<int>& gated, int step,
                                                        const std::vector<std::string>& extra) {
    absl::StatusOr<std::vector<std::unique_ptr<ChildProcess>>> procs =
        cluster_->StartRanks(Command(gated, step, extra), world, job);
    EXPECT_TRUE(procs.ok()) << procs.status();
    if (!procs.ok()) return {};
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    for (int r = 0; r < world; ++r) {
      const bool is_gated = std::find(gated.begin(), gated.end(), r) != gated.end();
      const std::string line = is_gated ? absl::StrCat("rank ", r, " waiting at gate")
                                        : absl::StrCat("rank ", r, " step ", step, " submitted");
      absl::StatusOr<std::string> got = (*procs)[r]->WaitForLine(line, deadline);
      EXPECT_TRUE(got.ok()) << got.status();
    }
    return *std::move(procs);
  }

  std::vector<RankResult> Run(const std::vector<std::string>& flags, const std::string& job) {
    absl::StatusOr<std::vector<RankResult>> r =
        cluster_->RunRanks(Command({}, -1, flags), kWorld, job, absl::Seconds(90));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : std::vector<RankResult>();
  }

  static std::string Digest(const RankResult& r) {
    std::smatch m;
    if (std::regex_search(r.output, m, std::regex("rank \\d+ digest ([0-9a-f]+)"))) return m[1];
    return "";
  }

  static std::string FirstError(const std::string& output) {
    std::smatch m;
    if (std::regex_search(output, m, std::regex(": error ([A-Z_]+: [^\n]*)"))) return m[1];
    return "";
  }

  static void ExpectAllSucceededWith(const std::vector<RankResult>& results,
                                     const std::string& digest) {
    ASSERT_EQ(results.size(), static_cast<size_t>(kWorld));
    for (const RankResult& r : results) {
      EXPECT_EQ(r.exit_code, 0) << "rank " << r.rank << ":\n" << r.output;
      EXPECT_EQ(Digest(r), digest) << "rank " << r.rank << " decided differently:\n" << r.output;
    }
  }

  // The undisturbed run's digest, which the faulty run must reproduce.
  void RunReference(std::string* digest) {
    std::vector<RankResult> ref = Run(kFlags, "reference");
    ASSERT_EQ(ref.size(), static_cast<size_t>(kWorld));
    *digest = Digest(ref[0]);
    ASSERT_FALSE(digest->empty()) << ref[0].output;
    ExpectAllSucceededWith(ref, *digest);
  }

  const std::vector<std::string> kFlags = {"--steps=4", "--groups=2",
                                           "--rules=1:0:*:none 4:3:1:bfloat16 6:2:2:none"};
  Gate gate_;
  std::unique_ptr<LocalCluster> cluster_;
};

// Two sidecars of two ranks behind one relay; rank 3 never submits step 1.
// Its node-mate and the other node did, so the relay's partial report
// starts the coordinator's clock, and its progress answer (asked of the
// sidecar that did not contribute) names rank 3 with its own last step.
TEST_F(RelayFaultTest, SilentRankBehindARelayIsNamedToEveryRankWithinTheDeadline) {
  constexpr absl::Duration kDeadline = absl::Seconds(2);
  const absl::Duration kBound = kDeadline + absl::Milliseconds(500) + absl::Milliseconds(1500);
  StartCluster(2, 2, {"--deadline=2s"});
  auto procs = StartGated(/*world=*/4, "silent", /*gated=*/{3}, /*step=*/1,
                          {"--groups=1", "--params=2", "--print_times"});
  ASSERT_EQ(procs.size(), 4u);
  const std::string expected =
      "DEADLINE_EXCEEDED: job silent group \"g0\" step 1: not every rank reported within 2s of "
      "the step's first submission (--deadline); missing ranks 3: rank 3 (last step 0, node "
      "\"node1\"); ranks 0-2 submitted it. Check the missing ranks' processes and their "
      "sidecars' logs; the job is failed";
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(procs[r]->WaitForLine(absl::StrCat("rank ", r, " time error"), give_up).ok())
        << procs[r]->Output();
    EXPECT_EQ(FirstError(procs[r]->Output()), expected) << "rank " << r;
    std::smatch sub, err;
    const std::string out = procs[r]->Output();
    ASSERT_TRUE(std::regex_search(out, sub, std::regex("time submitted step 1 at_ms (\\d+)")));
    ASSERT_TRUE(std::regex_search(out, err, std::regex("time error step 1 at_ms (\\d+)")));
    const absl::Duration took = absl::Milliseconds(std::stoll(err[1]) - std::stoll(sub[1]));
    EXPECT_LE(took, kBound) << "rank " << r;
    std::printf("[timing] silent rank behind a relay: rank %d got the error after %s\n", r,
                absl::FormatDuration(took).c_str());
  }
  ASSERT_TRUE(gate_.Release());
  std::vector<RankResult> results = LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(60));
  EXPECT_EQ(FirstError(results[3].output), expected) << results[3].output;
}

// Resume: a relay killed (SIGKILL) while its ranks wait for step 2, and
// restarted on its address within --node_reconnect_grace, takes the job
// over; every rank gets the decisions of the undisturbed run.
TEST_F(RelayFaultTest, RelayKilledMidStepAndRestartedGivesEveryRankTheSameDecisions) {
  StartCluster(4, 2);
  std::string digest;
  ASSERT_NO_FATAL_FAILURE(RunReference(&digest));
  auto procs = StartGated(kWorld, "faulty", /*gated=*/{2}, /*step=*/2, kFlags);
  ASSERT_EQ(procs.size(), static_cast<size_t>(kWorld));
  cluster_->KillRelay(0);
  ASSERT_TRUE(cluster_->RestartRelay(0).ok());
  ASSERT_TRUE(gate_.Release());
  ExpectAllSucceededWith(LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(90)), digest);
}

// The coordinator killed while the relays' ranks wait for step 2 and
// restarted on its address: each relay reconnects, resends its hello
// (RESUME), its registrations merged and its undecided merged manifests; the
// sidecars behind it notice nothing. Same decisions as undisturbed.
TEST_F(RelayFaultTest, CoordinatorKilledMidStepAndRestartedBehindRelaysGivesTheSameDecisions) {
  StartCluster(4, 2);
  std::string digest;
  ASSERT_NO_FATAL_FAILURE(RunReference(&digest));
  auto procs = StartGated(kWorld, "faulty", /*gated=*/{5}, /*step=*/2, kFlags);
  ASSERT_EQ(procs.size(), static_cast<size_t>(kWorld));
  cluster_->KillCoordinator();
  ASSERT_TRUE(cluster_->RestartCoordinator().ok());
  ASSERT_TRUE(gate_.Release());
  ExpectAllSucceededWith(LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(90)), digest);
  EXPECT_THAT(cluster_->RelayOutput(0), HasSubstr("reconnecting"));
}

// A relay killed for good: past the coordinator's --node_reconnect_grace the
// ranks behind the other relay get one UNAVAILABLE naming the lost relay
// and its ranks (those behind it cannot be told: their path is gone).
TEST_F(RelayFaultTest, RelayKilledForGoodIsNamedToTheOtherRelaysRanks) {
  StartCluster(4, 2, {"--deadline=30s", "--node_reconnect_grace=1s"});
  auto procs = StartGated(kWorld, "lost", /*gated=*/{6}, /*step=*/1, kFlags);
  ASSERT_EQ(procs.size(), static_cast<size_t>(kWorld));
  cluster_->KillRelay(1);
  ASSERT_TRUE(gate_.Release());
  const std::string expected =
      "UNAVAILABLE: job lost group \"g0\" step 1: node \"relay1\" (ranks 4-7) lost its "
      "connection to the coordinator and did not come back within 1s (--node_reconnect_grace), "
      "so its ranks cannot take part: its sidecar did not come back in time or its host is "
      "unreachable; restart the job";
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(procs[r]->WaitForLine("error UNAVAILABLE", absl::Now() + absl::Seconds(30)).ok())
        << procs[r]->Output();
    EXPECT_EQ(FirstError(procs[r]->Output()), expected) << "rank " << r;
  }
  for (int r = 4; r < kWorld; ++r) kill(procs[r]->pid(), SIGKILL);
  LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(30));
}

// A sidecar behind a relay killed for good: past the relay's grace its
// ranks go up as leaves that name it (the coordinator knows them as the
// relay's ranks), so the error every other rank gets says which sidecar was
// lost, not "relay0".
TEST_F(RelayFaultTest, ASidecarLostBehindARelayIsNamedByTheErrorTheOtherRanksGet) {
  StartCluster(2, 2, {"--deadline=30s"}, {"--node_reconnect_grace=1s"});
  auto procs = StartGated(/*world=*/4, "lost", /*gated=*/{3}, /*step=*/1, {"--groups=1"});
  ASSERT_EQ(procs.size(), 4u);
  cluster_->KillSidecar(1);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(procs[r]->WaitForLine(": error ", absl::Now() + absl::Seconds(20)).ok())
        << procs[r]->Output();
    EXPECT_THAT(FirstError(procs[r]->Output()),
                HasSubstr("rank 2 left (its sidecar on node \"node1\" lost its stream to relay "
                          "\"relay0\" and did not come back within 1s (the relay's "
                          "--node_reconnect_grace))"))
        << "rank " << r;
  }
  for (int r = 2; r < 4; ++r) kill(procs[r]->pid(), SIGKILL);
  LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(30));
}

// The coordinator killed for good behind relays (docs/RELIABILITY.md, "Node
// above lost"): the sidecars hear from their relay, so only the relay can
// count the coordinator's silence; past its --upstream_loss_limit every rank,
// the one held at a gate included, ends with the words a sidecar connected
// to the coordinator would use, long before the ranks' own 30 s waits.
TEST_F(RelayFaultTest, CoordinatorKilledForGoodBehindRelaysEndsEveryRankWithOneErrorAtTheLimit) {
  StartCluster(4, 2, {}, {"--upstream_loss_limit=2s"});
  auto procs = StartGated(kWorld, "lost", /*gated=*/{6}, /*step=*/1, kFlags);
  ASSERT_EQ(procs.size(), static_cast<size_t>(kWorld));
  const absl::Time killed = absl::Now();
  cluster_->KillCoordinator();
  for (int r = 0; r < kWorld; ++r) {
    if (r == 6) continue;
    ASSERT_TRUE(procs[r]->WaitForLine("error UNAVAILABLE", absl::Now() + absl::Seconds(20)).ok())
        << procs[r]->Output();
  }
  // The limit (2 s) + the relay's reconnect backoff (0.5 s) + slack.
  EXPECT_LT(absl::Now() - killed, absl::Seconds(15));
  ASSERT_TRUE(gate_.Release());
  std::vector<RankResult> results = LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(60));
  ASSERT_EQ(results.size(), static_cast<size_t>(kWorld));
  // Each rank's closing key-value Set ends at once too: the relay's
  // forwarder refuses it with the loss's words, and the sidecar below passes
  // that answer on instead of sending the call again (their own waits are
  // 30 s each).
  EXPECT_LT(absl::Now() - killed, absl::Seconds(20));
  const std::string expected =
      "UNAVAILABLE: job lost: the coordinator (or relay) this rank's sidecar reports to has not "
      "answered for 2s (--upstream_loss_limit), so no registration result, decision or key can "
      "reach the job's ranks; the job is failed. Check that the coordinator runs and that the "
      "nodes reach it, and the sidecars' logs";
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_NE(results[r].exit_code, 0) << results[r].output;
    EXPECT_EQ(FirstError(results[r].output), expected) << "rank " << r << ":\n"
                                                       << results[r].output;
    // Through the relay and the sidecar: the same words, unprefixed.
    EXPECT_THAT(results[r].output,
                HasSubstr(absl::StrCat("rank ", r, " done key refused ", expected, "\n")));
  }
  EXPECT_THAT(cluster_->RelayOutput(0), HasSubstr("--upstream_loss_limit"));
}

// The relay's upstream goes through a proxy. What the coordinator sends to
// the relay is dropped while step 2 is decided, then the connection is cut:
// the relay reconnects, resends its undecided manifests, gets the decision
// again and fans it out.
TEST_F(RelayFaultTest, RelayCutOffFromTheCoordinatorLosesNoDecision) {
  StartCluster(1, 0);
  const std::string port =
      cluster_->coordinator_address().substr(cluster_->coordinator_address().rfind(':') + 1);
  CuttableProxy proxy(port);
  absl::StatusOr<int> relay = cluster_->AddRelay(proxy.address());
  ASSERT_TRUE(relay.ok()) << relay.status();
  absl::StatusOr<int> behind = cluster_->AddSidecar(cluster_->relay_address(*relay));
  ASSERT_TRUE(behind.ok()) << behind.status();
  std::string digest;
  ASSERT_NO_FATAL_FAILURE(RunReference(&digest));
  auto procs = StartGated(kWorld, "faulty", /*gated=*/{6}, /*step=*/2, kFlags);
  ASSERT_EQ(procs.size(), static_cast<size_t>(kWorld));
  proxy.DropDownstream(true);
  ASSERT_TRUE(gate_.Release());
  ASSERT_TRUE(
      procs[0]->WaitForLine("rank 0 step 2 group g1:", absl::Now() + absl::Seconds(30)).ok());
  proxy.DropDownstream(false);
  EXPECT_GE(proxy.Cut(), 1);
  ExpectAllSucceededWith(LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(90)), digest);
  EXPECT_THAT(cluster_->RelayOutput(*relay), HasSubstr("reconnecting"));
}

}  // namespace
}  // namespace accord::testing
