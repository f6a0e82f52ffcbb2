// Coordinator capacity: plays N sidecars x G groups per step against the
// Coordinator logic class in-process and reports the coordinator's CPU time
// per step and decisions per second, for (a) every node manifest repeating
// (cache hits, same_as_previous), sent per manifest in repeat form, (b) the
// same sent as one batch repeat record per node (ManifestBatch.repeat_step +
// repeat_batch_key), and (c) none repeating (full form, full Decide). Baseline in the same run:
// protobuf parsing of the same messages alone, so the logic's own cost is visible.
//
// --relays=R: the coordinator sees R relays (docs/ARCHITECTURE.md, "Relays")
// instead of the nodes, each sending one merged manifest per group covering
// nodes/R nodes' ranks; the bench then also times one relay's own merge of
// its nodes/R sidecars (the accord Relay class in-process). --serialize says
// whether the broadcast DecisionBatch is serialized by the sinks (once per
// message, as the gRPC adapter does, or once per stream, as before) and
// counted in the CPU figure. Mode "recover" times a restarted coordinator
// taking every node's hello, registrations and one pending step in full form
// until every node has its decisions (the coordinator's side of recovery;
// reconnect backoff and the network come on top). Peak RSS is printed last.
//
// Mode "torch" is the steady-state pattern of accord.torch (docs/PARTICIPATION.md,
// "One order"): every rank submits its step as one batch at the release, the
// model's groups plus the guard's step window (one more group, 128 slots), so
// each node sends one batch repeat per step; it runs the batch mode with
// --groups + 1 groups (in repeat form an entry costs a cache key whatever its
// parameter count, so the guard's 128 slots need no special shape).
//
//   accord_coordinator_bench --nodes=2048 --ranks_per_node=8 --groups=200 --params=16 --steps=3
//   accord_coordinator_bench --nodes=16384 --relays=128 --modes=batch,full,recover
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/common/clock.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/relay/relay.h"
#include "proto/wire.h"

ABSL_FLAG(int, nodes, 2048, "sidecars");
ABSL_FLAG(int, ranks_per_node, 8, "ranks per sidecar");
ABSL_FLAG(int, groups, 200, "groups per step");
ABSL_FLAG(int, params, 16, "parameters per group");
ABSL_FLAG(int, steps, 3, "measured steps per mode");
ABSL_FLAG(std::string, modes, "repeat,batch,full",
          "modes to run, in order: repeat (per-manifest repeat form), batch (batch repeat "
          "record), torch (accord.torch's steady state: one batch repeat per node of the groups "
          "and the guard's window group), full (every manifest in full form), recover (a "
          "restarted coordinator: "
          "hellos, registrations and one pending step from every node)");
ABSL_FLAG(std::string, repeat_waves, "on,off",
          "coordinator settings to run the modes with, in order, each on a fresh coordinator: on "
          "(repeat waves, docs/ARCHITECTURE.md) and/or off (entry by entry: the baseline)");
ABSL_FLAG(int, relays, 0,
          "0: the coordinator sees every node; R > 0: it sees R relays, each merging nodes/R "
          "nodes (nodes must be a multiple of R)");
ABSL_FLAG(std::string, decide_threads, "1",
          "coordinator --decide_threads settings to run the modes with, in order, each on a "
          "fresh coordinator (docs/ARCHITECTURE.md, More than one core); 1 is the baseline");
ABSL_FLAG(int, feeders, 1,
          "threads handing the peers' messages to the coordinator at once, as gRPC's threads "
          "do (peer n on thread n % feeders, in order)");
ABSL_FLAG(std::string, serialize, "none",
          "broadcast serialization counted in the CPU figure: none, once (one serialization "
          "per message, shared by every stream) or per_stream (one per stream)");

