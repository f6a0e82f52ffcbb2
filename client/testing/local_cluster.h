// A whole accord job on one machine, for tests, the demo and benchmarks: one
// coordinator, S sidecars and R rank processes on loopback and temporary
// Unix sockets. Readiness is the daemon's "listening"/"serving" line followed
// by a gRPC health check; nothing sleeps. Everything started is torn down by
// the destructor (SIGTERM, then SIGKILL after a bound), also on failure, and
// each child gets PR_SET_PDEATHSIG so nothing outlives the launcher.
//
// Thread-compatibility: use a LocalCluster from the thread that created it
// (PR_SET_PDEATHSIG is tied to the forking thread).
#ifndef ACCORD_CLIENT_TESTING_LOCAL_CLUSTER_H_
#define ACCORD_CLIENT_TESTING_LOCAL_CLUSTER_H_

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/sync.h"

namespace accord::testing {

// One child process whose stdout and stderr are captured (and optionally
// echoed to our stderr with a prefix) by a thread this object owns.
class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(const std::vector<std::string>& argv,
                                                             std::string name, bool echo);
  ~ChildProcess();  // Terminate(5 s) if still running; joins the output thread.

  int pid() const { return pid_; }
  const std::string& name() const { return name_; }
  // Waits until a line containing `needle` is printed; returns the line.
  // DEADLINE_EXCEEDED at `deadline`, UNAVAILABLE when the process exits first.
  absl::StatusOr<std::string> WaitForLine(absl::string_view needle, absl::Time deadline);
  // Waits until `needle` was printed at least `count` times.
  absl::Status WaitForCount(absl::string_view needle, int count, absl::Time deadline);
  // Waits for exit; returns the exit code (128+signal when killed).
  // DEADLINE_EXCEEDED when still running at `deadline`.
  absl::StatusOr<int> Wait(absl::Time deadline);
  // SIGTERM, then SIGKILL after `grace`; returns the exit code.
  int Terminate(absl::Duration grace);
  std::string Output() const;
  // Everything it printed, once its output is closed (after it exited).
  std::string FinalOutput();

 private:
  ChildProcess(int pid, int out_fd, std::string name, bool echo);
  void DrainLoop();

  const int pid_;
  const int out_fd_;
  int pidfd_ = -1;
  const std::string name_;
  const bool echo_;
  std::thread drain_;
  mutable accord::Mutex mu_;
  std::string output_ ABSL_GUARDED_BY(mu_);
  bool eof_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<int> exit_code_;  // owner thread only
};

struct LocalClusterOptions {
  // Where accord-coordinator and accord-sidecar are: this, else
  // $ACCORD_BIN_DIR, else the build tree's daemon folders.
  std::string bin_dir;
  int num_sidecars = 1;
  std::vector<std::string> coordinator_flags;  // extra flags, e.g. "--deadline=2s"
  std::vector<std::string> sidecar_flags;
  // Relays (docs/ARCHITECTURE.md, "Relays"): 0 connects every sidecar to the
  // coordinator; K > 0 places one accord-relay per K sidecars (sidecar i goes
  // through relay i / K).
  int sidecars_per_relay = 0;
  std::vector<std::string> relay_flags;
  absl::Duration ready_timeout = absl::Seconds(30);
  bool echo = true;  // copy children's output to stderr, prefixed
};

struct RankResult {
  int rank = -1;
  int exit_code = -1;
  std::string output;
};

