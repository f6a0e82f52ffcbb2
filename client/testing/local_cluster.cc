#include "client/testing/local_cluster.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/testing/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

#ifndef ACCORD_DEFAULT_BIN_DIRS
#define ACCORD_DEFAULT_BIN_DIRS ""
#endif

namespace accord::testing {
namespace {

// poll(2) timeout until `deadline`: -1 (forever) for an infinite deadline.
int RemainingMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  if (left > absl::Hours(24)) return -1;
  return static_cast<int>(absl::ToInt64Milliseconds(left) + 1);
}

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

absl::StatusOr<std::string> FindBinary(const std::string& bin_dir, const std::string& name) {
  std::vector<std::string> dirs;
  if (!bin_dir.empty()) {
    dirs.push_back(bin_dir);
  } else if (const char* env = getenv("ACCORD_BIN_DIR"); env != nullptr && *env != '\0') {
    dirs.push_back(env);
  } else {
    dirs = absl::StrSplit(ACCORD_DEFAULT_BIN_DIRS, ':', absl::SkipEmpty());
  }
  for (const std::string& d : dirs) {
    const std::string p = absl::StrCat(d, "/", name);
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return absl::NotFoundError(absl::StrCat("cannot find ", name, " in [", absl::StrJoin(dirs, ", "),
                                          "]; build it, or pass --bin_dir / set ACCORD_BIN_DIR"));
}

}  // namespace

// ---------------------------------------------------------------------------
// ChildProcess

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(
    const std::vector<std::string>& argv, std::string name, bool echo) {
  if (argv.empty()) return absl::InvalidArgumentError("empty command for " + name);
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe for ", name, ": ", strerror(errno)));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return absl::InternalError(absl::StrCat("fork for ", name, ": ", strerror(errno)));
  }
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    execv(cargv[0], cargv.data());
    const char msg[] = "exec failed\n";
    (void)!write(STDERR_FILENO, msg, sizeof(msg) - 1);
    _exit(127);
  }
  close(fds[1]);
  return std::unique_ptr<ChildProcess>(new ChildProcess(pid, fds[0], std::move(name), echo));
}

ChildProcess::ChildProcess(int pid, int out_fd, std::string name, bool echo)
    : pid_(pid), out_fd_(out_fd), name_(std::move(name)), echo_(echo) {
  pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, pid_, 0));
  drain_ = std::thread([this] { DrainLoop(); });
}

ChildProcess::~ChildProcess() {
  if (!exit_code_.has_value()) Terminate(absl::Seconds(5));
  // The pipe closes when the child (and any grandchild holding it) exits.
  if (drain_.joinable()) drain_.join();
  close(out_fd_);
  if (pidfd_ >= 0) close(pidfd_);
}

void ChildProcess::DrainLoop() {
  char buf[4096];
  std::string partial;
  while (true) {
    const ssize_t n = read(out_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    accord::MutexLock lock(&mu_);
    output_.append(buf, n);
    if (echo_) {
      partial.append(buf, n);
      size_t nl;
      while ((nl = partial.find('\n')) != std::string::npos) {
        const std::string line = absl::StrCat("[", name_, "] ", partial.substr(0, nl + 1));
        (void)!write(STDERR_FILENO, line.data(), line.size());
        partial.erase(0, nl + 1);
      }
    }
  }
  accord::MutexLock lock(&mu_);
  if (echo_ && !partial.empty()) {
    const std::string line = absl::StrCat("[", name_, "] ", partial, "\n");
    (void)!write(STDERR_FILENO, line.data(), line.size());
  }
  eof_ = true;
}

absl::StatusOr<std::string> ChildProcess::WaitForLine(absl::string_view needle,
                                                      absl::Time deadline) {
  accord::MutexLock lock(&mu_);
  size_t line_start = std::string::npos;
  auto found = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t at = output_.find(needle.data(), 0, needle.size());
    if (at == std::string::npos) return eof_;
    const size_t end = output_.find('\n', at);
    if (end == std::string::npos) return eof_;  // wait for the whole line
    const size_t begin = output_.rfind('\n', at);
    line_start = begin == std::string::npos ? 0 : begin + 1;
    return true;
  };
  mu_.AwaitWithDeadline(absl::Condition(&found), deadline);
  if (line_start != std::string::npos) {
    const size_t end = output_.find('\n', line_start);
    return output_.substr(line_start, end - line_start);
  }
  if (eof_) {
    return absl::UnavailableError(absl::StrCat(name_, " (pid ", pid_, ") exited before printing \"",
                                               needle, "\"; its output:\n", output_));
  }
  return absl::DeadlineExceededError(absl::StrCat(name_, " (pid ", pid_, ") did not print \"",
                                                  needle, "\" in time; its output so far:\n",
                                                  output_));
}