namespace accord::daemon {
namespace {

enum class Serialize { kNone, kOnce, kPerStream };

// The bytes of the last message serialized (shared by every sink, as the gRPC
// adapter's SerializedOnce is).
struct SharedSerialization {
  std::shared_ptr<const v1::CoordinatorMessage> last;
  std::string bytes;
  int64_t serializations = 0;
};

class CountingSink : public NodeSink {
 public:
  void Send(std::shared_ptr<const v1::CoordinatorMessage> m) override {
    count_.fetch_add(1, std::memory_order_relaxed);
    if (mode_ == Serialize::kPerStream) {
      bytes_ += static_cast<int64_t>(m->SerializeAsString().size());
    } else if (mode_ == Serialize::kOnce && shared_ != nullptr) {
      if (shared_->last != m) {
        shared_->last = m;
        shared_->bytes = m->SerializeAsString();
        ++shared_->serializations;
      }
      bytes_ += static_cast<int64_t>(shared_->bytes.size());
    }
  }
  void Configure(Serialize mode, SharedSerialization* shared) {
    mode_ = mode;
    shared_ = shared;
  }
  std::atomic<int64_t> count_{0};
  int64_t bytes_ = 0;

 private:
  Serialize mode_ = Serialize::kNone;
  SharedSerialization* shared_ = nullptr;
};

int64_t PeakRssMiB() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024;
}

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Every thread of the process: the feeders and the coordinator's decide pool.
double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// `nodes` are the coordinator's peers: sidecars, or relays (then `rpn` is the
// ranks behind one relay).
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
  double cpu_s = 0;   // every thread's CPU while the messages were handled
  double wall_s = 0;  // wall time of the same
  double parse_s = 0;
  int64_t decisions = 0;
  int64_t bytes = 0;
};

enum class Mode { kRepeat, kBatchRepeat, kFull };

// One step: serializes every node's batch (untimed), then times parse +
// HandleMessage for all nodes, on this thread or on `feeders` threads.
Result RunStep(Coordinator& c, const std::vector<Coordinator::SessionId>& ids, const Setup& s,
               int64_t step, Mode mode, std::vector<std::vector<uint64_t>>& keys, int feeders = 1) {
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
  auto feed = [&](int first, int stride) {
    v1::NodeMessage msg;
    for (int n = first; n < s.nodes; n += stride) {
      msg.ParseFromString(wire[n]);
      c.HandleMessage(ids[n], msg);
    }
  };
  t0 = ProcessCpuSeconds();
  const absl::Time w0 = absl::Now();
  if (feeders <= 1) {
    feed(0, 1);
  } else {
    std::vector<std::thread> threads;
    for (int t = 0; t < feeders; ++t) threads.emplace_back(feed, t, feeders);
    for (std::thread& t : threads) t.join();
  }
  r.wall_s = absl::ToDoubleSeconds(absl::Now() - w0);
  r.cpu_s = ProcessCpuSeconds() - t0;
  r.decisions = c.stats().decisions - before;
  return r;
}

// Every peer's hello and every group's registration, as after a (re)start.
std::vector<Coordinator::SessionId> JoinAll(Coordinator& c, std::vector<CountingSink>& sinks,
                                            const Setup& s) {
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
  return ids;
}

std::unique_ptr<Coordinator> NewCoordinator(bool repeat_waves = true, int decide_threads = 1) {
  CoordinatorOptions o;
  o.start_timer_thread = false;
  o.repeat_waves = repeat_waves;
  o.decide_threads = decide_threads;
  o.deadline = absl::Hours(1);
  return std::make_unique<Coordinator>(o, RealClock::Get());
}

void Configure(std::vector<CountingSink>& sinks, Serialize mode, SharedSerialization* shared) {
  for (CountingSink& k : sinks) k.Configure(mode, shared);
}

