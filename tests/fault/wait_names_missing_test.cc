// Every wait names who is missing, through the real daemons: a rank waiting
// for a group's registration or for a key-value key that another rank must
// set gets, within the coordinator's --deadline (plus its grace), one error
// naming the ranks it waits for, with their node and whether they are
// connected. See docs/ARCHITECTURE.md, "Every wait names who is missing", and
// docs/RELIABILITY.md. (The third wait, a decision, is SilentRankTest's.)
//
// The missing rank is held at a FIFO gate (no timer) or never started; each
// rank prints the wall time of its wait and of its error (--print_times),
// from which the test checks a generous bound and prints the measured time.
#include <algorithm>
#include <functional>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fault/gate.h"

namespace accord::testing {
namespace {

constexpr absl::Duration kDeadline = absl::Seconds(2);
// The coordinator's grace past a deadline: min(1 s, deadline / 4). A
// registration or key-value wait needs none (the coordinator knows who
// registered and who set a key), so the error comes at the deadline; the
// bound allows it anyway.
constexpr absl::Duration kGrace = absl::Milliseconds(500);
// Scheduling on a loaded 2-core machine and the sanitizer builds: a generous
// bound, never a tight one. Not before the deadline (less kEarly for the
// print latency).
constexpr absl::Duration kSlack = absl::Milliseconds(1500);
constexpr absl::Duration kEarly = absl::Milliseconds(100);
constexpr int kWorld = 3;  // on 2 sidecars: ranks 0, 1 on node0, rank 2 on node1

class WaitNamesMissingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LocalClusterOptions o;
    o.num_sidecars = 2;
    o.coordinator_flags = {absl::StrCat("--deadline=", absl::FormatDuration(kDeadline))};
    o.sidecar_flags = {"--reconnect_max_backoff=500ms"};
    absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
  }

  std::vector<std::string> Command(const std::string& job, const std::vector<std::string>& extra) {
    std::vector<std::string> cmd = {ACCORD_RANK_SCENARIO,
                                    "--socket={socket}",
                                    "--rank={rank}",
                                    "--world={world}",
                                    absl::StrCat("--job=", job),
                                    "--local_rank={local_rank}",
                                    "--wait=30s",
                                    "--groups=1",
                                    "--params=2",
                                    "--print_times",
                                    "--gate_fifo=" + gate_.path()};
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    return cmd;
  }

  // Starts `ranks` of a world of kWorld (the others never start), placed as
  // LocalCluster places them.
  std::vector<std::unique_ptr<ChildProcess>> Start(const std::vector<std::string>& command,
                                                   const std::vector<int>& ranks) {
    std::vector<std::unique_ptr<ChildProcess>> procs(kWorld);
    for (int r : ranks) {
      std::vector<std::string> argv;
      for (const std::string& a : command) {
        argv.push_back(absl::StrReplaceAll(
            a, {{"{rank}", absl::StrCat(r)},
                {"{world}", absl::StrCat(kWorld)},
                {"{socket}", Socket(r)},
                {"{local_rank}", absl::StrCat(cluster_->LocalRankOf(r, kWorld))}}));
      }
      absl::StatusOr<std::unique_ptr<ChildProcess>> p =
          ChildProcess::Spawn(argv, absl::StrCat("rank", r), /*echo=*/true);
      EXPECT_TRUE(p.ok()) << p.status();
      if (p.ok()) procs[r] = *std::move(p);
    }
    return procs;
  }

  std::string Socket(int rank) const {
    return cluster_->sidecar_sockets()[cluster_->SidecarOf(rank, kWorld)];
  }

  static void ExpectLine(ChildProcess& p, const std::string& line) {
    absl::StatusOr<std::string> got = p.WaitForLine(line, absl::Now() + absl::Seconds(60));
    EXPECT_TRUE(got.ok()) << got.status() << "\n" << p.Output();
  }

  // The first "error CODE: message" a rank printed.
  static std::string FirstError(const std::string& output) {
    std::smatch m;
    if (std::regex_search(output, m, std::regex(": error ([A-Z_]+: [^\n]*)"))) return m[1];
    return "";
  }

  // The wall time (Unix ms) of "rank R time WHAT at_ms T"; -1: none.
  static int64_t TimeOf(const std::string& output, const std::string& what) {
    std::smatch m;
    const std::regex re(absl::StrCat("rank \\d+ time ", what, " at_ms (\\d+)"));
    int64_t t = -1;
    if (std::regex_search(output, m, re)) (void)absl::SimpleAtoi(m[1].str(), &t);
    return t;
  }

