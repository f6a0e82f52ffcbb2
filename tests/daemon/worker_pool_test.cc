#include "daemon/common/worker_pool.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

TEST(WorkerPoolTest, CallsEveryIndexOnceAndTheResultsAreVisibleAfterwards) {
  WorkerPool pool(4);
  EXPECT_EQ(pool.threads(), 4);
  for (int64_t n : {0, 1, 2, 7, 100, 10000}) {
    std::vector<int> calls(n, 0);  // plain ints: the pool must order them
    pool.ParallelFor(n, [&](int64_t i) { ++calls[i]; });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(calls[i], 1) << "n=" << n << " i=" << i;
  }
}

TEST(WorkerPoolTest, SpreadsALoopOverItsThreads) {
  WorkerPool pool(3);
  std::mutex mu;
  std::set<std::thread::id> seen;
  std::atomic<int> waiting{0};
  // Each part waits (bounded) until three parts run at once, so one thread
  // cannot take them all.
  pool.ParallelFor(3, [&](int64_t) {
    {
      std::lock_guard<std::mutex> l(mu);
      seen.insert(std::this_thread::get_id());
    }
    waiting.fetch_add(1);
    for (int i = 0; i < 2000 && waiting.load() < 3; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  EXPECT_EQ(seen.size(), 3u);
  EXPECT_TRUE(seen.count(std::this_thread::get_id())) << "the caller takes parts too";
}

TEST(WorkerPoolTest, OneThreadRunsEverythingOnTheCaller) {
  WorkerPool pool(1);
  EXPECT_EQ(pool.threads(), 1);
  const std::thread::id me = std::this_thread::get_id();
  int others = 0;
  pool.ParallelFor(50, [&](int64_t) { others += std::this_thread::get_id() != me; });
  EXPECT_EQ(others, 0);
}

TEST(WorkerPoolTest, ManyLoopsFromSeveralCallersEachCompleteAlone) {
  WorkerPool pool(3);
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([&, c] {
      for (int loop = 0; loop < 300; ++loop) {
        const int64_t n = 1 + (loop * 7 + c) % 23;
        std::vector<int64_t> out(n, -1);
        pool.ParallelFor(n, [&](int64_t i) { out[i] = i * (c + 1); });
        for (int64_t i = 0; i < n; ++i) bad += out[i] != i * (c + 1);
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace accord::daemon