// A restarted coordinator: every peer's hello, registrations and one pending
// step in full form, until every peer has its decisions (synchronous here).
void RunRecovery(const Setup& s, Serialize serialize, int decide_threads) {
  std::vector<std::vector<uint64_t>> keys(s.nodes, std::vector<uint64_t>(s.groups));
  std::unique_ptr<Coordinator> c = NewCoordinator(/*repeat_waves=*/true, decide_threads);
  std::vector<CountingSink> sinks(s.nodes);
  SharedSerialization shared;
  Configure(sinks, serialize, &shared);
  const absl::Time wall0 = absl::Now();
  const double t0 = ThreadCpuSeconds();
  std::vector<Coordinator::SessionId> ids = JoinAll(*c, sinks, s);
  const double joined = ThreadCpuSeconds() - t0;
  Result r = RunStep(*c, ids, s, /*step=*/0, Mode::kFull, keys);
  std::printf("decide threads %d: ", decide_threads);
  const double wall = absl::ToDoubleSeconds(absl::Now() - wall0);
  std::printf(
      "%-12s CPU %8.1f ms (hellos + %d registrations %8.1f ms, pending step %8.1f ms)  "
      "wall %8.1f ms  decisions %lld (expected %d)\n",
      "recover", 1e3 * (joined + r.cpu_s), s.nodes * s.groups, 1e3 * joined, 1e3 * r.cpu_s,
      1e3 * wall, static_cast<long long>(r.decisions), s.groups);
  c->Stop();
}

class CountingUpstream : public UpstreamSink {
 public:
  void Send(v1::NodeMessage m) override {
    ++sent;
    if (m.has_manifests()) manifests += m.manifests().manifests_size();
  }
  void Reset(std::vector<v1::NodeMessage> m) override {}
  void Reconnect() override {}
  int64_t sent = 0;
  int64_t manifests = 0;
};

const char* ModeName(Mode mode) {
  return mode == Mode::kFull ? "full form" : mode == Mode::kRepeat ? "repeat form" : "batch repeat";
}

// Opens one session per sidecar on `relay` (each saying its `s.rpn` ranks),
// welcomes the relay from above and registers every group through each.
std::vector<Relay::SessionId> JoinRelay(Relay& relay, std::vector<CountingSink>& sinks,
                                        const Setup& s) {
  std::vector<Relay::SessionId> ids(s.nodes);
  for (int n = 0; n < s.nodes; ++n) {
    ids[n] = relay.OpenSession(&sinks[n]);
    v1::NodeMessage hello;
    hello.mutable_hello()->set_job_id("bench");
    hello.mutable_hello()->set_node_id(absl::StrCat("node", n));
    hello.mutable_hello()->set_world_size(s.world);
    for (int r = 0; r < s.rpn; ++r) hello.mutable_hello()->add_ranks(n * s.rpn + r);
    relay.HandleMessage(ids[n], hello);
  }
  v1::CoordinatorMessage welcome;
  welcome.mutable_welcome()->set_run_id("r");
  relay.HandleCoordinatorMessage(&welcome);
  for (int g = 0; g < s.groups; ++g) {
    GroupSpec spec;
    spec.group_id = absl::StrCat("group", g);
    for (int p = 0; p < s.params; ++p) {
      spec.params.push_back(ParamSpec{absl::StrCat("p", p), 1024, 1024 * 64});
    }
    v1::NodeMessage reg;
    *reg.mutable_registration()->mutable_registration() = wire::GroupSpecToProto(spec, Policy());
    for (int n = 0; n < s.nodes; ++n) relay.HandleMessage(ids[n], reg);
  }
  return ids;
}

// Each sidecar's node message at `step` in `mode`, serialized; full forms
// record their keys in `keys`, repeats name them.
std::vector<std::string> SidecarBatches(const Setup& s, Mode mode, int64_t step,
                                        std::vector<std::vector<uint64_t>>& keys) {
  std::vector<std::string> wire(s.nodes);
  for (int n = 0; n < s.nodes; ++n) {
    v1::NodeMessage msg;
    if (mode == Mode::kBatchRepeat) {
      // The sidecar's previous batch (full or per-manifest repeats) had
      // these keys; the relay offers batch repeats downstream.
      wire::BatchKeyHasher hasher;
      for (int g = 0; g < s.groups; ++g) hasher.Add(absl::StrCat("group", g), keys[n][g]);
      msg.mutable_manifests()->set_repeat_step(step);
      msg.mutable_manifests()->set_repeat_batch_key(hasher.Finish());
    }
    for (int g = 0; mode != Mode::kBatchRepeat && g < s.groups; ++g) {
      v1::Manifest* m = msg.mutable_manifests()->add_manifests();
      if (mode == Mode::kRepeat) {
        m->set_group_id(absl::StrCat("group", g));
        m->set_step(step);
        m->set_repeat(true);
        m->set_cache_key(keys[n][g]);
      } else {
        *m = FullManifest(s, n, g, step, 0);
        keys[n][g] = m->cache_key();
      }
    }
    wire[n] = msg.SerializeAsString();
  }
  return wire;
}