  // Every rank in `waiting` gets `expected(rank)` as its first error, printed
  // as "time `error`" within the bound of the earliest "time `wait`" of
  // `clock_from` (the ranks whose wait starts the coordinator's clock: all of
  // `waiting` for a registration, each rank itself for a key-value Get).
  // Returns the slowest arrival, which the test prints.
  absl::Duration ExpectNamedInTime(std::vector<std::unique_ptr<ChildProcess>>& procs,
                                   const std::vector<int>& waiting, const std::string& wait,
                                   const std::string& error, bool per_rank_clock,
                                   const std::function<std::string(int)>& expected) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    int64_t first_wait = -1;
    for (int r : waiting) {
      EXPECT_TRUE(procs[r]->WaitForLine(absl::StrCat("rank ", r, " time ", error), give_up).ok())
          << "rank " << r << " got no error:\n"
          << procs[r]->Output();
      const int64_t t = TimeOf(procs[r]->Output(), wait);
      EXPECT_GE(t, 0) << procs[r]->Output();
      if (t >= 0 && (first_wait < 0 || t < first_wait)) first_wait = t;
    }
    absl::Duration slowest = absl::ZeroDuration();
    for (int r : waiting) {
      const std::string out = procs[r]->Output();
      EXPECT_EQ(FirstError(out), expected(r)) << "rank " << r << ":\n" << out;
      const int64_t from = per_rank_clock ? TimeOf(out, wait) : first_wait;
      const absl::Duration took = absl::Milliseconds(TimeOf(out, error) - from);
      EXPECT_GE(took, kDeadline - kEarly) << "rank " << r << " got its error before the deadline";
      EXPECT_LE(took, kDeadline + kGrace + kSlack) << "rank " << r << " got its error too late";
      slowest = std::max(slowest, took);
    }
    return slowest;
  }

  static void Report(const std::string& what, absl::Duration took) {
    std::printf("[timing] %s: missing ranks named after %s (deadline %s, grace %s, bound %s)\n",
                what.c_str(), absl::FormatDuration(took).c_str(),
                absl::FormatDuration(kDeadline).c_str(), absl::FormatDuration(kGrace).c_str(),
                absl::FormatDuration(kDeadline + kGrace + kSlack).c_str());
    std::fflush(stdout);
  }

  // The registration error every rank that registered g0 gets.
  static std::string RegistrationError(const std::string& job, const std::string& missing,
                                       const std::string& who, const std::string& registered) {
    return absl::StrCat(
        "DEADLINE_EXCEEDED: job ", job,
        " group \"g0\": not every rank registered the group within ",
        absl::FormatDuration(kDeadline), " of its first registration (--deadline); missing ranks ",
        missing, ": ", who, "; ranks ", registered,
        " registered it. Check that the missing ranks run and register this group (every rank "
        "must build and wrap the same model), their processes and their sidecars' logs; the job "
        "is failed");
  }

  // The key-value error every waiting rank gets: the coordinator's verdict,
  // the same text on every rank (no rank's client adds its own sidecar).
  static std::string KeyValueError(const std::string& job, const std::string& keys,
                                   const std::string& prefix, const std::string& missing,
                                   const std::string& who, const std::string& set_and_asked) {
    return absl::StrCat("DEADLINE_EXCEEDED: job ", job, ": keys still not set after ",
                        absl::FormatDuration(kDeadline), " (the coordinator's --deadline): ", keys,
                        "; missing ranks ", missing, " (neither set a key under \"", prefix,
                        "\" nor asked for one): ", who, "; ", set_and_asked,
                        ". Check the missing ranks' processes and their sidecars' logs: the rank "
                        "that publishes these keys is among them; a rank only slower than the "
                        "wait can ask again");
  }

  Gate gate_;
  std::unique_ptr<LocalCluster> cluster_;
};

// Rank 1 runs and is connected (beside rank 0 on node0) but never registers
// g0; ranks 0 and 2 did. Both get the same error naming rank 1 at the
// deadline; released, rank 1 registers late and gets the same error.
TEST_F(WaitNamesMissingTest, ARankThatNeverRegistersAGroupIsNamedToEveryRankThatDid) {
  auto procs = Start(Command("regone", {"--gate_ranks=1", "--gate_register"}), {0, 1, 2});
  ExpectLine(*procs[1], "rank 1 waiting at gate register");
  const std::string expected =
      RegistrationError("regone", "1", "rank 1 (node \"node0\", connected)", "0,2");
  Report("a rank that never registers a group",
         ExpectNamedInTime(procs, {0, 2}, "register group g0", "register_error group g0",
                           /*per_rank_clock=*/false, [&](int) { return expected; }));
  ASSERT_TRUE(gate_.Release());
  std::vector<RankResult> results = LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(60));
  ASSERT_EQ(results.size(), 3u);
  EXPECT_THAT(results[1].output, ::testing::HasSubstr("rank 1 register g0: error"));
  EXPECT_EQ(FirstError(results[1].output), expected) << results[1].output;
  for (const RankResult& r : results) EXPECT_NE(r.exit_code, 0) << r.output;
}

