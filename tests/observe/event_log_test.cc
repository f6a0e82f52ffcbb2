#include "observe/event_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace accord {
namespace {

std::string TempDir() {
  std::string tmpl = std::filesystem::temp_directory_path() / "accord-eventlog-XXXXXX";
  char* dir = ::mkdtemp(tmpl.data());
  return dir ? std::string(dir) : std::string();
}

std::vector<std::string> Lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

TEST(EventLog, WritesOneEscapedJsonObjectPerLine) {
  const std::string dir = TempDir();
  auto log = EventLog::Open({dir + "/events.jsonl", 1 << 20, 2});
  ASSERT_TRUE(log.ok()) << log.status();
  (*log)->Write(
      "decision_changed",
      JsonObject().Add("job", "j\"1").Add("step", int64_t{7}).Add("ranks", std::vector<int>{1, 2}));
  (*log)->Flush();
  const auto lines = Lines(dir + "/events.jsonl");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].rfind("{\"ts\":\"", 0), 0u) << lines[0];
  EXPECT_NE(lines[0].find("\"event\":\"decision_changed\",\"job\":\"j\\\"1\",\"step\":7,"
                          "\"ranks\":[1,2]}"),
            std::string::npos)
      << lines[0];
  std::filesystem::remove_all(dir);
}

TEST(EventLog, AFullQueueDropsAndCountsLinesInsteadOfBlocking) {
  const std::string dir = TempDir();
  EventLog::Options o{dir + "/events.jsonl", 1 << 20, 2, /*max_queued=*/0};
  auto log = EventLog::Open(o);
  ASSERT_TRUE(log.ok());
  for (int i = 0; i < 10; ++i) (*log)->Write("stall", JsonObject().Add("i", i));
  (*log)->Flush();
  EXPECT_EQ((*log)->lines_dropped(), 10);
  EXPECT_EQ((*log)->lines_written(), 0);
  std::filesystem::remove_all(dir);
}

// A disk that takes nothing (a FIFO nobody reads) holds neither Write nor
// the destructor: the log gives up after exit_drain and its writer thread,
// blocked in write(2), is left to end with the process.
TEST(EventLog, AStuckDiskDoesNotHoldTheExit) {
  const std::string dir = TempDir();
  const std::string path = dir + "/events.fifo";
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  const int reader = ::open(path.c_str(), O_RDONLY | O_NONBLOCK);  // opened, never read
  ASSERT_GE(reader, 0);
  EventLog::Options o{path, 1 << 30, 1};
  o.exit_drain = absl::Milliseconds(200);
  auto log = EventLog::Open(o);
  ASSERT_TRUE(log.ok()) << log.status();
  // Far more than a pipe holds (64 KiB): the writer blocks in write(2).
  const std::string pad(1000, 'x');
  for (int i = 0; i < 2000; ++i) (*log)->Write("stall", JsonObject().Add("pad", pad));
  const absl::Time start = absl::Now();
  log->reset();
  // A liveness bound, far above exit_drain: without the give-up this waits
  // for a reader that never comes.
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  // `reader` stays open: the writer left behind stays blocked, not broken.
  std::filesystem::remove_all(dir);
}

TEST(EventLog, RotatesAtTheSizeBoundAndKeepsOnlyMaxFiles) {
  const std::string dir = TempDir();
  const std::string path = dir + "/events.jsonl";
  auto log = EventLog::Open({path, 2048, 2});
  ASSERT_TRUE(log.ok());
  for (int i = 0; i < 200; ++i) {
    (*log)->Write("stall", JsonObject().Add("i", i).Add("pad", std::string(40, 'x')));
  }
  (*log)->Flush();
  EXPECT_EQ((*log)->lines_written(), 200);
  EXPECT_TRUE(std::filesystem::exists(path));
  EXPECT_TRUE(std::filesystem::exists(path + ".1"));
  EXPECT_TRUE(std::filesystem::exists(path + ".2"));
  EXPECT_FALSE(std::filesystem::exists(path + ".3"));
  for (const char* suffix : {"", ".1", ".2"}) {
    EXPECT_LE(std::filesystem::file_size(path + suffix), 2048u) << suffix;
  }
  // The newest event is the last line of the live file.
  const auto lines = Lines(path);
  ASSERT_FALSE(lines.empty());
  EXPECT_NE(lines.back().find("\"i\":199"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(EventLog, BadOptionsAreRejected) {
  EXPECT_EQ(EventLog::Open({"", 4096, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EventLog::Open({"/tmp/x", 10, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(EventLog::Open({"/nonexistent-dir/x/events", 4096, 1}).ok());
  EventLog::Options negative{"/tmp/x", 4096, 1};
  negative.exit_drain = absl::Seconds(-1);
  EXPECT_EQ(EventLog::Open(negative).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace accord