// The coordinator's answer at `step`: every group the same as before.
v1::CoordinatorMessage SameAsPreviousDecisions(int groups, int64_t step) {
  v1::CoordinatorMessage decisions;
  for (int g = 0; g < groups; ++g) {
    v1::Decision* d = decisions.mutable_decisions()->add_decisions();
    d->set_group_id(absl::StrCat("group", g));
    d->set_step(step);
    d->set_same_as_previous(true);
  }
  return decisions;
}

// One relay's own work per step: `fanin` sidecars' node manifests (each of
// `rpn` ranks) merged into one upstream manifest per group, then one decision
// batch fanned out. Full form or per-manifest repeat form.
void RunRelayFanIn(int fanin, int rpn, int groups, int params, int steps) {
  const Setup s{fanin, rpn, groups, params, fanin * rpn};
  RelayOptions o;
  o.relay_id = "relay0";
  o.start_timer_thread = false;
  Relay relay(o);
  CountingUpstream up;
  relay.SetUpstream(&up);
  relay.OnUpstreamConnected();
  std::vector<CountingSink> sinks(fanin);
  const std::vector<Relay::SessionId> ids = JoinRelay(relay, sinks, s);
  std::vector<std::vector<uint64_t>> keys(fanin, std::vector<uint64_t>(groups));
  int64_t step = 0;
  for (Mode mode : {Mode::kFull, Mode::kRepeat, Mode::kBatchRepeat}) {
    double cpu = 0;
    const int64_t before = up.manifests;
    for (int i = 0; i < steps; ++i, ++step) {
      const std::vector<std::string> wire = SidecarBatches(s, mode, step, keys);
      v1::CoordinatorMessage decisions = SameAsPreviousDecisions(groups, step);
      const double t0 = ThreadCpuSeconds();
      v1::NodeMessage msg;
      for (int n = 0; n < fanin; ++n) {
        msg.ParseFromString(wire[n]);
        relay.HandleMessage(ids[n], msg);
      }
      relay.HandleCoordinatorMessage(&decisions);
      cpu += ThreadCpuSeconds() - t0;
    }
    std::printf(
        "relay fan-in %d x %d ranks, %-11s CPU/step %8.2f ms  upstream manifests/step %lld\n",
        fanin, rpn, ModeName(mode), 1e3 * cpu / steps,
        static_cast<long long>((up.manifests - before) / steps));
  }
  relay.Stop();
}

// What the flags ask the bench to run.
struct BenchConfig {
  int nodes = 0;
  int relays = 0;
  int rpn = 0;
  int steps = 0;
  int feeders = 1;
  std::string serialize_name;
  Serialize serialize = Serialize::kNone;
  std::vector<Mode> modes;
  bool recover = false;
  std::vector<bool> waves;  // repeat waves on or off, one coordinator each
  std::vector<int> decide_threads;
  Setup setup{};  // as the coordinator sees it: its peers are the nodes, or the relays
};

