// One rank of the demo job: trains demo/model.h's synthetic model with the
// real data path (accord client -> sidecar -> coordinator for every group and
// step, CPU pack kernels, Gloo reduce-scatter), checks every reduced shard
// against a float64 reference it computes independently, and writes a JSON
// report for the demo driver. Exits non-zero on any mismatch or error.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/collective/collective.h"
#include "client/collective/reducer.h"
#include "core/hash.h"
#include "demo/model.h"
#include "demo/report.pb.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/pack.h"

ABSL_FLAG(std::string, socket, "", "The node's sidecar socket.");
ABSL_FLAG(std::string, job, "demo", "Job id.");
ABSL_FLAG(int, rank, -1, "This rank.");
ABSL_FLAG(int, world_size, 8, "Ranks in the job.");
ABSL_FLAG(int, local_rank, 0, "Rank within the node.");
ABSL_FLAG(int, steps, 20, "Training steps.");
ABSL_FLAG(uint64_t, seed, 2026, "Seed of the synthetic data.");
ABSL_FLAG(double, lr, 0.5, "SGD learning rate (applied to the rank-mean gradient).");
ABSL_FLAG(std::string, report, "", "Where to write this rank's JSON report.");
ABSL_FLAG(int, progress_rank, 0, "This rank prints a progress line per step (-1: none).");
ABSL_FLAG(int, timeout_s, 60, "How long to wait for any one decision.");

namespace accord::demo {
namespace {

double UnitRoundoff(DType d) {
  switch (d) {
    case DType::kFloat64:
      return 0x1.0p-53;
    case DType::kFloat32:
      return 0x1.0p-24;
    case DType::kBFloat16:
      return 0x1.0p-8;
    case DType::kFloat16:
      return 0x1.0p-11;
    case DType::kFloat8E4M3FN:
      return 0x1.0p-4;
    case DType::kFloat8E5M2:
      return 0x1.0p-3;
  }
  return 1;
}

struct GroupStepRecord {
  std::string wire;
  int included = 0;
  int skipped = 0;
  int local_zero_filled = 0;  // included, but this rank had no gradient
  uint64_t fingerprint = 0;
};

int Run() {
  const int rank = absl::GetFlag(FLAGS_rank);
  const int world = absl::GetFlag(FLAGS_world_size);
  const int steps = absl::GetFlag(FLAGS_steps);
  const std::string job = absl::GetFlag(FLAGS_job);
  auto fail = [&](const absl::Status& s, const std::string& what) {
    std::fprintf(stderr, "demo rank %d: %s: %s\n", rank, what.c_str(), s.ToString().c_str());
    return 1;
  };

  ClientOptions options;
  options.socket_path = absl::GetFlag(FLAGS_socket);
  options.job_id = job;
  options.rank = rank;
  options.world_size = world;
  options.local_rank = absl::GetFlag(FLAGS_local_rank);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) return fail(client.status(), "connect");

  DemoModel model(world, absl::GetFlag(FLAGS_seed));
  const auto& groups = model.groups();
  const absl::Duration timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  for (const DemoGroup& g : groups) {
    if (absl::Status s = (*client)->RegisterGroup(g.spec, g.policy, absl::Now() + timeout);
        !s.ok()) {
      return fail(s, "register " + g.spec.group_id);
    }
  }
  CollectiveOptions copts;
  copts.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
  absl::StatusOr<std::unique_ptr<Collective>> collective =
      CreateCollective(Backend::kGloo, rank, world, (*client)->kv(), job + "/demo/gloo", copts);
  if (!collective.ok()) return fail(collective.status(), "gloo rendezvous");
  std::vector<std::unique_ptr<GroupReducer>> reducers;
  for (const DemoGroup& g : groups) {
    reducers.push_back(
        std::make_unique<GroupReducer>(g.spec, **collective, GroupReducer::Options{}));
  }

