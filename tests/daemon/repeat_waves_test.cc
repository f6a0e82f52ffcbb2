// Repeat waves (docs/ARCHITECTURE.md, "Repeat waves"): a step where every
// node repeats its whole batch is decided at once, and the outcome must be
// exactly what the entry-by-entry path gives. The differential test feeds two
// coordinators, one with waves and one without, the same random events
// (batch repeats, changed contents, per-manifest repeats, resends, silent
// nodes, reconnects, clock movement) and compares every message each node
// receives, the counters and the observe views.
#include <algorithm>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/members.h"
#include "daemon/common/clock.h"
#include "daemon/coordinator/coordinator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/test_util.h"

namespace accord::daemon {
namespace {

using testing::Batch;
using testing::FakeNodeSink;
using testing::Hello;
using testing::MakeSpec;
using testing::NodeManifest;
using testing::Registration;
using testing::Repeat;

// A job's shape: ranks per node (uneven allowed), groups, parameters, and
// member sets (docs/MEMBERS.md): without stages every group has every rank;
// with them each node serves one stage, each stage's ranks are split into
// `sets_per_stage` member sets (rank % sets_per_stage, as TP ranks of a
// stage replica), and each member set has `groups` groups. A node's record
// names the groups of its stage's sets: one wave domain per stage.
struct Shape {
  std::vector<int> ranks_per_node;
  int groups = 3;
  int params = 3;
  std::vector<int> stage_of_node;  // empty: no member sets
  int sets_per_stage = 1;
  int nodes() const { return static_cast<int>(ranks_per_node.size()); }
  int world() const {
    int w = 0;
    for (int r : ranks_per_node) w += r;
    return w;
  }
  std::vector<int> RanksOf(int node) const {
    int first = 0;
    for (int n = 0; n < node; ++n) first += ranks_per_node[n];
    std::vector<int> r;
    for (int i = 0; i < ranks_per_node[node]; ++i) r.push_back(first + i);
    return r;
  }
  struct Group {
    std::string id;
    std::vector<int> members;  // empty: every rank
  };
  std::vector<Group> AllGroups() const {
    std::vector<Group> out;
    if (stage_of_node.empty()) {
      for (int g = 0; g < groups; ++g) out.push_back({absl::StrCat("g", g), {}});
      return out;
    }
    const int stages = *std::max_element(stage_of_node.begin(), stage_of_node.end()) + 1;
    for (int k = 0; k < stages; ++k) {
      for (int t = 0; t < sets_per_stage; ++t) {
        std::vector<int> members;
        for (int n = 0; n < nodes(); ++n) {
          if (stage_of_node[n] != k) continue;
          for (int r : RanksOf(n)) {
            if (r % sets_per_stage == t) members.push_back(r);
          }
        }
        if (members.empty()) continue;
        for (int g = 0; g < groups; ++g)
          out.push_back({absl::StrCat("g", g, "@s", k, "t", t), members});
      }
    }
    return out;
  }
  // The groups node `n` submits (indices into AllGroups()) with its ranks
  // among each one's members, in AllGroups() order.
  std::vector<std::pair<int, std::vector<int>>> GroupsOf(int n) const {
    std::vector<std::pair<int, std::vector<int>>> out;
    const std::vector<Group> all = AllGroups();
    for (int i = 0; i < static_cast<int>(all.size()); ++i) {
      std::vector<int> mine;
      for (int r : RanksOf(n)) {
        if (all[i].members.empty() ||
            std::find(all[i].members.begin(), all[i].members.end(), r) != all[i].members.end()) {
          mine.push_back(r);
        }
      }
      if (!mine.empty()) out.emplace_back(i, std::move(mine));
    }
    return out;
  }
  GroupSpec Spec(const Group& g) const {
    GroupSpec spec = MakeSpec(g.id, params);
    if (!g.members.empty()) {
      spec.members = std::make_shared<const MemberSet>(*MemberSet::FromRanks(g.members, world()));
    }
    return spec;
  }
  std::string Name() const {
    return absl::StrCat(nodes(), " nodes of [", absl::StrJoin(ranks_per_node, ","), "] ranks, ",
                        groups, " groups x ", params, " params",
                        stage_of_node.empty()
                            ? std::string()
                            : absl::StrCat(", stages [", absl::StrJoin(stage_of_node, ","), "] x ",
                                           sets_per_stage, " member sets"));
  }
};

constexpr auto kDeadline = absl::Seconds(30);

std::string NodeId(int n) { return absl::StrCat("n", n); }

v1::NodeMessage BatchRepeat(int64_t step, const std::vector<v1::Manifest>& record) {
  wire::BatchKeyHasher hasher;
  for (const v1::Manifest& m : record) hasher.Add(m.group_id(), m.cache_key());
  v1::NodeMessage msg;
  msg.mutable_manifests()->set_repeat_step(step);
  msg.mutable_manifests()->set_repeat_batch_key(hasher.Finish());
  return msg;
}

// One coordinator and its nodes' sinks.
struct Side {
  // `threads`: decide_threads; above 1 every batch's completed steps are
  // decided on the worker pool, however few contents they merge.
  Side(bool waves, int threads, int nodes) : coord(Options(waves, threads), &clock), ids(nodes) {
    for (int n = 0; n < nodes; ++n) sinks.push_back(std::make_unique<FakeNodeSink>());
  }
  static CoordinatorOptions Options(bool waves, int threads) {
    CoordinatorOptions o;
    o.deadline = kDeadline;
    o.start_timer_thread = false;
    o.repeat_waves = waves;
    o.decide_threads = threads;
    o.parallel_decide_min_contents = 0;
    o.parallel_min_entries = 0;
    return o;
  }
  FakeClock clock;
  Coordinator coord;
  std::vector<std::unique_ptr<FakeNodeSink>> sinks;
  std::vector<Coordinator::SessionId> ids;
};

// The node's messages, without decisions of groups it does not serve (a
// wave domain's decisions go to the domain's nodes only; the entry-by-entry
// path broadcasts them, and a node ignores unknown groups' decisions).
std::vector<std::string> Drain(FakeNodeSink& sink, const absl::flat_hash_set<std::string>& served) {
  std::vector<std::string> out;
  for (v1::CoordinatorMessage m : sink.messages()) {
    // Run ids are random per coordinator.
    if (m.has_welcome()) m.mutable_welcome()->clear_run_id();
    if (m.has_decisions()) {
      auto* ds = m.mutable_decisions()->mutable_decisions();
      ds->erase(
          std::remove_if(ds->begin(), ds->end(),
                         [&](const v1::Decision& d) { return !served.contains(d.group_id()); }),
          ds->end());
      if (ds->empty()) continue;
    }
    out.push_back(m.DebugString());
  }
  sink.Clear();
  return out;
}

class Twins {
 public:
  // The fast side has repeat waves and `fast_threads` decide threads; the
  // slow side neither (entry by entry, every decision on the handling thread).
  explicit Twins(const Shape& shape, int fast_threads = 1)
      : shape_(shape),
        fast_(true, fast_threads, shape.nodes()),
        slow_(false, /*threads=*/1, shape.nodes()) {}