class LocalCluster {
 public:
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const LocalClusterOptions& options);
  ~LocalCluster();

  const std::string& coordinator_address() const { return coordinator_address_; }
  const std::vector<std::string>& sidecar_sockets() const { return sockets_; }
  // Ranks are placed on sidecars in blocks: rank r of W goes to sidecar
  // r / ceil(W / S), as local rank r % ceil(W / S).
  int SidecarOf(int rank, int world) const;
  int LocalRankOf(int rank, int world) const;

  // Runs `world` rank processes from `command`, substituting {rank},
  // {world}, {socket}, {local_rank} and {job} in every argument; waits for
  // all of them (killing the rest at `timeout`). One result per rank.
  absl::StatusOr<std::vector<RankResult>> RunRanks(const std::vector<std::string>& command,
                                                   int world, const std::string& job,
                                                   absl::Duration timeout);

  // Starts `world` rank processes like RunRanks but returns at once; collect
  // them with WaitRanks. For tests that act while the ranks run.
  absl::StatusOr<std::vector<std::unique_ptr<ChildProcess>>> StartRanks(
      const std::vector<std::string>& command, int world, const std::string& job);
  // Waits for every process (killing the rest at `deadline`); one result each.
  static std::vector<RankResult> WaitRanks(std::vector<std::unique_ptr<ChildProcess>>& procs,
                                           absl::Time deadline);

  // Stops the coordinator with SIGTERM and returns everything it printed.
  std::string StopCoordinator();
  // Kills the coordinator with SIGKILL (no shutdown at all); returns its output.
  std::string KillCoordinator();
  // Kills sidecar `i` with SIGKILL.
  void KillSidecar(int i);
  // Starts one more sidecar that reaches the coordinator at `coordinator`
  // (e.g. through a proxy); returns its index.
  absl::StatusOr<int> AddSidecar(const std::string& coordinator);
  // Starts sidecar `i` again (same socket, node id and coordinator) after
  // KillSidecar: a sidecar restart.
  absl::Status RestartSidecar(int i);
  // Relays (when sidecars_per_relay > 0): their count, addresses (the
  // sidecars' --coordinator) and output.
  int num_relays() const { return static_cast<int>(relays_.size()); }
  const std::string& relay_address(int j) const { return relay_addresses_[j]; }
  std::string RelayOutput(int j) const;
  // Kills relay `j` with SIGKILL.
  void KillRelay(int j);
  // Starts relay `j` again on the same address after KillRelay.
  absl::Status RestartRelay(int j);
  // Starts one more relay whose upstream is `coordinator` (e.g. a proxy) and
  // returns its index; no sidecar uses it until one is added (AddSidecar).
  absl::StatusOr<int> AddRelay(const std::string& coordinator);
  absl::Status WaitForRelayOutput(int j, absl::string_view needle, int count, absl::Time deadline);
  // Process ids, e.g. for SIGSTOP/SIGCONT; -1 when not running.
  int coordinator_pid() const { return coordinator_ ? coordinator_->pid() : -1; }
  int sidecar_pid(int i) const { return sidecars_[i]->pid(); }
  // Starts a coordinator again on the same address (after StopCoordinator).
  absl::Status RestartCoordinator();
  std::string CoordinatorOutput() const;
  std::string SidecarOutput(int i) const;
  // Waits until sidecar `i` printed `needle` at least `count` times (e.g. its
  // "no rank left on this node" log line once a job's ranks are gone).
  absl::Status WaitForSidecarOutput(int i, absl::string_view needle, int count,
                                    absl::Time deadline);
  // The same for the coordinator's output (the running coordinator's).
  absl::Status WaitForCoordinatorOutput(absl::string_view needle, int count, absl::Time deadline);

 private:
  explicit LocalCluster(LocalClusterOptions options) : options_(std::move(options)) {}
  absl::Status StartCoordinator(const std::string& listen);
  absl::Status StartSidecar(int i, const std::string& coordinator);
  // Starts relay `j` listening on `listen` with `coordinator` upstream.
  absl::Status StartRelay(int j, const std::string& listen, const std::string& coordinator);

  LocalClusterOptions options_;
  std::string bin_dir_;
  std::string dir_;
  std::string coordinator_address_;
  std::vector<std::string> sockets_;
  std::vector<std::string> sidecar_coordinators_;  // per sidecar
  std::unique_ptr<ChildProcess> coordinator_;
  std::vector<std::unique_ptr<ChildProcess>> sidecars_;
  std::vector<std::unique_ptr<ChildProcess>> relays_;
  std::vector<std::string> relay_addresses_;
  std::vector<std::string> relay_upstreams_;
  std::string last_coordinator_output_;
};

// Checks a gRPC server's health service until SERVING or the deadline.
absl::Status WaitHealthy(const std::string& target, absl::Time deadline);

}  // namespace accord::testing

#endif  // ACCORD_CLIENT_TESTING_LOCAL_CLUSTER_H_
