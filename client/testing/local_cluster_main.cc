// accord-local-cluster: runs a whole job on this machine.
//
//   accord-local-cluster --sidecars=2 --ranks=8 -- accord-rank-scenario
//       --socket={socket} --rank={rank} --world={world} --job={job}
//
// Starts one coordinator, the relays (--sidecars_per_relay=K > 0: one
// accord-relay per K sidecars) and the sidecars, runs one rank process per rank with
// {rank}, {world}, {socket}, {local_rank} and {job} substituted, tears
// everything down, and exits non-zero if any rank failed.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "client/testing/local_cluster.h"

ABSL_FLAG(std::string, bin_dir, "",
          "where accord-coordinator, accord-sidecar and accord-relay are");
ABSL_FLAG(int, sidecars, 1, "number of sidecars (nodes)");
ABSL_FLAG(int, ranks, 2, "number of rank processes (the world size)");
ABSL_FLAG(std::string, job, "local", "job id substituted for {job}");
ABSL_FLAG(std::string, coordinator_flags, "", "extra coordinator flags, space separated");
ABSL_FLAG(std::string, sidecar_flags, "", "extra sidecar flags, space separated");
ABSL_FLAG(int, sidecars_per_relay, 0,
          "0: sidecars connect to the coordinator; K > 0: one accord-relay per K sidecars");
ABSL_FLAG(std::string, relay_flags, "", "extra relay flags, space separated");
ABSL_FLAG(absl::Duration, timeout, absl::Minutes(5), "how long the ranks may run");

int main(int argc, char** argv) {
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  std::vector<std::string> command(rest.begin() + 1, rest.end());
  if (command.empty()) {
    fprintf(stderr, "usage: accord-local-cluster [flags] -- RANK_COMMAND...\n");
    return 2;
  }
  accord::testing::LocalClusterOptions o;
  o.bin_dir = absl::GetFlag(FLAGS_bin_dir);
  o.num_sidecars = absl::GetFlag(FLAGS_sidecars);
  o.coordinator_flags =
      absl::StrSplit(absl::GetFlag(FLAGS_coordinator_flags), ' ', absl::SkipEmpty());
  o.sidecar_flags = absl::StrSplit(absl::GetFlag(FLAGS_sidecar_flags), ' ', absl::SkipEmpty());
  o.sidecars_per_relay = absl::GetFlag(FLAGS_sidecars_per_relay);
  o.relay_flags = absl::StrSplit(absl::GetFlag(FLAGS_relay_flags), ' ', absl::SkipEmpty());
  absl::StatusOr<std::unique_ptr<accord::testing::LocalCluster>> cluster =
      accord::testing::LocalCluster::Start(o);
  if (!cluster.ok()) {
    fprintf(stderr, "accord-local-cluster: %s\n", cluster.status().ToString().c_str());
    return 1;
  }
  fprintf(stderr, "accord-local-cluster: coordinator at %s, %d sidecar(s), %d relay(s)\n",
          (*cluster)->coordinator_address().c_str(), o.num_sidecars, (*cluster)->num_relays());
  absl::StatusOr<std::vector<accord::testing::RankResult>> results = (*cluster)->RunRanks(
      command, absl::GetFlag(FLAGS_ranks), absl::GetFlag(FLAGS_job), absl::GetFlag(FLAGS_timeout));
  if (!results.ok()) {
    fprintf(stderr, "accord-local-cluster: %s\n", results.status().ToString().c_str());
    return 1;
  }
  int failed = 0;
  for (const accord::testing::RankResult& r : *results) {
    if (r.exit_code != 0) {
      ++failed;
      fprintf(stderr, "accord-local-cluster: rank %d exited with %d\n", r.rank, r.exit_code);
    }
  }
  fprintf(stderr, "accord-local-cluster: %zu ranks, %d failed\n", results->size(), failed);
  return failed == 0 ? 0 : 1;
}
