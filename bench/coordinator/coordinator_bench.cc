// Coordinator capacity: plays N sidecars x G groups per step against the
// Coordinator logic class in-process and reports the coordinator's CPU time
// per step and decisions per second, for (a) every node manifest repeating
// (cache hits, same_as_previous), sent per manifest in repeat form, (b) the
// same sent as one batch repeat record per node (ManifestBatch.repeat_step +
// repeat_batch_key), and (c) none repeating (full form, full Decide). Baseline in the same run:
// protobuf parsing of the same messages alone, so the logic's own cost is visible.
//
//   accord_coordinator_bench --nodes=2048 --ranks_per_node=8 --groups=200 --params=16 --steps=3
#include <time.h>

#include <atomic>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/common/clock.h"
#include "daemon/coordinator/coordinator.h"
#include "proto/wire.h"

ABSL_FLAG(int, nodes, 2048, "sidecars");
ABSL_FLAG(int, ranks_per_node, 8, "ranks per sidecar");
ABSL_FLAG(int, groups, 200, "groups per step");
ABSL_FLAG(int, params, 16, "parameters per group");
ABSL_FLAG(int, steps, 3, "measured steps per mode");
ABSL_FLAG(std::string, modes, "repeat,batch,full",
          "modes to run, in order: repeat (per-manifest repeat form), batch (batch repeat "
          "record), full (every manifest in full form)");