absl::Status ChildProcess::WaitForCount(absl::string_view needle, int count, absl::Time deadline) {
  accord::MutexLock lock(&mu_);
  auto seen = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int n = 0;
    for (size_t at = output_.find(needle.data(), 0, needle.size());
         at != std::string::npos && n < count;
         at = output_.find(needle.data(), at + 1, needle.size())) {
      ++n;
    }
    return n >= count;
  };
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return eof_ || seen(); };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  if (seen()) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat(name_, " (pid ", pid_, ") did not print \"",
                                                  needle, "\" ", count, " times; its output:\n",
                                                  output_));
}

absl::StatusOr<int> ChildProcess::Wait(absl::Time deadline) {
  if (exit_code_.has_value()) return *exit_code_;
  if (pidfd_ >= 0) {
    while (true) {
      pollfd p{pidfd_, POLLIN, 0};
      const int r = poll(&p, 1, RemainingMs(deadline));
      if (r < 0 && errno == EINTR) continue;
      if (r == 0) {
        return absl::DeadlineExceededError(
            absl::StrCat(name_, " (pid ", pid_, ") still running at the deadline"));
      }
      break;
    }
  }
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0) {
    if (errno != EINTR)
      return absl::InternalError(absl::StrCat("waitpid ", name_, ": ", strerror(errno)));
  }
  exit_code_ = DecodeWaitStatus(status);
  return *exit_code_;
}

int ChildProcess::Terminate(absl::Duration grace) {
  if (exit_code_.has_value()) return *exit_code_;
  kill(pid_, SIGTERM);
  absl::StatusOr<int> code = Wait(absl::Now() + grace);
  if (code.ok()) return *code;
  kill(pid_, SIGKILL);
  code = Wait(absl::InfiniteFuture());
  return code.ok() ? *code : -1;
}

std::string ChildProcess::FinalOutput() {
  accord::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&eof_));
  return output_;
}

std::string ChildProcess::Output() const {
  accord::MutexLock lock(&mu_);
  return output_;
}

// ---------------------------------------------------------------------------
// Health

absl::Status WaitHealthy(const std::string& target, absl::Time deadline) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_wait_for_ready(true);  // wait for the listener instead of failing fast
  ctx.set_deadline(absl::ToChronoTime(deadline));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  const grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("health check of ", target, " failed: ", s.error_message()));
  }
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(
        absl::StrCat("health check of ", target, ": ",
                     grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status())));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// LocalCluster

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(
    const LocalClusterOptions& options) {
  if (options.num_sidecars < 1) {
    return absl::InvalidArgumentError("LocalClusterOptions.num_sidecars must be at least 1");
  }
  std::unique_ptr<LocalCluster> c(new LocalCluster(options));
  char tmpl[] = "/tmp/accord-cluster-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", strerror(errno)));
  }
  c->dir_ = tmpl;
  if (absl::Status s = c->StartCoordinator("127.0.0.1:0"); !s.ok()) return s;
  const int per_relay = options.sidecars_per_relay;
  if (per_relay > 0) {
    const int relays = (options.num_sidecars + per_relay - 1) / per_relay;
    for (int j = 0; j < relays; ++j) {
      if (absl::Status s = c->StartRelay(j, "127.0.0.1:0", c->coordinator_address_); !s.ok()) {
        return s;
      }
    }
  }
  for (int i = 0; i < options.num_sidecars; ++i) {
    const std::string& upstream =
        per_relay > 0 ? c->relay_addresses_[i / per_relay] : c->coordinator_address_;
    if (absl::Status s = c->StartSidecar(i, upstream); !s.ok()) return s;
  }
  return c;
}