  void Open(int n) {
    for (Side* s : {&fast_, &slow_}) s->ids[n] = s->coord.OpenSession(s->sinks[n].get());
  }
  void Send(int n, const v1::NodeMessage& m) {
    for (Side* s : {&fast_, &slow_}) s->coord.HandleMessage(s->ids[n], m);
    Compare(absl::StrCat("after a message of node ", n, ": ", m.ShortDebugString()));
  }
  void Close(int n) {
    for (Side* s : {&fast_, &slow_}) s->coord.CloseSession(s->ids[n]);
    Compare(absl::StrCat("after node ", n, " closed"));
  }
  void Advance(absl::Duration d) {
    for (Side* s : {&fast_, &slow_}) s->clock.Advance(d);
  }
  void CheckDeadlines() {
    for (Side* s : {&fast_, &slow_}) s->coord.CheckDeadlines();
    Compare("after a deadline check");
  }
  // Every node's messages so far are identical on both sides.
  void Compare(const std::string& when) {
    const std::vector<Shape::Group> groups = shape_.AllGroups();
    for (int n = 0; n < shape_.nodes(); ++n) {
      absl::flat_hash_set<std::string> served;
      for (const auto& [i, ranks] : shape_.GroupsOf(n)) served.insert(groups[i].id);
      ASSERT_EQ(Drain(*fast_.sinks[n], served), Drain(*slow_.sinks[n], served))
          << "node " << n << " " << when;
    }
  }
  // Counters and observe views, once no wave can be held back.
  void CompareState(const std::string& when) {
    const CoordinatorStats a = fast_.coord.stats();
    const CoordinatorStats b = slow_.coord.stats();
    EXPECT_EQ(b.repeat_waves, 0) << when;
    EXPECT_EQ(b.parallel_decides, 0) << when;
    EXPECT_EQ(b.parallel_entries, 0) << when;
    const std::vector<std::pair<const char*, std::pair<int64_t, int64_t>>> fields = {
        {"manifests", {a.manifests, b.manifests}},
        {"cache_hits", {a.cache_hits, b.cache_hits}},
        {"cache_misses", {a.cache_misses, b.cache_misses}},
        {"repeat_key_mismatches", {a.repeat_key_mismatches, b.repeat_key_mismatches}},
        {"decisions", {a.decisions, b.decisions}},
        {"same_as_previous", {a.same_as_previous, b.same_as_previous}},
        {"errors", {a.errors, b.errors}},
        {"jobs", {a.jobs, b.jobs}},
        {"sessions", {a.sessions, b.sessions}},
        {"retained_contents", {a.retained_contents, b.retained_contents}},
        {"usage_bytes", {a.usage_bytes, b.usage_bytes}},
    };
    for (const auto& [name, v] : fields) EXPECT_EQ(v.first, v.second) << name << " " << when;
    EXPECT_EQ(fast_.coord.RankLastSteps("job").value_or(std::vector<int64_t>{}),
              slow_.coord.RankLastSteps("job").value_or(std::vector<int64_t>{}))
        << when;
    for (const Shape::Group& group : shape_.AllGroups()) {
      const std::string& g = group.id;
      absl::StatusOr<SkipMatrix> x = fast_.coord.SkipCounts("job", g);
      absl::StatusOr<SkipMatrix> y = slow_.coord.SkipCounts("job", g);
      ASSERT_EQ(x.ok(), y.ok()) << when;
      if (x.ok()) {
        EXPECT_EQ(x->skips, y->skips) << "group " << g << " " << when;
      }
      absl::StatusOr<v1::SkipMatrixResponse> u = fast_.coord.ObserveSkipMatrix("job", g, 0);
      absl::StatusOr<v1::SkipMatrixResponse> v = slow_.coord.ObserveSkipMatrix("job", g, 0);
      ASSERT_EQ(u.ok(), v.ok()) << when;
      if (u.ok()) {
        EXPECT_EQ(u->DebugString(), v->DebugString()) << "group " << g << " " << when;
      }
    }
  }
  int64_t waves() { return fast_.coord.stats().repeat_waves; }
  int64_t parallel_decides() { return fast_.coord.stats().parallel_decides; }
  int64_t parallel_entries() { return fast_.coord.stats().parallel_entries; }