namespace accord::daemon {
namespace {

class CountingSink : public NodeSink {
 public:
  void Send(std::shared_ptr<const v1::CoordinatorMessage> m) override {
    count_.fetch_add(1, std::memory_order_relaxed);
  }
  std::atomic<int64_t> count_{0};
};

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct Setup {
  int nodes, rpn, groups, params, world;
};

// Node n's full-form manifest for group g at `step`; `variant` changes usage.
v1::Manifest FullManifest(const Setup& s, int n, int g, int64_t step, int variant) {
  std::vector<std::optional<DType>> dtypes(s.params);
  for (int p = 0; p < s.params; ++p) {
    if ((p + g + variant) % 4 != 0) dtypes[p] = DType::kBFloat16;
  }
  Manifest m = RankManifest(step, n * s.rpn, s.world, dtypes);
  for (int r = 0; r < s.rpn; ++r) m.ranks.Add(n * s.rpn + r);
  v1::Manifest out;
  wire::ManifestToProto(absl::StrCat("group", g), m, /*with_ranks=*/false, &out);
  return out;
}

struct Result {
  double cpu_s = 0;
  double parse_s = 0;
  int64_t decisions = 0;
  int64_t bytes = 0;
};

enum class Mode { kRepeat, kBatchRepeat, kFull };

// One step: serializes every node's batch (untimed), then times parse +
// HandleMessage for all nodes on this thread.
Result RunStep(Coordinator& c, const std::vector<Coordinator::SessionId>& ids, const Setup& s,
               int64_t step, Mode mode, std::vector<std::vector<uint64_t>>& keys) {
  std::vector<std::string> wire(s.nodes);
  Result r;
  const bool repeat = mode == Mode::kRepeat;
  for (int n = 0; n < s.nodes; ++n) {
    v1::NodeMessage msg;
    if (mode == Mode::kBatchRepeat) {
      // The previous batch (per-manifest repeats or full) had these keys.
      wire::BatchKeyHasher hasher;
      for (int g = 0; g < s.groups; ++g) hasher.Add(absl::StrCat("group", g), keys[n][g]);
      msg.mutable_manifests()->set_repeat_step(step);
      msg.mutable_manifests()->set_repeat_batch_key(hasher.Finish());
    }
    for (int g = 0; mode != Mode::kBatchRepeat && g < s.groups; ++g) {
      v1::Manifest* m = msg.mutable_manifests()->add_manifests();
      if (repeat) {
        m->set_group_id(absl::StrCat("group", g));
        m->set_step(step);
        m->set_repeat(true);
        m->set_cache_key(keys[n][g]);
      } else {
        *m = FullManifest(s, n, g, step, static_cast<int>(step % 2));
        keys[n][g] = m->cache_key();
      }
    }
    wire[n] = msg.SerializeAsString();
    r.bytes += static_cast<int64_t>(wire[n].size());
  }
  // Baseline: parsing alone.
  double t0 = ThreadCpuSeconds();
  for (int n = 0; n < s.nodes; ++n) {
    v1::NodeMessage msg;
    msg.ParseFromString(wire[n]);
  }
  r.parse_s = ThreadCpuSeconds() - t0;
  const int64_t before = c.stats().decisions;
  t0 = ThreadCpuSeconds();
  v1::NodeMessage msg;
  for (int n = 0; n < s.nodes; ++n) {
    msg.ParseFromString(wire[n]);
    c.HandleMessage(ids[n], msg);
  }
  r.cpu_s = ThreadCpuSeconds() - t0;
  r.decisions = c.stats().decisions - before;
  return r;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  Setup s{absl::GetFlag(FLAGS_nodes), absl::GetFlag(FLAGS_ranks_per_node),
          absl::GetFlag(FLAGS_groups), absl::GetFlag(FLAGS_params), 0};
  s.world = s.nodes * s.rpn;
  const int steps = absl::GetFlag(FLAGS_steps);
  CoordinatorOptions o;
  o.start_timer_thread = false;
  o.deadline = absl::Hours(1);
  Coordinator c(o, RealClock::Get());
  std::vector<CountingSink> sinks(s.nodes);
  std::vector<Coordinator::SessionId> ids(s.nodes);
  for (int n = 0; n < s.nodes; ++n) {
    ids[n] = c.OpenSession(&sinks[n]);
    v1::NodeMessage hello;
    hello.mutable_hello()->set_job_id("bench");
    hello.mutable_hello()->set_node_id(absl::StrCat("node", n));
    hello.mutable_hello()->set_world_size(s.world);
    for (int r = 0; r < s.rpn; ++r) hello.mutable_hello()->add_ranks(n * s.rpn + r);
    c.HandleMessage(ids[n], hello);
  }
  for (int g = 0; g < s.groups; ++g) {
    GroupSpec spec;
    spec.group_id = absl::StrCat("group", g);
    for (int p = 0; p < s.params; ++p) {
      spec.params.push_back(ParamSpec{absl::StrCat("p", p), 1024, 1024 * 64});
    }
    v1::NodeMessage reg;
    *reg.mutable_registration()->mutable_registration() = wire::GroupSpecToProto(spec, Policy());
    for (int n = 0; n < s.nodes; ++n) {
      reg.mutable_registration()->clear_ranks();
      for (int r = 0; r < s.rpn; ++r) reg.mutable_registration()->add_ranks(n * s.rpn + r);
      c.HandleMessage(ids[n], reg);
    }
  }
  std::printf("coordinator capacity: %d nodes x %d ranks = %d ranks, %d groups x %d params\n",
              s.nodes, s.rpn, s.world, s.groups, s.params);
  std::vector<std::vector<uint64_t>> keys(s.nodes, std::vector<uint64_t>(s.groups));
  int64_t step = 0;
  RunStep(c, ids, s, step++, Mode::kFull, keys);  // warm-up, fills the cache
  std::vector<Mode> modes;
  for (absl::string_view m : absl::StrSplit(absl::GetFlag(FLAGS_modes), ',')) {
    if (m == "repeat") modes.push_back(Mode::kRepeat);
    if (m == "batch") modes.push_back(Mode::kBatchRepeat);
    if (m == "full") modes.push_back(Mode::kFull);
  }
  for (Mode mode : modes) {
    double cpu = 0, parse = 0, worst = 0;
    int64_t decisions = 0, bytes = 0;
    for (int i = 0; i < steps; ++i) {
      Result r = RunStep(c, ids, s, step++, mode, keys);
      cpu += r.cpu_s;
      parse += r.parse_s;
      worst = std::max(worst, r.cpu_s);
      decisions += r.decisions;
      bytes += r.bytes;
    }
    CoordinatorStats st = c.stats();
    std::printf(
        "%-12s CPU/step %8.1f ms (worst %8.1f ms; parse-only baseline %6.1f ms)  "
        "decisions/s %10.0f  node manifests/s %10.0f  in %6.1f MB/step  decisions %lld "
        "(expected %lld)  cache hits %lld misses %lld same_as_previous %lld errors %lld\n",
        mode == Mode::kRepeat        ? "all-repeat"
        : mode == Mode::kBatchRepeat ? "batch-repeat"
                                     : "none-repeat",
        1e3 * cpu / steps, 1e3 * worst, 1e3 * parse / steps, decisions / cpu,
        double(s.nodes) * s.groups * steps / cpu, bytes / 1e6 / steps,
        static_cast<long long>(decisions), static_cast<long long>(int64_t{s.groups} * steps),
        static_cast<long long>(st.cache_hits), static_cast<long long>(st.cache_misses),
        static_cast<long long>(st.same_as_previous), static_cast<long long>(st.errors));
  }
  int64_t sent = 0;
  for (auto& k : sinks) sent += k.count_.load();
  std::printf("messages to sinks: %lld (one shared DecisionBatch per node per completing batch)\n",
              static_cast<long long>(sent));
  c.Stop();
  return 0;
}

}  // namespace
}  // namespace accord::daemon

int main(int argc, char** argv) { return accord::daemon::Main(argc, argv); }
