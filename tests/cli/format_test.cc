#include "cli/format.h"

#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace accord::cli {
namespace {

v1::SkipMatrixResponse SmallMatrix() {
  v1::SkipMatrixResponse r;
  r.set_job_id("job1");
  r.set_world_size(4);
  v1::GroupSkipMatrix* g = r.add_groups();
  g->set_group_id("layers.0");
  g->set_steps(20);
  g->set_first_step(0);
  g->set_last_step(19);
  auto add_row = [&](int i, const char* name, std::vector<int64_t> counts, int64_t nowhere) {
    v1::SkipRow* row = g->add_rows();
    row->set_param_index(i);
    row->set_param_name(name);
    for (int64_t c : counts) row->add_counts(c);
    row->set_skipped_everywhere(nowhere);
  };
  add_row(0, "attn.weight", {0, 0, 0, 0}, 0);
  add_row(1, "vision.proj", {10, 0, 12, 20}, 5);
  add_row(2, "unused.bias", {20, 20, 20, 20}, 20);
  return r;
}

TEST(FormatSkips, SmallMatrixPrintsEveryCellWithDotsForZero) {
  const std::string out = FormatSkips(SmallMatrix(), {});
  EXPECT_EQ(out,
            "job job1 group layers.0: 20 steps (0..19); cell = steps the rank had no gradient for "
            "the parameter\n"
            "  PARAM        r0  r1  r2  r3  NOWHERE\n"
            "  attn.weight  .   .   .   .   .\n"
            "  vision.proj  10  .   12  20  5\n"
            "  unused.bias  20  20  20  20  20\n");
}

TEST(FormatSkips, LargeMatrixIsSummarizedWithTopParamsAndRanksAndAHint) {
  SkipFormatOptions options;
  options.max_ranks = 2;  // force the summary
  options.top = 2;
  const std::string out = FormatSkips(SmallMatrix(), options);
  EXPECT_NE(out.find("3 parameters x 4 ranks is too large to print; top 2 of each:"),
            std::string::npos)
      << out;
  // unused.bias (80 rank-steps) before vision.proj (42); attn.weight not listed.
  const size_t unused = out.find("unused.bias  80");
  const size_t vision = out.find("vision.proj  42");
  EXPECT_NE(unused, std::string::npos) << out;
  EXPECT_NE(vision, std::string::npos) << out;
  EXPECT_LT(unused, vision);
  EXPECT_EQ(out.find("attn.weight"), std::string::npos) << out;
  // Rank 3 skipped the most (40), then rank 2 (32).
  EXPECT_NE(out.find("  3     40\n  2     32\n"), std::string::npos) << out;
  EXPECT_NE(out.find("--full, or --json"), std::string::npos);
}

TEST(FormatStalls, NamesMissingRanksWithTheirLastStep) {
  v1::StallsResponse r;
  v1::Stall* s = r.add_stalls();
  s->set_job_id("j");
  s->set_group_id("g");
  s->set_step(12);
  s->set_waiting_ms(1500);
  s->set_deadline_in_ms(58500);
  s->set_reported_ranks(6);
  s->add_missing_ranks(3);
  s->add_missing_last_steps(11);
  s->add_missing_ranks(7);
  s->add_missing_last_steps(-1);
  const std::string out = FormatStalls(r);
  EXPECT_NE(out.find("3 (11), 7 (-)"), std::string::npos) << out;
  EXPECT_NE(out.find("1.5s"), std::string::npos) << out;
  EXPECT_EQ(FormatStalls(v1::StallsResponse()), "no group is waiting\n");
}

TEST(FormatStatus, ListsNodesGroupsAndLaggingRanks) {
  v1::StatusResponse r;
  v1::JobStatus* j = r.add_jobs();
  j->set_job_id("j");
  j->set_world_size(2);
  v1::NodeStatus* n = j->add_nodes();
  n->set_node_id("node-a");
  n->set_connected(true);
  n->add_ranks(0);
  n->add_ranks(1);
  for (int rank = 0; rank < 2; ++rank) {
    v1::RankStatus* rs = j->add_ranks();
    rs->set_rank(rank);
    rs->set_node_id("node-a");
    rs->set_connected(true);
    rs->set_last_step(rank == 0 ? 9 : 7);
  }
  v1::GroupStatus* g = j->add_groups();
  g->set_group_id("layers.0");
  g->set_num_params(4);
  g->set_last_decided_step(7);
  g->set_decisions(8);
  g->set_cache_hits(6);
  g->set_cache_misses(2);
  g->set_last_wire_dtype("float32");
  g->set_last_num_skipped(1);
  const std::string out = FormatStatus(r);
  EXPECT_NE(out.find("job j: world size 2, 2 ranks connected on 1 nodes, steps 7..9"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("node-a  yes        0-1"), std::string::npos) << out;
  EXPECT_NE(out.find("ranks behind or disconnected:"), std::string::npos) << out;
  EXPECT_NE(out.find("1     node-a  yes        7"), std::string::npos) << out;
  EXPECT_NE(out.find("layers.0  4       7          8          75%        float32  1"),
            std::string::npos)
      << out;
  EXPECT_EQ(FormatStatus(v1::StatusResponse()), "no jobs\n");
}

TEST(ToJson, RoundTripsThroughTheProtoJsonMapping) {
  const v1::SkipMatrixResponse in = SmallMatrix();
  const std::string json = ToJson(in);
  EXPECT_NE(json.find("\"skipped_everywhere\""), std::string::npos) << json;
  v1::SkipMatrixResponse out;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &out).ok());
  EXPECT_EQ(out.SerializeAsString(), in.SerializeAsString());
}

}  // namespace
}  // namespace accord::cli