 private:
  const Shape shape_;
  Side fast_;
  Side slow_;
};

std::vector<std::optional<DType>> RandomUsage(std::mt19937& rng, int params) {
  std::vector<std::optional<DType>> d(params);
  for (auto& x : d) {
    const int v = static_cast<int>(rng() % 4);
    if (v == 1) x = DType::kBFloat16;
    if (v == 2) x = DType::kFloat32;
    if (v == 3) x = DType::kFloat16;
  }
  return d;
}

// What the fast side of a run did.
struct FastPaths {
  int64_t waves = 0;
  int64_t parallel_decides = 0;
  int64_t parallel_entries = 0;
  FastPaths& operator+=(const FastPaths& o) {
    waves += o.waves;
    parallel_decides += o.parallel_decides;
    parallel_entries += o.parallel_entries;
    return *this;
  }
};

// One random run with `fast_threads` decide threads on the fast side.
FastPaths RunScenario(const Shape& shape, uint32_t seed, int fast_threads) {
  SCOPED_TRACE(absl::StrCat(shape.Name(), ", seed ", seed, ", ", fast_threads, " decide threads"));
  std::mt19937 rng(seed);
  const int nodes = shape.nodes();
  const int world = shape.world();
  Twins t(shape, fast_threads);
  for (int n = 0; n < nodes; ++n) {
    t.Open(n);
    t.Send(n, Hello("job", NodeId(n), world, shape.RanksOf(n)));
  }
  const std::vector<Shape::Group> groups = shape.AllGroups();
  std::vector<std::vector<std::pair<int, std::vector<int>>>> mine(nodes);
  for (int n = 0; n < nodes; ++n) mine[n] = shape.GroupsOf(n);
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int n = 0; n < nodes; ++n) {
      for (const auto& [i, ranks] : mine[n]) {
        if (i == static_cast<int>(g)) t.Send(n, Registration(shape.Spec(groups[g]), ranks));
      }
    }
  }
  // Each node's usage per group, and the batch its stream last sent in
  // full or per-manifest form (what a batch repeat stands for).
  std::vector<std::vector<std::vector<std::optional<DType>>>> usage(nodes);
  std::vector<std::vector<v1::Manifest>> record(nodes);
  for (int n = 0; n < nodes; ++n) {
    for (size_t g = 0; g < mine[n].size(); ++g) usage[n].push_back(RandomUsage(rng, shape.params));
  }
  // A node manifest without rank bits: the node's ranks among the members.
  auto full_manifests = [&](int n, int64_t step) {
    std::vector<v1::Manifest> ms;
    for (size_t g = 0; g < mine[n].size(); ++g) {
      const auto& [i, ranks] = mine[n][g];
      ms.push_back(NodeManifest(groups[i].id, step, usage[n][g], world, ranks));
    }
    return ms;
  };
  auto full_batch = [&](int n, int64_t step) {
    record[n] = full_manifests(n, step);
    return Batch(record[n]);
  };
  // Nodes whose stream's record is only part of their groups (after a split
  // step): their next step goes in full form, so no group is left behind.
  std::vector<bool> partial(nodes, false);
  bool failed = false;
  const int steps = 10 + static_cast<int>(rng() % 10);
  for (int64_t step = 0; step < steps && !::testing::Test::HasFatalFailure(); ++step) {
    std::vector<int> order(nodes);
    for (int n = 0; n < nodes; ++n) order[n] = n;
    std::shuffle(order.begin(), order.end(), rng);
    bool silent = false;
    for (int n : order) {
      t.Advance(absl::Milliseconds(rng() % 50));
      const int roll = static_cast<int>(rng() % 100);
      if (step == 0 || record[n].empty() || partial[n]) {
        partial[n] = false;
        t.Send(n, full_batch(n, step));
      } else if (roll < 62) {
        t.Send(n, BatchRepeat(step, record[n]));
      } else if (roll < 70) {
        usage[n][rng() % usage[n].size()] = RandomUsage(rng, shape.params);  // may be unchanged
        t.Send(n, full_batch(n, step));
      } else if (roll < 76) {
        std::vector<v1::Manifest> ms;
        for (const v1::Manifest& m : record[n])
          ms.push_back(Repeat(m.group_id(), step, m.cache_key()));
        t.Send(n, Batch(ms));
        // The stream's record is now the repeat-form batch: same groups and keys.
      } else if (roll < 82 && mine[n].size() > 1) {
        // The step's groups in two batches, as a client that submits some
        // groups early does; the stream's record is the second batch.
        std::vector<v1::Manifest> ms = full_manifests(n, step);
        const size_t cut = 1 + rng() % (ms.size() - 1);
        std::vector<v1::Manifest> first(ms.begin(), ms.begin() + cut);
        record[n].assign(ms.begin() + cut, ms.end());
        t.Send(n, Batch(first));
        t.Send(n, Batch(record[n]));
        partial[n] = true;
      } else if (roll < 87) {
        t.Send(n, BatchRepeat(step, record[n]));
        t.Send(n, BatchRepeat(step, record[n]));  // a resend
      } else if (roll < 91) {
        t.Close(n);
        t.Open(n);
        t.Send(n, Hello("job", NodeId(n), world, shape.RanksOf(n)));
        t.Send(n, full_batch(n, step));
      } else if (roll < 94 && !silent) {
        silent = true;  // this node says nothing this step
      } else {
        t.Send(n, BatchRepeat(step, record[n]));
      }
      if (::testing::Test::HasFatalFailure()) return {};
    }
    if (silent) {
      // Half the deadline, then past it and past the progress grace.
      t.Advance(kDeadline / 2);
      t.CheckDeadlines();
      t.Advance(kDeadline / 2 + absl::Seconds(2));
      t.CheckDeadlines();
      t.Advance(absl::Seconds(2));
      t.CheckDeadlines();
      failed = true;
    }
    t.CompareState(absl::StrCat("at the end of step ", step));
    if (failed) break;
  }
  return FastPaths{t.waves(), t.parallel_decides(), t.parallel_entries()};
}

