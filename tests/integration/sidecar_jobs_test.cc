// Jobs on one sidecar (docs/ARCHITECTURE.md, "Jobs on one sidecar"), with
// the real daemons as processes and in-process ranks (each its own
// connection, as a rank process would have):
//  - 500 jobs back to back through one sidecar, each starting as soon as the
//    previous job's clients were closed, under distinct ids and under one
//    repeated id (two runs in a row), none refused;
//  - two jobs at once on one sidecar, each deciding its own steps;
//  - a new launch of a job id held while the previous launch's rank is still
//    connected, served once it left, and refused with the exact text when it
//    does not leave within --job_handover_timeout.
// Nothing sleeps: held ranks are observed through the sidecar's log line.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/testing/local_cluster.h"
#include "core/sync.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord::testing {
namespace {

using ::testing::MatchesRegex;

constexpr char kHeldLine[] = "starts a new launch of the job on this node";

int BackToBackJobs() {
  int jobs = 500;
  if (const char* e = getenv("ACCORD_BACK_TO_BACK_JOBS"); e != nullptr) {
    (void)absl::SimpleAtoi(e, &jobs);
  }
  return jobs;
}

std::unique_ptr<LocalCluster> StartCluster(std::vector<std::string> sidecar_flags = {}) {
  LocalClusterOptions o;
  o.num_sidecars = 1;
  o.sidecar_flags = std::move(sidecar_flags);
  o.sidecar_flags.push_back("--metrics_port=-1");
  o.coordinator_flags = {"--metrics_port=-1"};
  o.echo = false;
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

absl::StatusOr<std::unique_ptr<Client>> Connect(const LocalCluster& cluster, const std::string& job,
                                                int rank, int world) {
  ClientOptions c;
  c.socket_path = cluster.sidecar_sockets()[0];
  c.job_id = job;
  c.rank = rank;
  c.world_size = world;
  c.local_rank = rank;
  c.connect_timeout = absl::Seconds(60);
  return Client::Connect(c);
}

const GroupSpec kSpec{"g", {{"w", 4, 8}, {"b", 4, 4}}};

// One rank's job: registers the group and gets `steps` decisions. The
// first error, or OK.
absl::Status RunSteps(Client& c, int steps) {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  if (absl::Status s = c.RegisterGroup(kSpec, Policy(), deadline); !s.ok()) return s;
  for (int64_t step = 0; step < steps; ++step) {
    absl::StatusOr<Decision> d =
        c.Wait(c.Submit(GroupSubmission{"g", step, {DType::kBFloat16, DType::kFloat32}}), deadline);
    if (!d.ok()) return d.status();
  }
  return absl::OkStatus();
}

// The ranks of one job, each on its own thread (as processes would): each
// connects, says so, runs `steps`, and keeps its client open (the job's
// processes have not exited yet) until the job is closed.
class Job {
 public:
  Job(const LocalCluster& cluster, std::string id, int world, int steps)
      : results_(world), clients_(world) {
    for (int r = 0; r < world; ++r) {
      threads_.emplace_back([this, &cluster, id, r, world, steps] {
        absl::StatusOr<std::unique_ptr<Client>> c = Connect(cluster, id, r, world);
        {
          accord::MutexLock l(&mu_);
          ++connected_;
        }
        if (!c.ok()) {
          results_[r] = c.status();
          return;
        }
        results_[r] = RunSteps(**c, steps);
        clients_[r] = *std::move(c);
      });
    }
  }
  ~Job() { Finish(); }

  // Blocks until every rank's Connect returned (welcomed or refused).
  void AwaitConnected() {
    accord::MutexLock l(&mu_);
    mu_.Await(absl::Condition(
        +[](Job* j) ABSL_EXCLUSIVE_LOCKS_REQUIRED(j->mu_) {
          return j->connected_ == static_cast<int>(j->threads_.size());
        },
        this));
  }
  // Waits for every rank's steps; the first failure of each rank, or OK.
  const std::vector<absl::Status>& Finish() {
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
    return results_;
  }
  // The job's processes exit: every client closes.
  void Close() {
    Finish();
    clients_.clear();
  }

 private:
  accord::Mutex mu_;
  int connected_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<absl::Status> results_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::thread> threads_;  // last: started once the above exist
};

// 500 jobs of 2 ranks through one sidecar. Each job's ranks arrive while the
// previous job's clients are still open, and those close right then (a
// launcher that starts the next job as its previous one exits): the race of
// a rank arriving while the previous job's ranks leave, made certain rather
// than occasional. Under a distinct id the new job is served at once, beside
// the leaving one; under the repeated id (every second and third job) both
// its ranks are held until the previous run's ranks have left, then served.
// None is refused, and every job decides its steps.
TEST(SidecarJobsIntegrationTest, FiveHundredJobsBackToBackThroughOneSidecarNoneRefused) {
  std::unique_ptr<LocalCluster> cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const int jobs = BackToBackJobs();
  constexpr int kWorld = 2;
  int refused = 0, held = 0;
  std::string first_refusal;
  std::unique_ptr<Job> previous;
  std::string previous_id;
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < jobs; ++i) {
    const std::string id = i % 3 == 0 ? absl::StrCat("b2b-", i) : "b2b-repeated";
    auto job = std::make_unique<Job>(*cluster, id, kWorld, /*steps=*/2);
    if (previous != nullptr && id == previous_id) {
      // A new run of the same id: both ranks wait for the previous run's.
      held += kWorld;
      ASSERT_TRUE(
          cluster->WaitForSidecarOutput(0, kHeldLine, held, absl::Now() + absl::Seconds(30)).ok())
          << "job " << i << " (" << id << "): its ranks were not held";
    } else {
      job->AwaitConnected();  // served beside the previous job, still open
    }
    if (previous != nullptr) previous->Close();
    for (const absl::Status& s : job->Finish()) {
      if (s.ok()) continue;
      if (refused++ == 0) first_refusal = absl::StrCat("job ", i, " (", id, "): ", s.ToString());
    }
    previous = std::move(job);
    previous_id = id;
  }
  previous->Close();
  std::printf(
      "%d jobs back to back through one sidecar in %s: %d ranks refused, %d held until the "
      "previous run of their id had left\n",
      jobs, absl::FormatDuration(absl::Now() - t0).c_str(), refused, held);
  EXPECT_EQ(refused, 0) << first_refusal;
}

// Two jobs on one sidecar at the same time (two 4-GPU jobs on one 8-GPU
// node, scaled down): every rank of both is connected before any registers,
// and each job decides its own steps.
TEST(SidecarJobsIntegrationTest, TwoJobsAtOnceOnOneSidecarEachDecideTheirSteps) {
  std::unique_ptr<LocalCluster> cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  std::vector<std::unique_ptr<Client>> clients;
  for (const char* job : {"left-half", "right-half"}) {
    for (int r = 0; r < 2; ++r) {
      absl::StatusOr<std::unique_ptr<Client>> c = Connect(*cluster, job, r, 2);
      ASSERT_TRUE(c.ok()) << job << " rank " << r << ": " << c.status();
      clients.push_back(*std::move(c));
    }
  }
  std::vector<absl::Status> results(clients.size());
  std::vector<std::thread> ranks;
  for (size_t i = 0; i < clients.size(); ++i) {
    ranks.emplace_back([&, i] { results[i] = RunSteps(*clients[i], 5); });
  }
  for (std::thread& t : ranks) t.join();
  for (size_t i = 0; i < results.size(); ++i) EXPECT_TRUE(results[i].ok()) << i << results[i];
  const std::string coordinator = cluster->CoordinatorOutput();
  EXPECT_THAT(coordinator, ::testing::HasSubstr("job left-half: run"));
  EXPECT_THAT(coordinator, ::testing::HasSubstr("job right-half: run"));
}

// A rank of the next run under the same id connects while the previous
// run's rank is still connected: its Connect waits (the sidecar logs that it
// holds it) and returns once that rank left; the new run is clean.
TEST(SidecarJobsIntegrationTest, ANewLaunchOfAJobIsServedAsSoonAsThePreviousOneLeft) {
  std::unique_ptr<LocalCluster> cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  absl::StatusOr<std::unique_ptr<Client>> old_rank = Connect(*cluster, "again", 0, 1);
  ASSERT_TRUE(old_rank.ok()) << old_rank.status();
  ASSERT_TRUE(RunSteps(**old_rank, 3).ok());
  ASSERT_TRUE((*old_rank)->kv().Set("boot/id", "old").ok());
  absl::Status new_run;
  std::thread next([&] {
    absl::StatusOr<std::unique_ptr<Client>> c = Connect(*cluster, "again", 0, 1);
    if (!c.ok()) {
      new_run = c.status();
      return;
    }
    // Steps from 0 again, and not the previous run's keys.
    absl::StatusOr<std::vector<std::string>> stale =
        (*c)->kv().Get({"boot/id"}, std::chrono::milliseconds(0));
    new_run = stale.status().code() == absl::StatusCode::kNotFound
                  ? RunSteps(**c, 3)
                  : absl::InternalError("the new run saw the previous run's key");
  });
  ASSERT_TRUE(cluster->WaitForSidecarOutput(0, kHeldLine, 1, absl::Now() + absl::Seconds(60)).ok());
  old_rank->reset();  // the previous run's rank leaves
  next.join();
  EXPECT_TRUE(new_run.ok()) << new_run;
}

// The previous launch's rank never leaves: the new launch's rank is refused
// after --job_handover_timeout, with the exact text; the previous one goes on.
TEST(SidecarJobsIntegrationTest, ANewLaunchIsRefusedWhenThePreviousOneDoesNotLeaveInTime) {
  std::unique_ptr<LocalCluster> cluster = StartCluster({"--job_handover_timeout=1s"});
  ASSERT_NE(cluster, nullptr);
  absl::StatusOr<std::unique_ptr<Client>> old_rank = Connect(*cluster, "stuck", 0, 1);
  ASSERT_TRUE(old_rank.ok()) << old_rank.status();
  absl::StatusOr<std::unique_ptr<Client>> again = Connect(*cluster, "stuck", 0, 1);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(again.status().message()),
              MatchesRegex(".*job stuck: rank 0 waited 1s \\(--job_handover_timeout\\) for the "
                           "rank 0 already connected to this sidecar to leave, but it is still "
                           "connected: a previous launch of the job is still running here, or two "
                           "local processes have RANK 0; stop the previous launch's processes or "
                           "check RANK"));
  EXPECT_TRUE(RunSteps(**old_rank, 2).ok());
}

}  // namespace
}  // namespace accord::testing
