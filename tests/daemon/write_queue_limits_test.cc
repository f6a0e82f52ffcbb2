#include "daemon/common/write_queue_limits.h"

#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

using Verdict = WriteQueueWatermarks::Verdict;

TEST(WriteQueueWatermarksTest, WarnsOncePastLowReArmsBelowHalfOfItAndCutsOffPastHigh) {
  WriteQueueWatermarks w(WriteQueueLimits{4, 8});
  for (size_t n = 1; n <= 4; ++n) EXPECT_EQ(w.Update(n), Verdict::kOk) << n;
  EXPECT_EQ(w.Update(5), Verdict::kBackingUp);
  EXPECT_EQ(w.Update(6), Verdict::kOk) << "reported once";
  EXPECT_EQ(w.Update(3), Verdict::kOk);
  EXPECT_EQ(w.Update(5), Verdict::kOk) << "not re-armed above low / 2";
  EXPECT_EQ(w.Update(1), Verdict::kOk);
  EXPECT_EQ(w.Update(5), Verdict::kBackingUp) << "re-armed below low / 2";
  EXPECT_EQ(w.Update(8), Verdict::kOk);
  EXPECT_EQ(w.Update(9), Verdict::kCutOff);
}

TEST(WriteQueueWatermarksTest, TheCutOffErrorNamesThePeerAndTheLimit) {
  WriteQueueWatermarks w(WriteQueueLimits{4, 8});
  absl::Status s = w.CutOffStatus("the rank process at unix:/tmp/s.sock");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "the rank process at unix:/tmp/s.sock did not read its stream: more than 8 messages "
            "were queued for it (--stream_queue_high_watermark), so it was cut off instead of "
            "growing the daemon's memory; check that the process reads its replies (is it "
            "stopped or overloaded?) and reconnect");
}

}  // namespace
}  // namespace accord::daemon