// INVALID_ARGUMENT naming the flag for a bad --relays or --decide_threads.
absl::StatusOr<BenchConfig> ConfigFromFlags() {
  BenchConfig c;
  c.nodes = absl::GetFlag(FLAGS_nodes);
  c.relays = absl::GetFlag(FLAGS_relays);
  if (c.relays < 0 || (c.relays > 0 && c.nodes % c.relays != 0)) {
    return absl::InvalidArgumentError("--relays must divide --nodes");
  }
  c.serialize_name = absl::GetFlag(FLAGS_serialize);
  c.serialize = c.serialize_name == "once"         ? Serialize::kOnce
                : c.serialize_name == "per_stream" ? Serialize::kPerStream
                                                   : Serialize::kNone;
  c.rpn = absl::GetFlag(FLAGS_ranks_per_node);
  c.steps = absl::GetFlag(FLAGS_steps);
  c.feeders = std::max(1, absl::GetFlag(FLAGS_feeders));
  const int peers = c.relays > 0 ? c.relays : c.nodes;
  const bool torch_pattern = absl::StrContains(absl::GetFlag(FLAGS_modes), "torch");
  // accord.torch's pattern adds the guard's step-window group to every batch.
  c.setup =
      Setup{peers, c.nodes * c.rpn / peers, absl::GetFlag(FLAGS_groups) + (torch_pattern ? 1 : 0),
            absl::GetFlag(FLAGS_params), c.nodes * c.rpn};
  for (absl::string_view m : absl::StrSplit(absl::GetFlag(FLAGS_modes), ',')) {
    if (m == "repeat") c.modes.push_back(Mode::kRepeat);
    if (m == "batch" || m == "torch") c.modes.push_back(Mode::kBatchRepeat);
    if (m == "full") c.modes.push_back(Mode::kFull);
    if (m == "recover") c.recover = true;
  }
  for (absl::string_view w : absl::StrSplit(absl::GetFlag(FLAGS_repeat_waves), ',')) {
    if (w == "on" || w == "off") c.waves.push_back(w == "on");
  }
  if (c.modes.empty()) c.waves.clear();
  for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_decide_threads), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(t, &n) || n < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--decide_threads: \"", t, "\" is not a thread count of at least 1"));
    }
    c.decide_threads.push_back(n);
  }
  return c;
}

// One mode's steps on a coordinator, added up.
struct ModeTotals {
  double cpu = 0, parse = 0, worst = 0, wall = 0, handling_wall = 0;
  int64_t decisions = 0, bytes = 0, out_bytes = 0;
};

ModeTotals TimeMode(Coordinator& c, const std::vector<Coordinator::SessionId>& ids,
                    const std::vector<CountingSink>& sinks, const BenchConfig& cfg, Mode mode,
                    int64_t& step, std::vector<std::vector<uint64_t>>& keys) {
  ModeTotals t;
  int64_t out_before = 0, out_after = 0;
  for (const auto& k : sinks) out_before += k.bytes_;
  for (int i = 0; i < cfg.steps; ++i) {
    const absl::Time w0 = absl::Now();
    Result r = RunStep(c, ids, cfg.setup, step++, mode, keys, cfg.feeders);
    t.wall += absl::ToDoubleSeconds(absl::Now() - w0);
    t.handling_wall += r.wall_s;
    t.cpu += r.cpu_s;
    t.parse += r.parse_s;
    t.worst = std::max(t.worst, r.cpu_s);
    t.decisions += r.decisions;
    t.bytes += r.bytes;
  }
  for (const auto& k : sinks) out_after += k.bytes_;
  t.out_bytes = out_after - out_before;
  return t;
}