// Shapes: the even job, one node alone, uneven nodes, more groups and nodes.
// Returns what the fast side did over `seeds` runs.
FastPaths RunShapeWith(const Shape& shape, uint32_t seeds, int fast_threads) {
  FastPaths paths;
  for (uint32_t seed = 1; seed <= seeds; ++seed) {
    paths += RunScenario(shape, seed, fast_threads);
    if (::testing::Test::HasFatalFailure()) break;
  }
  return paths;
}
int64_t RunShape(const Shape& shape, uint32_t seeds) {
  return RunShapeWith(shape, seeds, /*fast_threads=*/1).waves;
}

TEST(RepeatWavesTest, DecideExactlyAsTheEntryByEntryPathOnRandomRuns) {
  // The fast path was taken (not only the fallbacks).
  EXPECT_GT(RunShape({{2, 2, 2}, 3, 3}, 300), 300);
}

TEST(RepeatWavesTest, DecideExactlyAsTheEntryByEntryPathForOtherShapes) {
  const std::vector<Shape> shapes = {
      {{4}, 2, 3},                 // one node: every batch completes its steps
      {{1, 3}, 3, 2},              // uneven nodes
      {{1, 2, 1, 3, 1}, 4, 5},     // five uneven nodes, more groups and params
      {{2, 2, 2, 2, 2, 2}, 1, 1},  // one group of one parameter
  };
  for (const Shape& shape : shapes) {
    SCOPED_TRACE(shape.Name());
    // With more nodes, a step more often has an event that breaks its wave;
    // the fast path must still be taken in a good share of the runs.
    EXPECT_GT(RunShape(shape, 150), 40);
    if (HasFatalFailure()) return;
  }
}

