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
// --pp=P --tp=T: the job's ranks laid out as P pipeline stages x DP x T
// (bench/coordinator/mesh_layout.h); --groups is then groups per stage, each
// registered once per TP index with that index's DP ranks as members
// (docs/MEMBERS.md) under an id unique per member set. Each node registers
// and submits only the groups of member sets with a member on it, as node
// manifests without rank bits. The same invocation first runs the 1-D job
// with as many groups per node (the baseline). Repeat waves run per wave
// domain (docs/MEMBERS.md 2.11): each node's batch names its stage's member
// sets, so each stage is one domain and completes its own wave. Mode torch
// adds its guard group to every member set.
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
//   accord_coordinator_bench --nodes=16384 --pp=8 --tp=4 --groups=28 --modes=repeat,batch,full
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
#include "bench/coordinator/mesh_layout.h"
#include "daemon/common/clock.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/relay/relay.h"
#include "proto/wire.h"

ABSL_FLAG(int, nodes, 2048, "sidecars");
ABSL_FLAG(int, ranks_per_node, 8, "ranks per sidecar");
ABSL_FLAG(int, groups, 200,
          "groups per step; with --pp/--tp, groups per pipeline stage, each registered once per "
          "TP index with that index's DP ranks (--pp x --tp x --groups group ids in the job)");
ABSL_FLAG(int, pp, 1,
          "pipeline stages (1: none); with --pp or --tp above 1 the 1-D job with as many groups "
          "per node runs first, as the baseline (not with --relays)");
ABSL_FLAG(int, tp, 1, "tensor-parallel ranks per stage replica (1: none)");
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
// ranks behind one relay); `mesh` lays out their ranks and groups (`groups`
// per member set).
struct Setup {
  int nodes, rpn, groups, params, world;
  const bench::MeshLayout* mesh;
};

// Node n's full-form manifest for group gi at `step`, covering the node's
// member ranks of the group without rank bits; `variant` changes usage.
v1::Manifest FullManifest(const Setup& s, int n, int gi, int64_t step, int variant) {
  const int g = s.mesh->base(gi);
  std::vector<std::optional<DType>> dtypes(s.params);
  for (int p = 0; p < s.params; ++p) {
    if ((p + g + variant) % 4 != 0) dtypes[p] = DType::kBFloat16;
  }
  const std::vector<int> ranks = s.mesh->NodeMembers(n, gi);
  Manifest m = RankManifest(step, ranks.front(), s.world, dtypes);
  for (int r : ranks) m.ranks.Add(r);
  v1::Manifest out;
  wire::ManifestToProto(s.mesh->id(gi), m, /*with_ranks=*/false, &out);
  return out;
}

// Each node's last cache key per group it submits (node_groups order).
std::vector<std::vector<uint64_t>> NoKeys(const Setup& s) {
  std::vector<std::vector<uint64_t>> keys(s.nodes);
  for (int n = 0; n < s.nodes; ++n) keys[n].resize(s.mesh->node_groups(n).size());
  return keys;
}

// Group gi's spec as every registrant sends it.
GroupSpec BenchSpec(const Setup& s, int gi) {
  GroupSpec spec;
  spec.group_id = s.mesh->id(gi);
  for (int p = 0; p < s.params; ++p) {
    spec.params.push_back(ParamSpec{absl::StrCat("p", p), 1024, 1024 * 64});
  }
  spec.members = s.mesh->members(gi);
  return spec;
}

enum class Mode { kRepeat, kBatchRepeat, kFull };