void PrintMode(const BenchConfig& cfg, Mode mode, const ModeTotals& t, const CoordinatorStats& st) {
  const Setup& s = cfg.setup;
  const int steps = cfg.steps;
  if (cfg.serialize != Serialize::kNone) {
    std::printf("%-12s broadcast out %8.1f KB/peer/step, %8.1f MB/step\n", "",
                t.out_bytes / 1e3 / steps / s.nodes, t.out_bytes / 1e6 / steps);
  }
  std::printf(
      "%-12s CPU/step %8.1f ms (worst %8.1f ms; parse-only baseline %6.1f ms)  wall/step "
      "%8.1f ms (incl. building the input %8.1f ms)  parallel decides %lld  decisions/s "
      "%10.0f  node manifests/s %10.0f  in %6.1f "
      "MB/step  decisions %lld (expected %lld)  cache hits %lld misses %lld same_as_previous "
      "%lld errors %lld waves %lld\n",
      mode == Mode::kRepeat        ? "all-repeat"
      : mode == Mode::kBatchRepeat ? "batch-repeat"
                                   : "none-repeat",
      1e3 * t.cpu / steps, 1e3 * t.worst, 1e3 * t.parse / steps, 1e3 * t.handling_wall / steps,
      1e3 * t.wall / steps, static_cast<long long>(st.parallel_decides), t.decisions / t.cpu,
      double(s.nodes) * s.groups * steps / t.cpu, t.bytes / 1e6 / steps,
      static_cast<long long>(t.decisions), static_cast<long long>(int64_t{s.groups} * steps),
      static_cast<long long>(st.cache_hits), static_cast<long long>(st.cache_misses),
      static_cast<long long>(st.same_as_previous), static_cast<long long>(st.errors),
      static_cast<long long>(st.repeat_waves));
}

// Every mode on a fresh coordinator with these settings, after one warm-up
// step that fills the cache.
void RunModes(const BenchConfig& cfg, bool waves_on, int threads) {
  const Setup& s = cfg.setup;
  std::printf("repeat waves %s, decide threads %d, feeders %d\n",
              waves_on ? "on" : "off (baseline)", threads, cfg.feeders);
  std::unique_ptr<Coordinator> c = NewCoordinator(waves_on, threads);
  std::vector<CountingSink> sinks(s.nodes);
  SharedSerialization shared;
  Configure(sinks, cfg.serialize, &shared);
  std::vector<Coordinator::SessionId> ids = JoinAll(*c, sinks, s);
  std::vector<std::vector<uint64_t>> keys(s.nodes, std::vector<uint64_t>(s.groups));
  int64_t step = 0;
  RunStep(*c, ids, s, step++, Mode::kFull, keys);  // warm-up, fills the cache
  for (Mode mode : cfg.modes) {
    const ModeTotals t = TimeMode(*c, ids, sinks, cfg, mode, step, keys);
    PrintMode(cfg, mode, t, c->stats());
  }
  int64_t sent = 0, out_bytes = 0;
  for (auto& k : sinks) {
    sent += k.count_.load();
    out_bytes += k.bytes_;
  }
  std::printf(
      "messages to sinks: %lld (one shared DecisionBatch per peer per completing batch); "
      "broadcast bytes %lld, serializations %lld\n",
      static_cast<long long>(sent), static_cast<long long>(out_bytes),
      static_cast<long long>(cfg.serialize == Serialize::kPerStream ? sent
                                                                    : shared.serializations));
  c->Stop();
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<BenchConfig> cfg = ConfigFromFlags();
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", std::string(cfg.status().message()).c_str());
    return 2;
  }
  const Setup& s = cfg->setup;
  std::printf(
      "coordinator capacity: %d nodes x %d ranks = %d ranks, %d groups x %d params; the "
      "coordinator sees %d %s; broadcast serialization: %s\n",
      cfg->nodes, cfg->rpn, s.world, s.groups, s.params, s.nodes,
      cfg->relays > 0 ? "relays" : "nodes", cfg->serialize_name.c_str());
  for (bool waves_on : cfg->waves) {
    for (int threads : cfg->decide_threads) RunModes(*cfg, waves_on, threads);
  }
  for (int threads : cfg->decide_threads) {
    if (cfg->recover) RunRecovery(s, cfg->serialize, threads);
  }
  if (cfg->relays > 0) {
    RunRelayFanIn(cfg->nodes / cfg->relays, cfg->rpn, s.groups, s.params, cfg->steps);
  }
  std::printf("peak RSS %lld MiB\n", static_cast<long long>(PeakRssMiB()));
  return 0;
}

}  // namespace
}  // namespace accord::daemon

int main(int argc, char** argv) { return accord::daemon::Main(argc, argv); }