// Member sets (docs/MEMBERS.md 2.11): waves run per wave domain (here one
// per stage), each completing, holding and breaking on its own, and still
// decide exactly as the entry-by-entry path.
TEST(RepeatWavesTest, WavesPerDomainDecideExactlyAsTheEntryByEntryPath) {
  const std::vector<Shape> shapes = {
      {{2, 2, 2, 2}, 2, 3, {0, 0, 1, 1}},                 // two stages: two domains
      {{2, 2, 2, 2, 2, 2}, 2, 2, {0, 0, 1, 1, 2, 2}, 2},  // 3 stages x 2 sets, nodes in both
      {{1, 3, 2, 2}, 2, 2, {0, 1, 0, 1}, 2},              // uneven nodes, a node in one set
      {{2, 2, 2}, 3, 3, {0, 0, 0}, 2},                    // two sets linked into one domain
  };
  for (const Shape& shape : shapes) {
    SCOPED_TRACE(shape.Name());
    EXPECT_GT(RunShape(shape, 150), 40);
    if (HasFatalFailure()) return;
  }
}

// More than one core (docs/ARCHITECTURE.md): a batch's manifests handled
// and its completed steps decided side by side on the worker pool, then
// applied in order, give the messages, counters and observe views of
// handling and deciding each one on arrival on one thread.
TEST(RepeatWavesTest, ParallelDecidesDecideExactlyAsOneThread) {
  const std::vector<Shape> shapes = {
      {{2, 2, 2}, 3, 3},
      {{4}, 5, 3},              // one node: each batch completes all its steps
      {{1, 2, 1, 3, 1}, 6, 5},  // uneven nodes, more groups than threads
  };
  for (const Shape& shape : shapes) {
    for (int threads : {2, 4}) {
      SCOPED_TRACE(absl::StrCat(shape.Name(), ", ", threads, " threads"));
      const FastPaths paths = RunShapeWith(shape, 60, threads);
      if (HasFatalFailure()) return;
      // The pool handled manifests and computed decisions (not only the
      // one-thread fallbacks).
      EXPECT_GT(paths.parallel_decides, 60);
      EXPECT_GT(paths.parallel_entries, 600);
    }
  }
}

