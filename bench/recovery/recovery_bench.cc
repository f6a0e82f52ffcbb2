// Recovery with real processes: a coordinator, S sidecars (optionally behind
// relays), one accord-rank-scenario per sidecar. Every rank but the last has
// submitted step K of G groups and waits; the last waits at a gate. Then:
//
//   baseline  the gate opens: time until every rank has every decision of
//             step K (an undisturbed step, same cluster, same run);
//   restart   the coordinator is killed (SIGKILL) and started again on the
//             same address, then the gate opens: time from the restarted
//             coordinator listening until every rank has every decision of
//             step K. The sidecars (or relays) reconnect with their jittered
//             backoff, say hello, re-register every group and resend what is
//             pending; the relays do the same for their sidecars' merges.
//
// Both are wall times on this machine, everything included (processes,
// gRPC over loopback and Unix sockets). docs/RELIABILITY.md describes the
// recovery path, docs/CAPACITY.md the in-process figures at 16,384 nodes.
//
//   accord_recovery_bench --sidecars=32 --sidecars_per_relay=0,8 --groups=50 --runs=3
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/testing/local_cluster.h"
#include "tests/fault/gate.h"

ABSL_FLAG(int, sidecars, 32, "sidecars (nodes), one rank each");
ABSL_FLAG(std::string, sidecars_per_relay, "0,8",
          "placements to run, in order: 0 connects every sidecar to the coordinator, K > 0 puts "
          "one relay in front of every K sidecars");
ABSL_FLAG(int, groups, 50, "groups per step");
ABSL_FLAG(int, params, 16, "parameters per group");
ABSL_FLAG(int, step, 2, "the step held at the gate (earlier steps run undisturbed)");
ABSL_FLAG(int, runs, 3, "baseline + restart pairs per placement, each on a fresh cluster");
ABSL_FLAG(bool, echo, false, "copy the daemons' output to stderr");

namespace accord::testing {
namespace {

struct Times {
  double baseline_s = -1;
  double restart_s = -1;
  double kill_to_listening_s = -1;
};

class Bench {
 public:
  Bench(int sidecars, int per_relay, int groups, int params, int step)
      : sidecars_(sidecars), per_relay_(per_relay), groups_(groups), params_(params), step_(step) {}

  absl::StatusOr<Times> RunOnce() {
    LocalClusterOptions o;
    o.num_sidecars = sidecars_;
    o.sidecars_per_relay = per_relay_;
    o.echo = absl::GetFlag(FLAGS_echo);
    o.ready_timeout = absl::Seconds(120);
    absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(o);
    if (!cluster.ok()) return cluster.status();
    Times t;
    absl::StatusOr<double> base = Step(**cluster, "baseline", /*restart=*/false, nullptr);
    if (!base.ok()) return base.status();
    t.baseline_s = *base;
    absl::StatusOr<double> restart =
        Step(**cluster, "restart", /*restart=*/true, &t.kill_to_listening_s);
    if (!restart.ok()) return restart.status();
    t.restart_s = *restart;
    return t;
  }