LocalCluster::~LocalCluster() {
  // Sidecars first (they would otherwise reconnect), then the coordinator.
  for (auto& s : sidecars_) s->Terminate(absl::Seconds(5));
  sidecars_.clear();
  for (auto& r : relays_) {
    if (r) r->Terminate(absl::Seconds(5));
  }
  relays_.clear();
  if (coordinator_) coordinator_->Terminate(absl::Seconds(5));
  coordinator_.reset();
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

absl::Status LocalCluster::StartCoordinator(const std::string& listen) {
  absl::StatusOr<std::string> bin = FindBinary(options_.bin_dir, "accord-coordinator");
  if (!bin.ok()) return bin.status();
  // Metrics on an ephemeral port so several clusters (and sidecars) fit on one
  // machine; flags given by the caller come later and win.
  std::vector<std::string> argv = {*bin, "--listen=" + listen, "--metrics_port=0"};
  argv.insert(argv.end(), options_.coordinator_flags.begin(), options_.coordinator_flags.end());
  absl::StatusOr<std::unique_ptr<ChildProcess>> p =
      ChildProcess::Spawn(argv, "coordinator", options_.echo);
  if (!p.ok()) return p.status();
  coordinator_ = *std::move(p);
  const absl::Time deadline = absl::Now() + options_.ready_timeout;
  constexpr absl::string_view kReady = "accord-coordinator listening on ";
  absl::StatusOr<std::string> line = coordinator_->WaitForLine(kReady, deadline);
  if (!line.ok()) return line.status();
  const size_t at = line->find(kReady.data(), 0, kReady.size());
  std::string addr = line->substr(at + kReady.size());
  while (!addr.empty() && (addr.back() == '\r' || addr.back() == ' ')) addr.pop_back();
  coordinator_address_ = addr;
  return WaitHealthy(coordinator_address_, deadline);
}

absl::Status LocalCluster::StartSidecar(int i, const std::string& coordinator) {
  absl::StatusOr<std::string> bin = FindBinary(options_.bin_dir, "accord-sidecar");
  if (!bin.ok()) return bin.status();
  const std::string socket = absl::StrCat(dir_, "/sidecar", i, ".sock");
  std::vector<std::string> argv = {*bin, "--coordinator=" + coordinator, "--socket=" + socket,
                                   absl::StrCat("--node_id=node", i), "--metrics_port=0"};
  argv.insert(argv.end(), options_.sidecar_flags.begin(), options_.sidecar_flags.end());
  absl::StatusOr<std::unique_ptr<ChildProcess>> p =
      ChildProcess::Spawn(argv, absl::StrCat("sidecar", i), options_.echo);
  if (!p.ok()) return p.status();
  if (i < static_cast<int>(sidecars_.size())) {  // a restart in place
    sidecars_[i] = *std::move(p);
    sidecar_coordinators_[i] = coordinator;
  } else {
    sidecars_.push_back(*std::move(p));
    sockets_.push_back(socket);
    sidecar_coordinators_.push_back(coordinator);
  }
  const absl::Time deadline = absl::Now() + options_.ready_timeout;
  absl::StatusOr<std::string> line = sidecars_[i]->WaitForLine("accord-sidecar serving", deadline);
  if (!line.ok()) return line.status();
  return WaitHealthy("unix:" + socket, deadline);
}

absl::Status LocalCluster::StartRelay(int j, const std::string& listen,
                                      const std::string& coordinator) {
  absl::StatusOr<std::string> bin = FindBinary(options_.bin_dir, "accord-relay");
  if (!bin.ok()) return bin.status();
  std::vector<std::string> argv = {*bin, "--listen=" + listen, "--coordinator=" + coordinator,
                                   absl::StrCat("--relay_id=relay", j), "--metrics_port=0"};
  argv.insert(argv.end(), options_.relay_flags.begin(), options_.relay_flags.end());
  absl::StatusOr<std::unique_ptr<ChildProcess>> p =
      ChildProcess::Spawn(argv, absl::StrCat("relay", j), options_.echo);
  if (!p.ok()) return p.status();
  if (j < static_cast<int>(relays_.size())) {  // a restart in place
    relays_[j] = *std::move(p);
  } else {
    relays_.push_back(*std::move(p));
    relay_addresses_.emplace_back();
    relay_upstreams_.push_back(coordinator);
  }
  const absl::Time deadline = absl::Now() + options_.ready_timeout;
  constexpr absl::string_view kReady = "accord-relay listening on ";
  absl::StatusOr<std::string> line = relays_[j]->WaitForLine(kReady, deadline);
  if (!line.ok()) return line.status();
  std::string addr = line->substr(line->find(kReady.data(), 0, kReady.size()) + kReady.size());
  while (!addr.empty() && (addr.back() == '\r' || addr.back() == ' ')) addr.pop_back();
  relay_addresses_[j] = addr;
  return WaitHealthy(addr, deadline);
}

std::string LocalCluster::RelayOutput(int j) const {
  return relays_[j] ? relays_[j]->Output() : std::string();
}

void LocalCluster::KillRelay(int j) {
  kill(relays_[j]->pid(), SIGKILL);
  (void)relays_[j]->Wait(absl::InfiniteFuture());
}

absl::Status LocalCluster::RestartRelay(int j) {
  if (j < 0 || j >= static_cast<int>(relays_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no relay ", j));
  }
  return StartRelay(j, relay_addresses_[j], relay_upstreams_[j]);
}

absl::StatusOr<int> LocalCluster::AddRelay(const std::string& coordinator) {
  const int j = static_cast<int>(relays_.size());
  if (absl::Status s = StartRelay(j, "127.0.0.1:0", coordinator); !s.ok()) return s;
  return j;
}

absl::Status LocalCluster::WaitForRelayOutput(int j, absl::string_view needle, int count,
                                              absl::Time deadline) {
  return relays_[j]->WaitForCount(needle, count, deadline);
}

int LocalCluster::SidecarOf(int rank, int world) const {
  const int n = static_cast<int>(sockets_.size());
  const int per = (world + n - 1) / n;
  return rank / per;
}

int LocalCluster::LocalRankOf(int rank, int world) const {
  const int n = static_cast<int>(sockets_.size());
  const int per = (world + n - 1) / n;
  return rank % per;
}

absl::StatusOr<std::vector<RankResult>> LocalCluster::RunRanks(
    const std::vector<std::string>& command, int world, const std::string& job,
    absl::Duration timeout) {
  absl::StatusOr<std::vector<std::unique_ptr<ChildProcess>>> procs =
      StartRanks(command, world, job);
  if (!procs.ok()) return procs.status();
  return WaitRanks(*procs, absl::Now() + timeout);
}

absl::StatusOr<std::vector<std::unique_ptr<ChildProcess>>> LocalCluster::StartRanks(
    const std::vector<std::string>& command, int world, const std::string& job) {
  std::vector<std::unique_ptr<ChildProcess>> procs;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv;
    for (const std::string& a : command) {
      argv.push_back(absl::StrReplaceAll(a, {{"{rank}", absl::StrCat(r)},
                                             {"{world}", absl::StrCat(world)},
                                             {"{socket}", sockets_[SidecarOf(r, world)]},
                                             {"{local_rank}", absl::StrCat(LocalRankOf(r, world))},
                                             {"{job}", job}}));
    }
    absl::StatusOr<std::unique_ptr<ChildProcess>> p =
        ChildProcess::Spawn(argv, absl::StrCat("rank", r), options_.echo);
    if (!p.ok()) return p.status();  // started ones are killed by their destructors
    procs.push_back(*std::move(p));
  }
  return procs;
}

std::vector<RankResult> LocalCluster::WaitRanks(std::vector<std::unique_ptr<ChildProcess>>& procs,
                                                absl::Time deadline) {
  std::vector<RankResult> out;
  for (size_t r = 0; r < procs.size(); ++r) {
    RankResult res;
    res.rank = static_cast<int>(r);
    absl::StatusOr<int> code = procs[r]->Wait(deadline);
    res.exit_code = code.ok() ? *code : procs[r]->Terminate(absl::Seconds(2));
    res.output = procs[r]->FinalOutput();
    if (!code.ok()) absl::StrAppend(&res.output, "[killed: still running at the deadline]\n");
    out.push_back(std::move(res));
  }
  return out;
}

std::string LocalCluster::StopCoordinator() {
  if (!coordinator_) return last_coordinator_output_;
  coordinator_->Terminate(absl::Seconds(10));
  // The output thread finishes once the pipe closes.
  last_coordinator_output_ = coordinator_->FinalOutput();
  coordinator_.reset();
  return last_coordinator_output_;
}

std::string LocalCluster::KillCoordinator() {
  if (!coordinator_) return last_coordinator_output_;
  kill(coordinator_->pid(), SIGKILL);
  (void)coordinator_->Wait(absl::InfiniteFuture());
  last_coordinator_output_ = coordinator_->FinalOutput();
  coordinator_.reset();
  return last_coordinator_output_;
}

void LocalCluster::KillSidecar(int i) {
  kill(sidecars_[i]->pid(), SIGKILL);
  (void)sidecars_[i]->Wait(absl::InfiniteFuture());
}

absl::Status LocalCluster::RestartSidecar(int i) {
  if (i < 0 || i >= static_cast<int>(sidecars_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no sidecar ", i));
  }
  return StartSidecar(i, sidecar_coordinators_[i]);
}

absl::StatusOr<int> LocalCluster::AddSidecar(const std::string& coordinator) {
  const int i = static_cast<int>(sidecars_.size());
  if (absl::Status s = StartSidecar(i, coordinator); !s.ok()) return s;
  return i;
}

absl::Status LocalCluster::RestartCoordinator() {
  if (coordinator_) return absl::FailedPreconditionError("the coordinator is still running");
  return StartCoordinator(coordinator_address_);
}

std::string LocalCluster::CoordinatorOutput() const {
  return coordinator_ ? coordinator_->Output() : last_coordinator_output_;
}

std::string LocalCluster::SidecarOutput(int i) const { return sidecars_[i]->Output(); }

absl::Status LocalCluster::WaitForSidecarOutput(int i, absl::string_view needle, int count,
                                                absl::Time deadline) {
  return sidecars_[i]->WaitForCount(needle, count, deadline);
}

absl::Status LocalCluster::WaitForCoordinatorOutput(absl::string_view needle, int count,
                                                    absl::Time deadline) {
  if (coordinator_ == nullptr) return absl::FailedPreconditionError("no coordinator is running");
  return coordinator_->WaitForCount(needle, count, deadline);
}

}  // namespace accord::testing