// Node n's message at `step` in `mode`; full forms record their keys in
// `keys`, repeats name them.
v1::NodeMessage NodeBatch(const Setup& s, int n, Mode mode, int64_t step, int variant,
                          std::vector<uint64_t>& keys) {
  v1::NodeMessage msg;
  const std::vector<int>& groups = s.mesh->node_groups(n);
  if (mode == Mode::kBatchRepeat) {
    // The previous batch (per-manifest repeats or full) had these keys.
    wire::BatchKeyHasher hasher;
    for (size_t i = 0; i < groups.size(); ++i) hasher.Add(s.mesh->id(groups[i]), keys[i]);
    msg.mutable_manifests()->set_repeat_step(step);
    msg.mutable_manifests()->set_repeat_batch_key(hasher.Finish());
    return msg;
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    v1::Manifest* m = msg.mutable_manifests()->add_manifests();
    if (mode == Mode::kRepeat) {
      m->set_group_id(s.mesh->id(groups[i]));
      m->set_step(step);
      m->set_repeat(true);
      m->set_cache_key(keys[i]);
    } else {
      *m = FullManifest(s, n, groups[i], step, variant);
      keys[i] = m->cache_key();
    }
  }
  return msg;
}

struct Result {
  double cpu_s = 0;   // every thread's CPU while the messages were handled
  double wall_s = 0;  // wall time of the same
  double parse_s = 0;
  int64_t decisions = 0;
  int64_t bytes = 0;
};