 private:
  // Runs the job `job` with the last rank gated before step_; returns the
  // time from `start` (the gate's opening, or the restarted coordinator
  // listening) until every rank printed every decision of step_.
  absl::StatusOr<double> Step(LocalCluster& cluster, const std::string& job, bool restart,
                              double* kill_to_listening) {
    const int world = sidecars_;
    Gate gate;
    std::vector<std::string> cmd = {ACCORD_RANK_SCENARIO,
                                    "--socket={socket}",
                                    "--rank={rank}",
                                    "--world={world}",
                                    "--job={job}",
                                    "--local_rank={local_rank}",
                                    "--wait=120s",
                                    absl::StrCat("--groups=", groups_),
                                    absl::StrCat("--params=", params_),
                                    absl::StrCat("--steps=", step_ + 1),
                                    absl::StrCat("--gate_rank=", world - 1),
                                    absl::StrCat("--gate_step=", step_),
                                    "--gate_fifo=" + gate.path()};
    absl::StatusOr<std::vector<std::unique_ptr<ChildProcess>>> procs =
        cluster.StartRanks(cmd, world, job);
    if (!procs.ok()) return procs.status();
    const absl::Time ready_by = absl::Now() + absl::Seconds(300);
    for (int r = 0; r < world; ++r) {
      const std::string line = r == world - 1
                                   ? absl::StrCat("rank ", r, " waiting at gate")
                                   : absl::StrCat("rank ", r, " step ", step_, " submitted");
      if (absl::StatusOr<std::string> got = (*procs)[r]->WaitForLine(line, ready_by); !got.ok()) {
        return got.status();
      }
    }
    absl::Time start;
    if (restart) {
      const absl::Time killed = absl::Now();
      cluster.KillCoordinator();
      if (absl::Status s = cluster.RestartCoordinator(); !s.ok()) return s;
      start = absl::Now();
      *kill_to_listening = absl::ToDoubleSeconds(start - killed);
      if (!gate.Release()) return absl::DeadlineExceededError("the gated rank never came");
    } else {
      start = absl::Now();
      if (!gate.Release()) return absl::DeadlineExceededError("the gated rank never came");
    }
    const std::string last = absl::StrCat(" step ", step_, " group g", groups_ - 1, ": wire=");
    const absl::Time decided_by = absl::Now() + absl::Seconds(300);
    for (int r = 0; r < world; ++r) {
      absl::StatusOr<std::string> got =
          (*procs)[r]->WaitForLine(absl::StrCat("rank ", r, last), decided_by);
      if (!got.ok()) {
        return absl::InternalError(absl::StrCat("rank ", r, " did not get step ", step_,
                                                "'s decisions: ", got.status().message()));
      }
    }
    const double took = absl::ToDoubleSeconds(absl::Now() - start);
    for (const RankResult& r : LocalCluster::WaitRanks(*procs, absl::Now() + absl::Seconds(60))) {
      if (r.exit_code != 0) {
        return absl::InternalError(
            absl::StrCat("rank ", r.rank, " exited with ", r.exit_code, ":\n", r.output));
      }
    }
    return took;
  }

  const int sidecars_, per_relay_, groups_, params_, step_;
};

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int sidecars = absl::GetFlag(FLAGS_sidecars);
  const int groups = absl::GetFlag(FLAGS_groups);
  const int runs = absl::GetFlag(FLAGS_runs);
  if (sidecars < 2 || groups < 1 || runs < 1 || absl::GetFlag(FLAGS_step) < 0) {
    std::fprintf(stderr, "need --sidecars >= 2, --groups >= 1, --runs >= 1, --step >= 0\n");
    return 2;
  }
  std::vector<int> placements;
  for (absl::string_view p : absl::StrSplit(absl::GetFlag(FLAGS_sidecars_per_relay), ',')) {
    int k = 0;
    if (!absl::SimpleAtoi(p, &k) || k < 0) {
      std::fprintf(stderr, "--sidecars_per_relay: \"%s\" is not a count\n", std::string(p).c_str());
      return 2;
    }
    placements.push_back(k);
  }
  std::printf("recovery: %d sidecars x 1 rank, %d groups x %d params, step %d held at a gate\n",
              sidecars, groups, absl::GetFlag(FLAGS_params), absl::GetFlag(FLAGS_step));
  for (int k : placements) {
    Bench bench(sidecars, k, groups, absl::GetFlag(FLAGS_params), absl::GetFlag(FLAGS_step));
    const std::string name = k == 0 ? "direct" : absl::StrCat(k, " sidecars per relay");
    for (int run = 0; run < runs; ++run) {
      absl::StatusOr<Times> t = bench.RunOnce();
      if (!t.ok()) {
        std::fprintf(stderr, "%s, run %d: %s\n", name.c_str(), run,
                     std::string(t.status().message()).c_str());
        return 1;
      }
      std::printf(
          "%-22s run %d: undisturbed step %7.3f s; after a coordinator restart %7.3f s from "
          "listening until every rank had the step's decisions (kill to listening %5.3f s)\n",
          name.c_str(), run, t->baseline_s, t->restart_s, t->kill_to_listening_s);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace accord::testing

int main(int argc, char** argv) { return accord::testing::Main(argc, argv); }
