#include "cli/format.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/rank_set.h"
#include "google/protobuf/util/json_util.h"

namespace accord::cli {
namespace {

// A plain left-aligned text table.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string Render(const std::string& indent = "") const {
    std::vector<size_t> width;
    for (const auto& row : rows_) {
      if (width.size() < row.size()) width.resize(row.size(), 0);
      for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
    }
    std::string out;
    for (const auto& row : rows_) {
      std::string line = indent;
      for (size_t i = 0; i < row.size(); ++i) {
        line += row[i];
        if (i + 1 < row.size()) line += std::string(width[i] - row[i].size() + 2, ' ');
      }
      while (!line.empty() && line.back() == ' ') line.pop_back();
      absl::StrAppend(&out, line, "\n");
    }
    return out;
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::string Step(int64_t s) { return s < 0 ? "-" : absl::StrCat(s); }

std::vector<int> ToInts(const google::protobuf::RepeatedField<int32_t>& r) {
  return std::vector<int>(r.begin(), r.end());
}

}  // namespace

std::string FormatStatus(const v1::StatusResponse& response) {
  if (response.jobs().empty()) return "no jobs\n";
  std::string out;
  for (const v1::JobStatus& job : response.jobs()) {
    int connected = 0;
    int64_t min_step = -1, max_step = -1;
    for (const v1::RankStatus& r : job.ranks()) {
      connected += r.connected() ? 1 : 0;
      if (r.last_step() >= 0) {
        min_step = min_step < 0 ? r.last_step() : std::min(min_step, r.last_step());
        max_step = std::max(max_step, r.last_step());
      }
    }
    absl::StrAppend(&out, "job ", job.job_id(), ": world size ", job.world_size(), ", ", connected,
                    " ranks connected on ", job.nodes_size(), " nodes, steps ", Step(min_step),
                    "..", Step(max_step),
                    job.failed() ? absl::StrCat(", FAILED: ", job.error()) : "", "\n");
    Table nodes({"NODE", "CONNECTED", "RANKS"});
    for (const v1::NodeStatus& n : job.nodes()) {
      nodes.Add({n.node_id(), n.connected() ? "yes" : "no", FormatRanks(ToInts(n.ranks()))});
    }
    absl::StrAppend(&out, nodes.Render("  "));
    std::vector<int> lagging;
    for (const v1::RankStatus& r : job.ranks()) {
      if (!r.connected() || r.last_step() < max_step) lagging.push_back(r.rank());
    }
    if (!lagging.empty()) {
      Table ranks({"RANK", "NODE", "CONNECTED", "LAST STEP"});
      for (const v1::RankStatus& r : job.ranks()) {
        if (!r.connected() || r.last_step() < max_step) {
          ranks.Add({absl::StrCat(r.rank()), r.node_id(), r.connected() ? "yes" : "no",
                     Step(r.last_step())});
        }
      }
      absl::StrAppend(&out, "  ranks behind or disconnected:\n", ranks.Render("  "));
    }
    Table groups(
        {"GROUP", "PARAMS", "LAST STEP", "DECISIONS", "CACHE HIT", "WIRE", "SKIPPED", "STATE"});
    for (const v1::GroupStatus& g : job.groups()) {
      const int64_t lookups = g.cache_hits() + g.cache_misses();
      groups.Add({g.group_id(), absl::StrCat(g.num_params()), Step(g.last_decided_step()),
                  absl::StrCat(g.decisions()),
                  lookups ? absl::StrFormat("%.0f%%", 100.0 * g.cache_hits() / lookups) : "-",
                  g.last_wire_dtype().empty() ? "-" : g.last_wire_dtype(),
                  absl::StrCat(g.last_num_skipped()), g.failed() ? "FAILED: " + g.error() : "ok"});
    }
    absl::StrAppend(&out, groups.Render("  "));
  }
  return out;
}

std::string FormatSkips(const v1::SkipMatrixResponse& response, const SkipFormatOptions& options) {
  std::string out;
  const int world = response.world_size();
  if (response.groups().empty()) {
    return absl::StrCat("job ", response.job_id(), ": no decided steps yet\n");
  }
  for (const v1::GroupSkipMatrix& g : response.groups()) {
    absl::StrAppend(&out, "job ", response.job_id(), " group ", g.group_id(), ": ", g.steps(),
                    " steps (", Step(g.first_step()), "..", Step(g.last_step()),
                    "); cell = steps the rank had no gradient for the parameter\n");
    const bool fits =
        options.full || (world <= options.max_ranks && g.rows_size() <= options.max_params);
    if (fits) {
      std::vector<std::string> header = {"PARAM"};
      for (int r = 0; r < world; ++r) header.push_back(absl::StrCat("r", r));
      header.push_back("NOWHERE");
      Table t(header);
      for (const v1::SkipRow& row : g.rows()) {
        std::vector<std::string> cells = {row.param_name()};
        for (int64_t c : row.counts()) cells.push_back(c == 0 ? "." : absl::StrCat(c));
        cells.push_back(row.skipped_everywhere() == 0 ? "."
                                                      : absl::StrCat(row.skipped_everywhere()));
        t.Add(cells);
      }
      absl::StrAppend(&out, t.Render("  "));
      continue;
    }
    // Summary: top parameters by total skips, top ranks by total skips.
    std::vector<int64_t> param_total(g.rows_size(), 0);
    std::vector<int64_t> rank_total(world, 0);
    for (int i = 0; i < g.rows_size(); ++i) {
      const v1::SkipRow& row = g.rows(i);
      for (int r = 0; r < row.counts_size() && r < world; ++r) {
        param_total[i] += row.counts(r);
        rank_total[r] += row.counts(r);
      }
    }
    std::vector<int> pidx(g.rows_size());
    std::iota(pidx.begin(), pidx.end(), 0);
    std::stable_sort(pidx.begin(), pidx.end(),
                     [&](int a, int b) { return param_total[a] > param_total[b]; });
    std::vector<int> ridx(world);
    std::iota(ridx.begin(), ridx.end(), 0);
    std::stable_sort(ridx.begin(), ridx.end(),
                     [&](int a, int b) { return rank_total[a] > rank_total[b]; });
    absl::StrAppend(&out, "  ", g.rows_size(), " parameters x ", world,
                    " ranks is too large to print; top ", options.top, " of each:\n");
    Table tp({"PARAM", "RANK-STEPS SKIPPED", "RANKS SKIPPING", "NOWHERE"});
    for (int k = 0; k < options.top && k < static_cast<int>(pidx.size()); ++k) {
      const v1::SkipRow& row = g.rows(pidx[k]);
      if (param_total[pidx[k]] == 0 && row.skipped_everywhere() == 0) break;
      int ranks = 0;
      for (int64_t c : row.counts()) ranks += c > 0 ? 1 : 0;
      tp.Add({row.param_name(), absl::StrCat(param_total[pidx[k]]), absl::StrCat(ranks),
              absl::StrCat(row.skipped_everywhere())});
    }
    absl::StrAppend(&out, tp.Render("  "));
    Table tr({"RANK", "PARAM-STEPS SKIPPED"});
    for (int k = 0; k < options.top && k < world; ++k) {
      if (rank_total[ridx[k]] == 0) break;
      tr.Add({absl::StrCat(ridx[k]), absl::StrCat(rank_total[ridx[k]])});
    }
    absl::StrAppend(&out, tr.Render("  "), "  (the whole matrix: accordctl skips --job ",
                    response.job_id(), " --group ", g.group_id(),
                    " --full, or --json for scripts)\n");
  }
  return out;
}

std::string FormatStalls(const v1::StallsResponse& response) {
  if (response.stalls().empty()) return "no group is waiting\n";
  Table t(
      {"JOB", "GROUP", "STEP", "WAITING", "DEADLINE IN", "REPORTED", "MISSING RANKS (last step)"});
  for (const v1::Stall& s : response.stalls()) {
    std::vector<std::string> missing;
    for (int i = 0; i < s.missing_ranks_size(); ++i) {
      const int64_t last = i < s.missing_last_steps_size() ? s.missing_last_steps(i) : -1;
      missing.push_back(absl::StrCat(s.missing_ranks(i), " (", Step(last), ")"));
    }
    t.Add({s.job_id(), s.group_id(), absl::StrCat(s.step()),
           absl::StrFormat("%.1fs", s.waiting_ms() / 1000.0),
           absl::StrFormat("%.1fs", s.deadline_in_ms() / 1000.0), absl::StrCat(s.reported_ranks()),
           absl::StrJoin(missing, ", ")});
  }
  return t.Render();
}

std::string ToJson(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

}  // namespace accord::cli
