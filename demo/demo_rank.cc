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
#include <memory>
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

// `s` with `what` before its text: the line a failed rank prints.
absl::Status Failed(const absl::Status& s, const std::string& what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.ToString()));
}

// The checks and counts of one rank's run, reported at the end.
struct RunTally {
  std::vector<double> latencies_us;
  std::vector<std::vector<GroupStepRecord>> records;  // [step][group]
  int64_t elements_checked = 0;
  int64_t mismatches = 0;
  double worst_error_ratio = 0;
  StableHasher digest;
  int64_t bytes_reduced = 0;
};

// One rank: its client, collective and reducers, the replicated fp32 weights
// (each rank updates its own shard; the shards are gathered back after every
// step) and the tally.
class DemoRank {
 public:
  DemoRank()
      : rank_(absl::GetFlag(FLAGS_rank)),
        world_(absl::GetFlag(FLAGS_world_size)),
        timeout_(absl::Seconds(absl::GetFlag(FLAGS_timeout_s))),
        model_(world_, absl::GetFlag(FLAGS_seed)) {}

  // Connects, registers every group, meets the other ranks over Gloo.
  absl::Status Start();
  // One training step: negotiate every group, reduce, check, update, gather.
  absl::Status Step(int step);
  void PrintProgress(int step) const;
  // Writes --report (when set) and says whether every shard matched.
  absl::Status Finish() const;
  int rank() const { return rank_; }

 private:
  // Local gradients for every group at `step`, and their decisions.
  absl::Status Negotiate(int step, std::vector<std::vector<LocalGrad>>& grads,
                         std::vector<Decision>& decisions);
  // Records group `g`'s decision, reduces its gradients and applies them.
  absl::Status ReduceGroup(int step, size_t g, const Decision& d,
                           const std::vector<LocalGrad>& grads);
  // Checks this rank's reduced chunk of each included parameter against the
  // float64 reference, then takes the SGD step on it.
  void CheckAndUpdate(int step, size_t g, const Decision& d,
                      const std::vector<std::vector<double>>& chunks);
  // All-gathers group `g`'s updated chunks into every rank's weights.
  absl::Status GatherWeights(size_t g);
  double TotalLoss() const;

  const int rank_;
  const int world_;
  const absl::Duration timeout_;
  DemoModel model_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Collective> collective_;
  std::vector<std::unique_ptr<GroupReducer>> reducers_;
  std::vector<std::vector<std::vector<float>>> weights_;  // [group][param]
  double initial_loss_ = 0;
  RunTally tally_;
};

absl::Status DemoRank::Start() {
  ClientOptions options;
  options.socket_path = absl::GetFlag(FLAGS_socket);
  options.job_id = absl::GetFlag(FLAGS_job);
  options.rank = rank_;
  options.world_size = world_;
  options.local_rank = absl::GetFlag(FLAGS_local_rank);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) return Failed(client.status(), "connect");
  client_ = *std::move(client);
  const auto& groups = model_.groups();
  for (const DemoGroup& g : groups) {
    if (absl::Status s = client_->RegisterGroup(g.spec, g.policy, absl::Now() + timeout_);
        !s.ok()) {
      return Failed(s, "register " + g.spec.group_id);
    }
  }
  CollectiveOptions copts;
  copts.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
  absl::StatusOr<std::unique_ptr<Collective>> collective = CreateCollective(
      Backend::kGloo, rank_, world_, client_->kv(), options.job_id + "/demo/gloo", copts);
  if (!collective.ok()) return Failed(collective.status(), "gloo rendezvous");
  collective_ = *std::move(collective);
  weights_.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    reducers_.push_back(
        std::make_unique<GroupReducer>(groups[g].spec, *collective_, GroupReducer::Options{}));
    for (size_t p = 0; p < groups[g].spec.params.size(); ++p) {
      weights_[g].push_back(model_.InitialWeights(g, p));
    }
  }
  initial_loss_ = TotalLoss();
  tally_.records.resize(absl::GetFlag(FLAGS_steps));
  return absl::OkStatus();
}

double DemoRank::TotalLoss() const {
  const auto& groups = model_.groups();
  double sum = 0;
  int n = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t p = 0; p < groups[g].spec.params.size(); ++p) {
      if (groups[g].spec.params[p].name == "head.unused_adapter") continue;
      sum += model_.Loss(g, p, weights_[g][p]);
      ++n;
    }
  }
  return sum / n;
}

absl::Status DemoRank::Negotiate(int step, std::vector<std::vector<LocalGrad>>& grads,
                                 std::vector<Decision>& decisions) {
  const auto& groups = model_.groups();
  // Local gradients and manifests for every group, submitted in one batch.
  grads.assign(groups.size(), {});
  std::vector<GroupSubmission> batch;
  for (size_t g = 0; g < groups.size(); ++g) {
    GroupSubmission sub;
    sub.group_id = groups[g].spec.group_id;
    sub.step = step;
    for (size_t p = 0; p < groups[g].spec.params.size(); ++p) {
      grads[g].push_back(model_.Gradient(g, p, rank_, step, weights_[g][p]));
      sub.grad_dtypes.push_back(grads[g].back().dtype);
    }
    batch.push_back(std::move(sub));
  }
  const absl::Time t0 = absl::Now();
  std::vector<DecisionFuture> futures = client_->SubmitBatch(batch);
  for (size_t g = 0; g < groups.size(); ++g) {
    absl::StatusOr<Decision> d = client_->Wait(futures[g], absl::Now() + timeout_);
    if (!d.ok()) {
      return Failed(d.status(), absl::StrCat("step ", step, " group ", groups[g].spec.group_id));
    }
    decisions.push_back(*d);
  }
  tally_.latencies_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  return absl::OkStatus();
}