// The steady state, spelled out: one wave per step once every node sent its
// whole batch, and a silent node is named at the deadline from the wave's
// first arrival.
TEST(RepeatWavesTest, SteadyStateIsOneWavePerStepAndASilentNodeIsNamedAtTheDeadline) {
  const Shape shape{{2, 2, 2}, 2, 2};
  const int kNodes = shape.nodes();
  const int kWorld = shape.world();
  auto RanksOf = [&](int n) { return shape.RanksOf(n); };
  Side s(true, /*threads=*/1, kNodes);
  for (int n = 0; n < kNodes; ++n) {
    s.ids[n] = s.coord.OpenSession(s.sinks[n].get());
    s.coord.HandleMessage(s.ids[n], Hello("job", NodeId(n), kWorld, RanksOf(n)));
    s.coord.HandleMessage(s.ids[n], Registration(MakeSpec("g0", 2), RanksOf(n)));
    s.coord.HandleMessage(s.ids[n], Registration(MakeSpec("g1", 2), RanksOf(n)));
  }
  std::vector<std::vector<v1::Manifest>> record(kNodes);
  for (int n = 0; n < kNodes; ++n) {
    record[n] = {NodeManifest("g0", 0, {DType::kBFloat16, std::nullopt}, kWorld, RanksOf(n)),
                 NodeManifest("g1", 0, {DType::kFloat32, DType::kFloat32}, kWorld, RanksOf(n))};
    s.coord.HandleMessage(s.ids[n], Batch(record[n]));
  }
  for (int64_t step = 1; step <= 5; ++step) {
    for (int n = 0; n < kNodes; ++n) s.coord.HandleMessage(s.ids[n], BatchRepeat(step, record[n]));
  }
  EXPECT_EQ(s.coord.stats().repeat_waves, 5);
  std::vector<v1::Decision> d = s.sinks[2]->decisions();
  ASSERT_EQ(d.size(), 12u);
  for (size_t i = 2; i < d.size(); ++i) {
    EXPECT_TRUE(d[i].same_as_previous()) << i;
    EXPECT_EQ(d[i].step(), static_cast<int64_t>(i / 2)) << i;
  }
  // Skip counts cover the waves: param 1 of g0 unused on every rank, 6 steps.
  absl::StatusOr<SkipMatrix> m = s.coord.SkipCounts("job", "g0");
  ASSERT_TRUE(m.ok());
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(m->skips[r], (std::vector<int64_t>{0, 6})) << r;

  // Step 6: node 1 is silent.
  for (int n = 0; n < kNodes; ++n) s.sinks[n]->Clear();
  s.coord.HandleMessage(s.ids[0], BatchRepeat(6, record[0]));
  s.clock.Advance(absl::Seconds(1));
  s.coord.HandleMessage(s.ids[2], BatchRepeat(6, record[2]));
  s.clock.Advance(kDeadline - absl::Seconds(1) - absl::Milliseconds(1));
  s.coord.CheckDeadlines();
  EXPECT_TRUE(s.sinks[0]->decisions().empty()) << "failed before the deadline";
  s.clock.Advance(absl::Milliseconds(1));
  s.coord.CheckDeadlines();
  for (int n = 0; n < kNodes; ++n) {
    std::vector<v1::Decision> got = s.sinks[n]->decisions();
    ASSERT_EQ(got.size(), 2u) << n;
    // One group's step is the culprit, the other's fails with the job.
    if (got[0].error().kind() == v1::JOB_FAILED) std::swap(got[0], got[1]);
    const v1::DecisionError& e = got[0].error();
    EXPECT_EQ(e.kind(), v1::MISSING_RANKS) << e.message();
    EXPECT_EQ(got[0].step(), 6);
    EXPECT_EQ(std::vector<int>(e.ranks().begin(), e.ranks().end()), (std::vector<int>{2, 3}));
    EXPECT_TRUE(absl::StrContains(e.message(), "rank 2 (last step 5, node \"n1\")")) << e.message();
    EXPECT_EQ(got[1].error().kind(), v1::JOB_FAILED);
    EXPECT_EQ(got[1].step(), 6);
  }
}