// Rank 2 (alone on node1) never starts: no sidecar ever announces it, and
// the error says so.
TEST_F(WaitNamesMissingTest, ARankThatNeverStartedIsNamedAsNotConnected) {
  auto procs = Start(Command("regnone", {}), {0, 1});
  const std::string expected = RegistrationError(
      "regnone", "2", "rank 2 (not connected: no sidecar has announced it)", "0-1");
  Report("a rank that never started",
         ExpectNamedInTime(procs, {0, 1}, "register group g0", "register_error group g0",
                           /*per_rank_clock=*/false, [&](int) { return expected; }));
  for (int r : {0, 1}) {
    absl::StatusOr<int> code = procs[r]->Wait(absl::Now() + absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_NE(*code, 0);
  }
}

// Rank 0 must publish boot/nccl_id (as for the NCCL unique id) and never
// does, though it runs and is connected; ranks 1 and 2 wait for it. Each
// wait ends at the coordinator's deadline naming rank 0: the one rank that
// neither set a key under "boot/" nor asked for one.
TEST_F(WaitNamesMissingTest, AKeyItsPublisherNeverSetsNamesThePublisherToEveryWaitingRank) {
  auto procs =
      Start(Command("kvone", {"--kv_key=boot/nccl_id", "--kv_setter=0", "--kv_withhold_rank=0"}),
            {0, 1, 2});
  ExpectLine(*procs[0], "rank 0 waiting at gate kv");
  for (int r : {1, 2}) ExpectLine(*procs[r], absl::StrCat("rank ", r, " kv waiting"));
  Report("a key its publisher never sets",
         ExpectNamedInTime(procs, {1, 2}, "kv_wait", "kv_error", /*per_rank_clock=*/true, [&](int) {
           return KeyValueError("kvone", "boot/nccl_id", "boot/", "0",
                                "rank 0 (node \"node0\", connected)",
                                "no rank set one, ranks 1-2 asked for one");
         }));
  ASSERT_TRUE(gate_.Release());
  std::vector<RankResult> results = LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(60));
  ASSERT_EQ(results.size(), 3u);
  EXPECT_EQ(results[0].exit_code, 0) << results[0].output;
}

// Every rank publishes gather/<rank> and reads all of them (as a Gloo store
// or a guard's all-gather does); rank 2 (alone on node1) never publishes.
// Ranks 0 and 1 get rank 2 named.
TEST_F(WaitNamesMissingTest, AKeyUnderAPrefixEveryRankSetsNamesTheRankThatDidNotSetIt) {
  auto procs = Start(Command("kvall", {"--kv_gather=gather", "--kv_withhold_rank=2"}), {0, 1, 2});
  ExpectLine(*procs[2], "rank 2 waiting at gate kv");
  for (int r : {0, 1}) ExpectLine(*procs[r], absl::StrCat("rank ", r, " kv waiting"));
  Report("a rank that never sets its key under a prefix",
         ExpectNamedInTime(procs, {0, 1}, "kv_wait", "kv_error", /*per_rank_clock=*/true, [&](int) {
           return KeyValueError("kvall", "gather/2", "gather/", "2",
                                "rank 2 (node \"node1\", connected)",
                                "ranks 0-1 set one, ranks 0-1 asked for one");
         }));
  ASSERT_TRUE(gate_.Release());
  std::vector<RankResult> results = LocalCluster::WaitRanks(procs, absl::Now() + absl::Seconds(60));
  ASSERT_EQ(results.size(), 3u);
  EXPECT_EQ(results[2].exit_code, 0) << results[2].output;
}

// The same rendezvous, but rank 2 only comes late: ranks 0 and 1 give up at
// the deadline and exit (as accord-rank-scenario does on a key-value error)
// before rank 2 is released and sets its key and waits for theirs. Their leave fails the run with
// the words their waits ended with, so rank 2, arriving late, ends with those very words rather
// than completing a rendezvous whose other ranks are gone, or naming them (docs/ARCHITECTURE.md,
// "Every wait names who is missing"; chaos seed 3048).
TEST_F(WaitNamesMissingTest, ARankThatComesAfterTheOthersGaveUpOnTheirKeysGetsTheirWords) {
  auto procs = Start(Command("kvlate", {"--kv_gather=gather", "--kv_late_rank=2"}), {0, 1, 2});
  ExpectLine(*procs[2], "rank 2 waiting at gate kv");
  const std::string words =
      KeyValueError("kvlate", "gather/2", "gather/", "2", "rank 2 (node \"node1\", connected)",
                    "ranks 0-1 set one, ranks 0-1 asked for one");
  ExpectNamedInTime(procs, {0, 1}, "kv_wait", "kv_error", /*per_rank_clock=*/true,
                    [&](int) { return words; });
  for (int r : {0, 1}) {
    absl::StatusOr<int> code = procs[r]->Wait(absl::Now() + absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_NE(*code, 0) << procs[r]->Output();
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!absl::StrContains(cluster_->CoordinatorOutput(), "is gone after its key-value wait")) {
    ASSERT_LT(absl::Now(), give_up) << "the coordinator never saw rank 0 or 1 leave:\n"
                                    << cluster_->CoordinatorOutput();
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(gate_.Release());
  absl::StatusOr<int> late = procs[2]->Wait(absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_NE(*late, 0) << procs[2]->Output();
  EXPECT_EQ(FirstError(procs[2]->Output()), words) << procs[2]->Output();
}

}  // namespace
}  // namespace accord::testing
