#include "observe/metrics.h"

#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "observe/http_client.h"
#include "observe/http_server.h"

namespace accord {
namespace {

TEST(MetricsRegistry, RendersCountersGaugesWithLabelsInExpositionFormat) {
  MetricsRegistry r;
  auto& decisions = r.AddCounter("accord_decisions_total", "Decisions made.", {"job", "group"});
  decisions.WithLabels({"j1", "g0"}).Increment();
  decisions.WithLabels({"j1", "g0"}).Increment(2);
  decisions.WithLabels({"j1", "g\"1"}).Increment();
  r.AddGauge("accord_connected_ranks", "Ranks connected.", {"job"}).WithLabels({"j1"}).Set(8);
  const std::string text = r.Render();
  EXPECT_NE(text.find("# TYPE accord_decisions_total counter\n"), std::string::npos) << text;
  EXPECT_NE(text.find("accord_decisions_total{job=\"j1\",group=\"g0\"} 3\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("accord_decisions_total{job=\"j1\",group=\"g\\\"1\"} 1\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("accord_connected_ranks{job=\"j1\"} 8\n"), std::string::npos) << text;
}

TEST(MetricsRegistry, HistogramBucketsAreCumulativeWithSumAndCount) {
  MetricsRegistry r;
  auto& h = r.AddHistogram("wait_seconds", "Wait.", {}, {0.1, 1});
  h.Get().Observe(0.05);
  h.Get().Observe(0.5);
  h.Get().Observe(5);
  const std::string text = r.Render();
  EXPECT_NE(text.find("wait_seconds_bucket{le=\"0.10000000000000001\"} 1\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("wait_seconds_bucket{le=\"1\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("wait_seconds_bucket{le=\"+Inf\"} 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("wait_seconds_count 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("wait_seconds_sum 5.5499999999999998\n"), std::string::npos) << text;
}

TEST(Histogram, QuantileInterpolatesWithinBucket) {
  Histogram h({1, 2, 3, 4});
  for (int i = 0; i < 100; ++i) h.Observe(1.5);
  EXPECT_GT(h.Quantile(0.5), 1.0);
  EXPECT_LE(h.Quantile(0.5), 2.0);
  EXPECT_EQ(Histogram({1}).Quantile(0.5), 0);
}

TEST(MetricsRegistry, RemoveByFirstLabelDropsAFinishedJob) {
  MetricsRegistry r;
  auto& c = r.AddCounter("c_total", "c", {"job"});
  c.WithLabels({"a"}).Increment();
  c.WithLabels({"b"}).Increment();
  c.RemoveByFirstLabel("a");
  const std::string text = r.Render();
  EXPECT_EQ(text.find("job=\"a\""), std::string::npos);
  EXPECT_NE(text.find("job=\"b\""), std::string::npos);
}

TEST(MetricsRegistry, ConcurrentIncrementsAreNotLost) {
  MetricsRegistry r;
  auto& c = r.AddCounter("n_total", "n", {"k"});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) c.WithLabels({"x"}).Increment();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c.WithLabels({"x"}).value(), 40000);
}

TEST(MetricsHttpServer, ServesMetricsAndHealthOnAnEphemeralPort) {
  MetricsRegistry r;
  r.AddCounter("accord_cache_hits_total", "hits", {"job"}).WithLabels({"j"}).Increment(7);
  MetricsHttpServer server([&] { return r.Render(); });
  absl::StatusOr<int> port = server.Start("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  ASSERT_GT(*port, 0);
  absl::StatusOr<HttpResponse> metrics = HttpGet("127.0.0.1", *port, "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(metrics->status, 200) << metrics->headers;
  EXPECT_NE(metrics->headers.find("text/plain; version=0.0.4"), std::string::npos)
      << metrics->headers;
  EXPECT_NE(metrics->body.find("accord_cache_hits_total{job=\"j\"} 7"), std::string::npos)
      << metrics->body;
  absl::StatusOr<HttpResponse> health = HttpGet("127.0.0.1", *port, "/healthz");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_NE(health->body.find("ok"), std::string::npos);
  server.Stop();
  EXPECT_FALSE(HttpGet("127.0.0.1", *port, "/metrics").ok());
}

TEST(MetricsHttpServer, BusyPortIsAClearError) {
  MetricsHttpServer a([] { return std::string(); });
  absl::StatusOr<int> port = a.Start("127.0.0.1:0");
  ASSERT_TRUE(port.ok());
  MetricsHttpServer b([] { return std::string(); });
  absl::StatusOr<int> again = b.Start("127.0.0.1:" + std::to_string(*port));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(again.status().message().find("port is taken"), std::string::npos);
}

TEST(MetricsHttpServer, StartForDaemonNamesTheFlagsWhenThePortIsTaken) {
  MetricsHttpServer a([] { return std::string(); });
  absl::StatusOr<int> port = a.StartForDaemon("accord-test", "127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  MetricsHttpServer b([] { return std::string(); });
  absl::StatusOr<int> again = b.StartForDaemon("accord-test", "127.0.0.1", *port);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(again.status().message().find("--metrics_port"), std::string::npos) << again.status();
}

TEST(Counter, SetTotalRaisesButNeverLowers) {
  Counter c;
  c.SetTotal(5);
  EXPECT_EQ(c.value(), 5);
  c.SetTotal(3);
  EXPECT_EQ(c.value(), 5);
  c.Increment(2);
  c.SetTotal(6);
  EXPECT_EQ(c.value(), 7);
}

}  // namespace
}  // namespace accord