// Two stages, each a member set of its two nodes' ranks: a stage's wave
// completes when its own nodes are in while the other stage's record is
// missing, and a full-form batch of one stage breaks only its own wave.
TEST(RepeatWavesTest, AStageWaveNeitherWaitsForNorBreaksWithTheOtherStage) {
  const Shape shape{{2, 2, 2, 2}, 2, 2, {0, 0, 1, 1}};
  const int kNodes = shape.nodes();
  const int kWorld = shape.world();
  const std::vector<Shape::Group> groups = shape.AllGroups();
  Side s(true, /*threads=*/1, kNodes);
  std::vector<std::vector<v1::Manifest>> record(kNodes);
  auto full = [&](int n, int64_t step, DType dtype) {
    record[n].clear();
    for (const auto& [i, ranks] : shape.GroupsOf(n)) {
      record[n].push_back(NodeManifest(groups[i].id, step, {dtype, std::nullopt}, kWorld, ranks));
    }
    s.coord.HandleMessage(s.ids[n], Batch(record[n]));
  };
  for (int n = 0; n < kNodes; ++n) {
    s.ids[n] = s.coord.OpenSession(s.sinks[n].get());
    s.coord.HandleMessage(s.ids[n], Hello("job", NodeId(n), kWorld, shape.RanksOf(n)));
    for (const auto& [i, ranks] : shape.GroupsOf(n)) {
      s.coord.HandleMessage(s.ids[n], Registration(shape.Spec(groups[i]), ranks));
    }
  }
  for (int n = 0; n < kNodes; ++n) full(n, 0, DType::kBFloat16);
  auto repeat = [&](int n, int64_t step) {
    s.coord.HandleMessage(s.ids[n], BatchRepeat(step, record[n]));
  };
  for (int64_t step = 1; step <= 3; ++step) {
    for (int n = 0; n < kNodes; ++n) repeat(n, step);
  }
  EXPECT_EQ(s.coord.stats().repeat_waves, 6);  // two domains, three steps
  // The decisions of `step` node `n` got for a stage's groups ("@s0" or
  // "@s1").
  auto decided_at = [&](int n, int64_t step, const std::string& stage, bool* same) {
    int count = 0;
    *same = true;
    for (const v1::Decision& d : s.sinks[n]->decisions()) {
      if (d.step() != step || !absl::StrContains(d.group_id(), stage)) continue;
      ++count;
      *same = *same && d.same_as_previous();
    }
    return count;
  };
  // Each stage's decisions as its first node got them.
  auto decided = [&](int64_t step, const std::string& stage, bool* same) {
    return decided_at(stage == "@s0" ? 0 : 2, step, stage, same);
  };
  bool same = false;
  // Step 4: node 3 (stage 1) is late; stage 0 is decided without it.
  repeat(0, 4);
  repeat(2, 4);
  repeat(1, 4);
  EXPECT_EQ(s.coord.stats().repeat_waves, 7);
  EXPECT_EQ(decided(4, "@s0", &same), 2);
  EXPECT_TRUE(same);
  EXPECT_EQ(decided(4, "@s1", &same), 0);
  repeat(3, 4);
  EXPECT_EQ(s.coord.stats().repeat_waves, 8);
  EXPECT_EQ(decided(4, "@s1", &same), 2);
  EXPECT_TRUE(same);
  // A wave's decisions go to its domain's nodes only.
  EXPECT_EQ(decided_at(0, 4, "@s1", &same), 0);
  EXPECT_EQ(decided_at(2, 4, "@s0", &same), 0);
  // Step 5: stage 1's wave is held when node 0 changes its usage; stage 0
  // goes entry by entry, stage 1 stays a wave.
  repeat(2, 5);
  full(0, 5, DType::kFloat32);
  repeat(1, 5);
  EXPECT_EQ(decided(5, "@s0", &same), 2);
  EXPECT_FALSE(same);
  EXPECT_EQ(s.coord.stats().repeat_waves, 8);
  repeat(3, 5);
  EXPECT_EQ(s.coord.stats().repeat_waves, 9);
  EXPECT_EQ(decided(5, "@s1", &same), 2);
  EXPECT_TRUE(same);
  EXPECT_EQ(s.coord.stats().errors, 0);
}

}  // namespace
}  // namespace accord::daemon