// One step: serializes every node's batch (untimed), then times parse +
// HandleMessage for all nodes, on this thread or on `feeders` threads.
Result RunStep(Coordinator& c, const std::vector<Coordinator::SessionId>& ids, const Setup& s,
               int64_t step, Mode mode, std::vector<std::vector<uint64_t>>& keys, int feeders = 1) {
  std::vector<std::string> wire(s.nodes);
  Result r;
  for (int n = 0; n < s.nodes; ++n) {
    wire[n] = NodeBatch(s, n, mode, step, static_cast<int>(step % 2), keys[n]).SerializeAsString();
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
  for (int gi = 0; gi < s.mesh->total_groups(); ++gi) {
    v1::NodeMessage reg;
    *reg.mutable_registration()->mutable_registration() =
        wire::GroupSpecToProto(BenchSpec(s, gi), Policy());
    for (int n : s.mesh->NodesOf(gi)) {
      reg.mutable_registration()->clear_ranks();
      for (int r : s.mesh->NodeMembers(n, gi)) reg.mutable_registration()->add_ranks(r);
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
// False when a decision is missing.
bool RunRecovery(const Setup& s, Serialize serialize, int decide_threads) {
  std::vector<std::vector<uint64_t>> keys = NoKeys(s);
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
  int64_t registrations = 0;
  for (int n = 0; n < s.nodes; ++n) registrations += s.mesh->node_groups(n).size();
  std::printf(
      "%-12s CPU %8.1f ms (hellos + %lld registrations %8.1f ms, pending step %8.1f ms)  "
      "wall %8.1f ms  decisions %lld (expected %d)\n",
      "recover", 1e3 * (joined + r.cpu_s), static_cast<long long>(registrations), 1e3 * joined,
      1e3 * r.cpu_s, 1e3 * wall, static_cast<long long>(r.decisions), s.mesh->total_groups());
  const bool ok = r.decisions == s.mesh->total_groups() && c->stats().errors == 0;
  c->Stop();
  return ok;
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
  for (int gi = 0; gi < s.mesh->total_groups(); ++gi) {
    v1::NodeMessage reg;
    *reg.mutable_registration()->mutable_registration() =
        wire::GroupSpecToProto(BenchSpec(s, gi), Policy());
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
    // A sidecar's batch repeat names its previous batch; the relay offers
    // batch repeats downstream.
    wire[n] = NodeBatch(s, n, mode, step, 0, keys[n]).SerializeAsString();
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
  const absl::StatusOr<bench::MeshLayout> mesh = bench::MeshLayout::Make(fanin, rpn, 1, 1, groups);
  const Setup s{fanin, rpn, groups, params, fanin * rpn, &*mesh};
  RelayOptions o;
  o.relay_id = "relay0";
  o.start_timer_thread = false;
  Relay relay(o);
  CountingUpstream up;
  relay.SetUpstream(&up);
  relay.OnUpstreamConnected();
  std::vector<CountingSink> sinks(fanin);
  const std::vector<Relay::SessionId> ids = JoinRelay(relay, sinks, s);
  std::vector<std::vector<uint64_t>> keys = NoKeys(s);
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

// A job the bench runs: its layout and the coordinator's view of it.
struct Shape {
  std::string label;  // empty for a run without --pp/--tp
  std::shared_ptr<const bench::MeshLayout> mesh;
  Setup setup{};  // its peers are the nodes, or the relays
};

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
  std::vector<Shape> shapes;  // with --pp/--tp: the 1-D baseline, then the mesh
};

Shape MakeShape(std::string label, bench::MeshLayout mesh, int params) {
  Shape shape{std::move(label), std::make_shared<const bench::MeshLayout>(std::move(mesh))};
  const bench::MeshLayout& m = *shape.mesh;
  shape.setup = Setup{m.nodes(), m.ranks_per_node(), m.groups_per_set(), params, m.world(), &m};
  return shape;
}

// The run's shapes: the --pp x --tp layout over the coordinator's `peers`,
// and before it the 1-D job with as many groups per node. Make's errors.
absl::Status AddShapes(BenchConfig& c, int peers, int groups) {
  const int pp = absl::GetFlag(FLAGS_pp), tp = absl::GetFlag(FLAGS_tp);
  if (c.relays > 0 && pp * tp > 1) {
    return absl::InvalidArgumentError("--relays with --pp/--tp is not built");
  }
  const int params = absl::GetFlag(FLAGS_params);
  absl::StatusOr<bench::MeshLayout> mesh =
      bench::MeshLayout::Make(peers, c.nodes * c.rpn / peers, pp, tp, groups);
  if (!mesh.ok()) return mesh.status();
  if (pp * tp == 1) {
    c.shapes.push_back(MakeShape("", *std::move(mesh), params));
    return absl::OkStatus();
  }
  const int per_node = mesh->max_groups_per_node();
  absl::StatusOr<bench::MeshLayout> flat =
      bench::MeshLayout::Make(peers, mesh->ranks_per_node(), 1, 1, per_node);
  if (!flat.ok()) return flat.status();
  c.shapes.push_back(MakeShape(
      absl::StrCat("1-D baseline: ", per_node, " groups, every node submits each, no members"),
      *std::move(flat), params));
  const bench::MeshLayout& m = *mesh;
  std::string label =
      absl::StrCat("PP ", pp, " x DP ", m.dp(), " x TP ", tp, ": ", m.member_sets(),
                   " member sets of ", m.dp(), " ranks, ", groups, " groups each (",
                   m.total_groups(), " group ids, e.g. \"", m.id(m.total_groups() - 1),
                   "\"), node 0 submits ", m.node_groups(0).size(), " (most: ", per_node, ")");
  c.shapes.push_back(MakeShape(std::move(label), *std::move(mesh), params));
  return absl::OkStatus();
}

// INVALID_ARGUMENT naming the flag for a bad --relays, --decide_threads or
// mesh.
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
  // accord.torch's pattern adds the guard's step-window group to every batch
  // (with --pp/--tp: to every member set).
  absl::Status shaped = AddShapes(c, peers, absl::GetFlag(FLAGS_groups) + (torch_pattern ? 1 : 0));
  if (!shaped.ok()) return shaped;
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
                    const std::vector<CountingSink>& sinks, const BenchConfig& cfg, const Setup& s,
                    Mode mode, int64_t& step, std::vector<std::vector<uint64_t>>& keys) {
  ModeTotals t;
  int64_t out_before = 0, out_after = 0;
  for (const auto& k : sinks) out_before += k.bytes_;
  for (int i = 0; i < cfg.steps; ++i) {
    const absl::Time w0 = absl::Now();
    Result r = RunStep(c, ids, s, step++, mode, keys, cfg.feeders);
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

// Node manifests the coordinator takes per step.
int64_t NodeManifests(const Setup& s) {
  int64_t n = 0;
  for (int i = 0; i < s.nodes; ++i) n += static_cast<int64_t>(s.mesh->node_groups(i).size());
  return n;
}

// False (and says so) when a decision is missing or the coordinator answered
// an error.
bool PrintMode(const BenchConfig& cfg, const Setup& s, Mode mode, const ModeTotals& t,
               const CoordinatorStats& st) {
  const int steps = cfg.steps;
  const int64_t expected = int64_t{s.mesh->total_groups()} * steps;
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
      double(NodeManifests(s)) * steps / t.cpu, t.bytes / 1e6 / steps,
      static_cast<long long>(t.decisions), static_cast<long long>(expected),
      static_cast<long long>(st.cache_hits), static_cast<long long>(st.cache_misses),
      static_cast<long long>(st.same_as_previous), static_cast<long long>(st.errors),
      static_cast<long long>(st.repeat_waves));
  if (t.decisions == expected && st.errors == 0) return true;
  std::printf("FAILED: %lld decisions of %lld expected, %lld errors\n",
              static_cast<long long>(t.decisions), static_cast<long long>(expected),
              static_cast<long long>(st.errors));
  return false;
}

// Every mode on a fresh coordinator with these settings, after one warm-up
// step that fills the cache. False when a mode's decisions fell short.
bool RunModes(const BenchConfig& cfg, const Setup& s, bool waves_on, int threads) {
  std::printf("repeat waves %s, decide threads %d, feeders %d\n",
              waves_on ? "on" : "off (baseline)", threads, cfg.feeders);
  std::unique_ptr<Coordinator> c = NewCoordinator(waves_on, threads);
  std::vector<CountingSink> sinks(s.nodes);
  SharedSerialization shared;
  Configure(sinks, cfg.serialize, &shared);
  std::vector<Coordinator::SessionId> ids = JoinAll(*c, sinks, s);
  std::vector<std::vector<uint64_t>> keys = NoKeys(s);
  int64_t step = 0;
  const Result warm = RunStep(*c, ids, s, step++, Mode::kFull, keys);  // fills the cache
  bool ok = warm.decisions == s.mesh->total_groups();
  if (!ok) {
    std::printf("FAILED: the warm-up step made %lld decisions of %d\n",
                static_cast<long long>(warm.decisions), s.mesh->total_groups());
  }
  for (Mode mode : cfg.modes) {
    const ModeTotals t = TimeMode(*c, ids, sinks, cfg, s, mode, step, keys);
    ok = PrintMode(cfg, s, mode, t, c->stats()) && ok;
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
  return ok;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<BenchConfig> cfg = ConfigFromFlags();
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", std::string(cfg.status().message()).c_str());
    return 2;
  }
  bool ok = true;
  for (const Shape& shape : cfg->shapes) {
    const Setup& s = shape.setup;
    std::printf(
        "coordinator capacity: %d nodes x %d ranks = %d ranks, %d groups x %d params; the "
        "coordinator sees %d %s; broadcast serialization: %s\n",
        cfg->nodes, cfg->rpn, s.world, s.groups, s.params, s.nodes,
        cfg->relays > 0 ? "relays" : "nodes", cfg->serialize_name.c_str());
    if (!shape.label.empty()) std::printf("%s\n", shape.label.c_str());
    for (bool waves_on : cfg->waves) {
      for (int threads : cfg->decide_threads) ok = RunModes(*cfg, s, waves_on, threads) && ok;
    }
    for (int threads : cfg->decide_threads) {
      if (cfg->recover) ok = RunRecovery(s, cfg->serialize, threads) && ok;
    }
    if (cfg->relays > 0) {
      RunRelayFanIn(cfg->nodes / cfg->relays, cfg->rpn, s.groups, s.params, cfg->steps);
    }
  }
  std::printf("peak RSS %lld MiB\n", static_cast<long long>(PeakRssMiB()));
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace accord::daemon

int main(int argc, char** argv) { return accord::daemon::Main(argc, argv); }
