// soak_rank: one process hosting --threads ranks (first rank --first_rank),
// each a separate client connection to the sidecar at --socket. Every rank
// registers --groups groups and runs --steps steps with usage and dtypes drawn
// from a seeded generator: per (group, step) some parameters are unused
// everywhere, the rest used by each rank with probability 1/2 in a random
// float dtype, and about half of the steps repeat the previous step's content
// (the cache path). Each rank checks it got exactly one decision per
// (group, step), for the right step, and prints
//   soak rank R decisions N digest HEX
// where the digest covers every decision in order (equal on all ranks).
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "core/hash.h"

ABSL_FLAG(std::string, socket, "", "the sidecar's Unix socket");
ABSL_FLAG(std::string, job, "soak", "job id");
ABSL_FLAG(int, first_rank, 0, "first rank hosted here");
ABSL_FLAG(int, threads, 1, "ranks hosted here, one thread and connection each");
ABSL_FLAG(int, world, 1, "world size");
ABSL_FLAG(int, groups, 4, "groups per step");
ABSL_FLAG(int, params, 8, "parameters per group");
ABSL_FLAG(int, steps, 1000, "steps");
ABSL_FLAG(uint64_t, seed, 1, "seed of the usage generator");
ABSL_FLAG(int, warm_step, 50, "print 'soak warm' after this step (rank --first_rank only)");

namespace accord {
namespace {

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// The step whose content `step` of `group` uses: itself, or (about half of
// the time, the same on every rank) the step before's.
int64_t ContentStep(uint64_t seed, int group, int64_t step) {
  while (step > 0 && (Mix(seed ^ Mix(group * 1000003ull + step)) & 1)) --step;
  return step;
}

std::vector<std::optional<DType>> Usage(uint64_t seed, int rank, int group, int64_t step,
                                        int params) {
  const int64_t cs = ContentStep(seed, group, step);
  std::vector<std::optional<DType>> out(params);
  constexpr DType kTypes[] = {DType::kBFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat16};
  for (int i = 0; i < params; ++i) {
    const uint64_t global = Mix(seed ^ Mix((group * 7919ull + cs) * 131ull + i));
    if (global % 10 < 3) continue;  // unused on every rank
    const uint64_t local = Mix(global ^ Mix(rank + 1));
    if (local & 1) out[i] = kTypes[(local >> 1) % 4];
  }
  // Rank 0 always uses parameter 0 in fp32 at even content steps, so the
  // dtype join changes over time.
  if (rank == 0 && cs % 2 == 0) out[0] = DType::kFloat32;
  return out;
}

int RunRank(int rank) {
  const int world = absl::GetFlag(FLAGS_world);
  const int groups = absl::GetFlag(FLAGS_groups);
  const int params = absl::GetFlag(FLAGS_params);
  const int steps = absl::GetFlag(FLAGS_steps);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  ClientOptions o;
  o.socket_path = absl::GetFlag(FLAGS_socket);
  o.job_id = absl::GetFlag(FLAGS_job);
  o.rank = rank;
  o.world_size = world;
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  if (!c.ok()) {
    printf("soak rank %d connect: %s\n", rank, c.status().ToString().c_str());
    return 1;
  }
  const absl::Duration wait = absl::Seconds(60);
  for (int g = 0; g < groups; ++g) {
    GroupSpec spec;
    spec.group_id = absl::StrCat("g", g);
    for (int i = 0; i < params; ++i) {
      const int64_t dim0 = world + 1 + i * 3 + g;
      spec.params.push_back({absl::StrCat("p", i), dim0, dim0 * 2});
    }
    if (absl::Status s = (*c)->RegisterGroup(spec, Policy(), absl::Now() + wait); !s.ok()) {
      printf("soak rank %d register g%d: %s\n", rank, g, s.ToString().c_str());
      return 1;
    }
  }
  StableHasher digest;
  int64_t decisions = 0;
  for (int step = 0; step < steps; ++step) {
    std::vector<GroupSubmission> batch;
    for (int g = 0; g < groups; ++g) {
      batch.push_back({absl::StrCat("g", g), step, Usage(seed, rank, g, step, params)});
    }
    std::vector<DecisionFuture> f = (*c)->SubmitBatch(batch);
    for (int g = 0; g < groups; ++g) {
      absl::StatusOr<Decision> d = (*c)->Wait(f[g], absl::Now() + wait);
      if (!d.ok()) {
        printf("soak rank %d step %d g%d: %s\n", rank, step, g, d.status().ToString().c_str());
        return 1;
      }
      if (d->step != step) {
        printf("soak rank %d step %d g%d: decision for step %lld\n", rank, step, g,
               static_cast<long long>(d->step));
        return 1;
      }
      ++decisions;
      digest.AddU64(static_cast<uint64_t>(g));
      digest.AddU64(static_cast<uint64_t>(d->step));
      digest.AddU64(static_cast<uint64_t>(d->wire_dtype));
      for (bool b : d->included) digest.AddU64(b ? 1 : 0);
      digest.AddU64(d->layout_fingerprint);
    }
    if (rank == absl::GetFlag(FLAGS_first_rank) && step == absl::GetFlag(FLAGS_warm_step)) {
      printf("soak warm\n");
      fflush(stdout);
    }
  }
  printf("soak rank %d decisions %lld digest %016llx\n", rank, static_cast<long long>(decisions),
         static_cast<unsigned long long>(digest.Finish()));
  fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace accord

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int first = absl::GetFlag(FLAGS_first_rank);
  const int n = absl::GetFlag(FLAGS_threads);
  std::vector<int> rc(n, 1);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) threads.emplace_back([&, i] { rc[i] = accord::RunRank(first + i); });
  for (std::thread& t : threads) t.join();
  for (int r : rc) {
    if (r != 0) return 1;
  }
  return 0;
}