  // Full (replicated) fp32 weights; each rank updates its own shard and the
  // shards are gathered back after every step.
  std::vector<std::vector<std::vector<float>>> weights(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t p = 0; p < groups[g].spec.params.size(); ++p) {
      weights[g].push_back(model.InitialWeights(g, p));
    }
  }
  auto total_loss = [&] {
    double sum = 0;
    int n = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      for (size_t p = 0; p < groups[g].spec.params.size(); ++p) {
        if (groups[g].spec.params[p].name == "head.unused_adapter") continue;
        sum += model.Loss(g, p, weights[g][p]);
        ++n;
      }
    }
    return sum / n;
  };
  const double initial_loss = total_loss();

  std::vector<double> latencies_us;
  std::vector<std::vector<GroupStepRecord>> records(steps);
  int64_t elements_checked = 0;
  int64_t mismatches = 0;
  double worst_error_ratio = 0;
  StableHasher digest;
  int64_t bytes_reduced = 0;
  std::vector<std::vector<int64_t>> local_missing(groups.size());
  for (size_t g = 0; g < groups.size(); ++g)
    local_missing[g].assign(groups[g].spec.params.size(), 0);
  const double lr = absl::GetFlag(FLAGS_lr);

  for (int step = 0; step < steps; ++step) {
    // Local gradients and manifests for every group, submitted in one batch.
    std::vector<std::vector<LocalGrad>> grads(groups.size());
    std::vector<GroupSubmission> batch;
    for (size_t g = 0; g < groups.size(); ++g) {
      GroupSubmission sub;
      sub.group_id = groups[g].spec.group_id;
      sub.step = step;
      for (size_t p = 0; p < groups[g].spec.params.size(); ++p) {
        grads[g].push_back(model.Gradient(g, p, rank, step, weights[g][p]));
        sub.grad_dtypes.push_back(grads[g].back().dtype);
      }
      batch.push_back(std::move(sub));
    }
    const absl::Time t0 = absl::Now();
    std::vector<DecisionFuture> futures = (*client)->SubmitBatch(batch);
    std::vector<Decision> decisions;
    for (size_t g = 0; g < groups.size(); ++g) {
      absl::StatusOr<Decision> d = (*client)->Wait(futures[g], absl::Now() + timeout);
      if (!d.ok())
        return fail(d.status(), absl::StrCat("step ", step, " group ", groups[g].spec.group_id));
      decisions.push_back(*d);
    }
    latencies_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));

    for (size_t g = 0; g < groups.size(); ++g) {
      const GroupSpec& spec = groups[g].spec;
      const Decision& d = decisions[g];
      GroupStepRecord rec;
      rec.wire = std::string(DTypeName(d.wire_dtype));
      rec.fingerprint = d.layout_fingerprint;
      digest.AddU64(d.layout_fingerprint);
      std::vector<GradSource> sources(spec.params.size());
      for (size_t p = 0; p < spec.params.size(); ++p) {
        if (d.included[p]) {
          ++rec.included;
          if (!grads[g][p].dtype) ++rec.local_zero_filled;
        } else {
          ++rec.skipped;
          if (grads[g][p].dtype) {
            return fail(absl::InternalError(absl::StrCat(spec.params[p].name,
                                                         " has a local gradient but was skipped")),
                        "decision check");
          }
        }
        if (grads[g][p].dtype)
          sources[p] = GradSource{grads[g][p].bytes.data(), *grads[g][p].dtype};
      }
      records[step].push_back(rec);
      if (rec.included == 0) continue;  // nothing to reduce on any rank
      if (absl::Status s = reducers[g]->Reduce(d, sources); !s.ok()) {
        return fail(s, absl::StrCat("reduce step ", step, " group ", spec.group_id));
      }
      // Unpack this rank's chunk of every included parameter to float64.
      const Layout& layout = reducers[g]->layout();
      bytes_reduced += layout.total_bytes();
      std::vector<std::vector<double>> chunks(spec.params.size());
      std::vector<UnpackTarget> targets(spec.params.size());
      for (size_t p = 0; p < spec.params.size(); ++p) {
        if (!layout.params[p].included) continue;
        chunks[p].resize(layout.params[p].chunk_numel);
        targets[p] = UnpackTarget{chunks[p].data(), DType::kFloat64};
      }
      if (absl::Status s = reducers[g]->Unpack(targets); !s.ok()) return fail(s, "unpack");
      const double u = UnitRoundoff(d.wire_dtype);
      for (size_t p = 0; p < spec.params.size(); ++p) {
        const ParamLayout& pl = layout.params[p];
        if (!pl.included) continue;
        std::vector<double> abs_sum;
        const std::vector<double> ref = model.ReferenceSum(g, p, step, weights[g][p], &abs_sum);
        const int64_t begin = static_cast<int64_t>(rank) * pl.chunk_numel;
        for (int64_t k = 0; k < pl.chunk_numel; ++k) {
          const int64_t i = begin + k;
          const double want = i < spec.params[p].numel ? ref[i] : 0.0;  // padding reduces to 0
          const double bound =
              i < spec.params[p].numel ? (world + 1) * u * abs_sum[i] + 1e-300 : 0.0;
          const double err = std::fabs(chunks[p][k] - want);
          ++elements_checked;
          if (!(err <= bound)) {
            if (mismatches < 5) {
              std::fprintf(
                  stderr,
                  "demo rank %d: MISMATCH step %d %s[%lld]: got %.9g want %.9g (bound %.3g)\n",
                  rank, step, spec.params[p].name.c_str(), static_cast<long long>(i), chunks[p][k],
                  want, bound);
            }
            ++mismatches;
          } else if (bound > 0) {
            worst_error_ratio = std::max(worst_error_ratio, err / bound);
          }
        }
        // SGD on this rank's chunk with the rank-mean gradient.
        for (int64_t k = 0; k < pl.chunk_numel; ++k) {
          const int64_t i = begin + k;
          if (i < spec.params[p].numel) {
            weights[g][p][i] -= static_cast<float>(lr * chunks[p][k] / world);
          }
        }
      }
      // All-gather the updated chunks: a reduce-scatter in which rank s
      // writes its chunk at position s of every row (zeros elsewhere), so row
      // r sums to the whole parameter. Exact: one non-zero term per element.
      int64_t row = 0;
      std::vector<int64_t> offsets(spec.params.size());
      for (size_t p = 0; p < spec.params.size(); ++p) {
        if (!layout.params[p].included) continue;
        offsets[p] = row;
        row += layout.params[p].padded_dim0 * layout.params[p].inner;
      }
      std::vector<float> gather_in(static_cast<size_t>(row) * world, 0.0f);
      std::vector<float> gather_out(static_cast<size_t>(row));
      for (size_t p = 0; p < spec.params.size(); ++p) {
        const ParamLayout& pl = layout.params[p];
        if (!pl.included) continue;
        const int64_t begin = static_cast<int64_t>(rank) * pl.chunk_numel;
        for (int r = 0; r < world; ++r) {
          for (int64_t k = 0; k < pl.chunk_numel; ++k) {
            const int64_t i = begin + k;
            if (i < spec.params[p].numel) {
              gather_in[static_cast<size_t>(r) * row + offsets[p] + i] = weights[g][p][i];
            }
          }
        }
      }
      if (absl::Status s =
              (*collective)
                  ->ReduceScatterSum(gather_in.data(), gather_out.data(), row, DType::kFloat32);
          !s.ok()) {
        return fail(s, "all-gather of weights");
      }
      for (size_t p = 0; p < spec.params.size(); ++p) {
        if (!layout.params[p].included) continue;
        for (int64_t i = 0; i < spec.params[p].numel; ++i)
          weights[g][p][i] = gather_out[offsets[p] + i];
      }
    }
    if (absl::GetFlag(FLAGS_progress_rank) == rank) {
      std::vector<std::string> wires;
      int skipped = 0;
      for (size_t g = 0; g < groups.size(); ++g) {
        wires.push_back(absl::StrCat(groups[g].spec.group_id, "=", records[step][g].wire));
        skipped += records[step][g].skipped;
      }
      std::printf("step %2d/%d  loss %.5f  wire %s  skipped %d  negotiation %4.0f us  %s\n",
                  step + 1, steps, total_loss(), absl::StrJoin(wires, " ").c_str(), skipped,
                  latencies_us.back(), mismatches == 0 ? "shards ok" : "MISMATCH");
      std::fflush(stdout);
    }
  }

  // The report the driver aggregates.
  RankReport report;
  report.set_rank(rank);
  report.set_steps(steps);
  report.set_elements_checked(elements_checked);
  report.set_mismatches(mismatches);
  report.set_worst_error_ratio(worst_error_ratio);
  report.set_initial_loss(initial_loss);
  report.set_final_loss(total_loss());
  report.set_bytes_reduced(bytes_reduced);
  report.set_decision_digest(absl::StrFormat("%016x", digest.Finish()));
  for (double v : latencies_us) report.add_latencies_us(v);
  for (size_t g = 0; g < groups.size(); ++g) {
    GroupReport* gr = report.add_groups();
    gr->set_group(groups[g].spec.group_id);
    for (const ParamSpec& p : groups[g].spec.params) gr->add_params(p.name);
    for (int64_t m : local_missing[g]) gr->add_local_missing(m);
    for (int s = 0; s < steps; ++s) {
      const GroupStepRecord& r = records[s][g];
      GroupStep* gs = gr->add_steps();
      gs->set_wire(r.wire);
      gs->set_included(r.included);
      gs->set_skipped(r.skipped);
      gs->set_local_zero_filled(r.local_zero_filled);
    }
  }
  const std::string path = absl::GetFlag(FLAGS_report);
  if (!path.empty()) {
    std::string json;
    if (!google::protobuf::util::MessageToJsonString(report, &json).ok()) {
      return fail(absl::InternalError("cannot encode the report"), "report");
    }
    std::ofstream out(path);
    out << json << "\n";
    if (!out) return fail(absl::InternalError("write failed"), "report " + path);
  }
  if (mismatches > 0) {
    std::fprintf(stderr, "demo rank %d: %lld of %lld reduced elements differ from the reference\n",
                 rank, static_cast<long long>(mismatches),
                 static_cast<long long>(elements_checked));
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace accord::demo

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return accord::demo::Run();
}