absl::Status DemoRank::Step(int step) {
  std::vector<std::vector<LocalGrad>> grads;
  std::vector<Decision> decisions;
  if (absl::Status s = Negotiate(step, grads, decisions); !s.ok()) return s;
  for (size_t g = 0; g < decisions.size(); ++g) {
    if (absl::Status s = ReduceGroup(step, g, decisions[g], grads[g]); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status DemoRank::ReduceGroup(int step, size_t g, const Decision& d,
                                   const std::vector<LocalGrad>& grads) {
  const GroupSpec& spec = model_.groups()[g].spec;
  GroupStepRecord rec;
  rec.wire = std::string(DTypeName(d.wire_dtype));
  rec.fingerprint = d.layout_fingerprint;
  tally_.digest.AddU64(d.layout_fingerprint);
  std::vector<GradSource> sources(spec.params.size());
  for (size_t p = 0; p < spec.params.size(); ++p) {
    if (d.included[p]) {
      ++rec.included;
      if (!grads[p].dtype) ++rec.local_zero_filled;
    } else {
      ++rec.skipped;
      if (grads[p].dtype) {
        return Failed(absl::InternalError(absl::StrCat(spec.params[p].name,
                                                       " has a local gradient but was skipped")),
                      "decision check");
      }
    }
    if (grads[p].dtype) sources[p] = GradSource{grads[p].bytes.data(), *grads[p].dtype};
  }
  tally_.records[step].push_back(rec);
  if (rec.included == 0) return absl::OkStatus();  // nothing to reduce on any rank
  if (absl::Status s = reducers_[g]->Reduce(d, sources); !s.ok()) {
    return Failed(s, absl::StrCat("reduce step ", step, " group ", spec.group_id));
  }
  // Unpack this rank's chunk of every included parameter to float64.
  const Layout& layout = reducers_[g]->layout();
  tally_.bytes_reduced += layout.total_bytes();
  std::vector<std::vector<double>> chunks(spec.params.size());
  std::vector<UnpackTarget> targets(spec.params.size());
  for (size_t p = 0; p < spec.params.size(); ++p) {
    if (!layout.params[p].included) continue;
    chunks[p].resize(layout.params[p].chunk_numel);
    targets[p] = UnpackTarget{chunks[p].data(), DType::kFloat64};
  }
  if (absl::Status s = reducers_[g]->Unpack(targets); !s.ok()) return Failed(s, "unpack");
  CheckAndUpdate(step, g, d, chunks);
  return GatherWeights(g);
}

void DemoRank::CheckAndUpdate(int step, size_t g, const Decision& d,
                              const std::vector<std::vector<double>>& chunks) {
  const GroupSpec& spec = model_.groups()[g].spec;
  const Layout& layout = reducers_[g]->layout();
  const double u = UnitRoundoff(d.wire_dtype);
  const double lr = absl::GetFlag(FLAGS_lr);
  for (size_t p = 0; p < spec.params.size(); ++p) {
    const ParamLayout& pl = layout.params[p];
    if (!pl.included) continue;
    std::vector<double> abs_sum;
    const std::vector<double> ref = model_.ReferenceSum(g, p, step, weights_[g][p], &abs_sum);
    const int64_t begin = static_cast<int64_t>(rank_) * pl.chunk_numel;
    for (int64_t k = 0; k < pl.chunk_numel; ++k) {
      const int64_t i = begin + k;
      const double want = i < spec.params[p].numel ? ref[i] : 0.0;  // padding reduces to 0
      const double bound = i < spec.params[p].numel ? (world_ + 1) * u * abs_sum[i] + 1e-300 : 0.0;
      const double err = std::fabs(chunks[p][k] - want);
      ++tally_.elements_checked;
      if (!(err <= bound)) {
        if (tally_.mismatches < 5) {
          std::fprintf(stderr,
                       "demo rank %d: MISMATCH step %d %s[%lld]: got %.9g want %.9g (bound %.3g)\n",
                       rank_, step, spec.params[p].name.c_str(), static_cast<long long>(i),
                       chunks[p][k], want, bound);
        }
        ++tally_.mismatches;
      } else if (bound > 0) {
        tally_.worst_error_ratio = std::max(tally_.worst_error_ratio, err / bound);
      }
    }
    // SGD on this rank's chunk with the rank-mean gradient.
    for (int64_t k = 0; k < pl.chunk_numel; ++k) {
      const int64_t i = begin + k;
      if (i < spec.params[p].numel) {
        weights_[g][p][i] -= static_cast<float>(lr * chunks[p][k] / world_);
      }
    }
  }
}

// A reduce-scatter in which rank s writes its chunk at position s of every
// row (zeros elsewhere), so row r sums to the whole parameter. Exact: one
// non-zero term per element.
absl::Status DemoRank::GatherWeights(size_t g) {
  const GroupSpec& spec = model_.groups()[g].spec;
  const Layout& layout = reducers_[g]->layout();
  int64_t row = 0;
  std::vector<int64_t> offsets(spec.params.size());
  for (size_t p = 0; p < spec.params.size(); ++p) {
    if (!layout.params[p].included) continue;
    offsets[p] = row;
    row += layout.params[p].padded_dim0 * layout.params[p].inner;
  }
  std::vector<float> gather_in(static_cast<size_t>(row) * world_, 0.0f);
  std::vector<float> gather_out(static_cast<size_t>(row));
  for (size_t p = 0; p < spec.params.size(); ++p) {
    const ParamLayout& pl = layout.params[p];
    if (!pl.included) continue;
    const int64_t begin = static_cast<int64_t>(rank_) * pl.chunk_numel;
    for (int r = 0; r < world_; ++r) {
      for (int64_t k = 0; k < pl.chunk_numel; ++k) {
        const int64_t i = begin + k;
        if (i < spec.params[p].numel) {
          gather_in[static_cast<size_t>(r) * row + offsets[p] + i] = weights_[g][p][i];
        }
      }
    }
  }
  if (absl::Status s =
          collective_->ReduceScatterSum(gather_in.data(), gather_out.data(), row, DType::kFloat32);
      !s.ok()) {
    return Failed(s, "all-gather of weights");
  }
  for (size_t p = 0; p < spec.params.size(); ++p) {
    if (!layout.params[p].included) continue;
    for (int64_t i = 0; i < spec.params[p].numel; ++i) {
      weights_[g][p][i] = gather_out[offsets[p] + i];
    }
  }
  return absl::OkStatus();
}

void DemoRank::PrintProgress(int step) const {
  if (absl::GetFlag(FLAGS_progress_rank) != rank_) return;
  const auto& groups = model_.groups();
  std::vector<std::string> wires;
  int skipped = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    wires.push_back(absl::StrCat(groups[g].spec.group_id, "=", tally_.records[step][g].wire));
    skipped += tally_.records[step][g].skipped;
  }
  std::printf("step %2d/%d  loss %.5f  wire %s  skipped %d  negotiation %4.0f us  %s\n", step + 1,
              absl::GetFlag(FLAGS_steps), TotalLoss(), absl::StrJoin(wires, " ").c_str(), skipped,
              tally_.latencies_us.back(), tally_.mismatches == 0 ? "shards ok" : "MISMATCH");
  std::fflush(stdout);
}

absl::Status DemoRank::Finish() const {
  const auto& groups = model_.groups();
  const int steps = absl::GetFlag(FLAGS_steps);
  // The report the driver aggregates.
  RankReport report;
  report.set_rank(rank_);
  report.set_steps(steps);
  report.set_elements_checked(tally_.elements_checked);
  report.set_mismatches(tally_.mismatches);
  report.set_worst_error_ratio(tally_.worst_error_ratio);
  report.set_initial_loss(initial_loss_);
  report.set_final_loss(TotalLoss());
  report.set_bytes_reduced(tally_.bytes_reduced);
  report.set_decision_digest(absl::StrFormat("%016x", tally_.digest.Finish()));
  for (double v : tally_.latencies_us) report.add_latencies_us(v);
  for (size_t g = 0; g < groups.size(); ++g) {
    GroupReport* gr = report.add_groups();
    gr->set_group(groups[g].spec.group_id);
    for (const ParamSpec& p : groups[g].spec.params) {
      gr->add_params(p.name);
      gr->add_local_missing(0);
    }
    for (int s = 0; s < steps; ++s) {
      const GroupStepRecord& r = tally_.records[s][g];
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
      return Failed(absl::InternalError("cannot encode the report"), "report");
    }
    std::ofstream out(path);
    out << json << "\n";
    if (!out) return Failed(absl::InternalError("write failed"), "report " + path);
  }
  if (tally_.mismatches > 0) {
    return absl::InternalError(
        absl::StrFormat("%lld of %lld reduced elements differ from the reference",
                        static_cast<long long>(tally_.mismatches),
                        static_cast<long long>(tally_.elements_checked)));
  }
  return absl::OkStatus();
}

int Run() {
  DemoRank rank;
  absl::Status s = rank.Start();
  for (int step = 0; s.ok() && step < absl::GetFlag(FLAGS_steps); ++step) {
    s = rank.Step(step);
    if (s.ok()) rank.PrintProgress(step);
  }
  if (s.ok()) s = rank.Finish();
  if (s.ok()) return 0;
  std::fprintf(stderr, "demo rank %d: %s\n", rank.rank(), std::string(s.message()).c_str());
  return 1;
}

}  // namespace
}  // namespace accord::demo

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return accord::demo::Run();
}
