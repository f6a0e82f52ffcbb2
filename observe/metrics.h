// Prometheus metrics: counters, gauges and histograms with labels, rendered
// in the text exposition format (version 0.0.4).
//
// Thread-safe. Families are registered once (usually at start-up); a labelled
// child is created on first use and lives as long as the registry. Updates on
// an existing child take no lock.
#ifndef ACCORD_OBSERVE_METRICS_H_
#define ACCORD_OBSERVE_METRICS_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "core/sync.h"

namespace accord {

// Label values in the order of the family's label names.
using LabelValues = std::vector<std::string>;

class Counter {
 public:
  void Increment(double by = 1.0);
  // For a counter mirrored from a monotonic count kept elsewhere (read at
  // scrape time): raises the value to `total`, never lowers it.
  void SetTotal(double total);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double by);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  // Cumulative counts per bound (plus +Inf last), sum and count.
  std::vector<uint64_t> CumulativeCounts() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  const std::vector<double>& bounds() const { return bounds_; }
  // The q-quantile (0..1) estimated from the buckets (linear within a bucket).
  double Quantile(double q) const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1
  std::atomic<double> sum_{0};
  std::atomic<uint64_t> count_{0};
};

template <typename T>
class Family;

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Registers (or returns the existing) family. Names follow Prometheus
  // rules; a second registration with different labels or type is a bug in
  // our code and aborts.
  Family<Counter>& AddCounter(const std::string& name, const std::string& help,
                              std::vector<std::string> labels = {});
  Family<Gauge>& AddGauge(const std::string& name, const std::string& help,
                          std::vector<std::string> labels = {});
  Family<Histogram>& AddHistogram(const std::string& name, const std::string& help,
                                  std::vector<std::string> labels, std::vector<double> bounds);

  // The whole registry in the text exposition format.
  std::string Render() const;
  // Series (children) over every family.
  size_t NumSeries() const;

  // Latency buckets from 10 µs to 60 s, for negotiation waits (seconds).
  static std::vector<double> LatencyBuckets();

  struct FamilyBase;

 private:
  mutable accord::Mutex mu_;
  std::map<std::string, std::unique_ptr<FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
  template <typename T>
  Family<T>& Add(const std::string& name, const std::string& help, std::vector<std::string> labels,
                 const char* type, std::vector<double> bounds);
  friend class MetricsRegistryTestPeer;
};

// Escapes a label value for the exposition format (backslash, quote, newline).
std::string EscapeLabelValue(const std::string& v);

struct MetricsRegistry::FamilyBase {
  virtual ~FamilyBase() = default;
  virtual void Render(std::string* out) const = 0;
  virtual size_t NumChildren() const = 0;
};

template <typename T>
class Family : public MetricsRegistry::FamilyBase {
 public:
  Family(std::string name, std::string help, std::vector<std::string> labels, std::string type,
         std::vector<double> bounds)
      : name_(std::move(name)),
        help_(std::move(help)),
        labels_(std::move(labels)),
        type_(std::move(type)),
        bounds_(std::move(bounds)) {}

  // The child for these label values (created on first use). The reference
  // stays valid for the registry's lifetime.
  T& WithLabels(const LabelValues& values);
  T& Get() { return WithLabels({}); }
  // Drops every child whose first label equals `value` (e.g. a finished job).
  void RemoveByFirstLabel(const std::string& value);

  const std::vector<std::string>& label_names() const { return labels_; }
  void Render(std::string* out) const override;
  size_t NumChildren() const override {
    accord::MutexLock lock(&mu_);
    return children_.size();
  }

 private:
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> labels_;
  const std::string type_;
  const std::vector<double> bounds_;
  mutable accord::Mutex mu_;
  std::map<LabelValues, std::unique_ptr<T>> children_ ABSL_GUARDED_BY(mu_);
};

}  // namespace accord

#endif  // ACCORD_OBSERVE_METRICS_H_
