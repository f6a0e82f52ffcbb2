#include "observe/metrics.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "core/log.h"

namespace accord {
namespace {

void AtomicAdd(std::atomic<double>& a, double by) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + by, std::memory_order_relaxed)) {
  }
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrCat(static_cast<int64_t>(v));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string LabelBlock(const std::vector<std::string>& names, const LabelValues& values,
                       const std::string& extra_name = "", const std::string& extra_value = "") {
  std::string out;
  for (size_t i = 0; i < names.size() && i < values.size(); ++i) {
    absl::StrAppend(&out, out.empty() ? "" : ",", names[i], "=\"", EscapeLabelValue(values[i]),
                    "\"");
  }
  if (!extra_name.empty()) {
    absl::StrAppend(&out, out.empty() ? "" : ",", extra_name, "=\"", extra_value, "\"");
  }
  return out.empty() ? "" : absl::StrCat("{", out, "}");
}

std::string EscapeHelp(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void Counter::Increment(double by) { AtomicAdd(value_, by); }
void Counter::SetTotal(double total) {
  double cur = value_.load(std::memory_order_relaxed);
  while (cur < total && !value_.compare_exchange_weak(cur, total, std::memory_order_relaxed)) {
  }
}
void Gauge::Add(double by) { AtomicAdd(value_, by); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

void Histogram::Observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, v);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::CumulativeCounts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  uint64_t acc = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    acc += buckets_[i].load(std::memory_order_relaxed);
    out[i] = acc;
  }
  return out;
}

double Histogram::Quantile(double q) const {
  const std::vector<uint64_t> cum = CumulativeCounts();
  const uint64_t total = cum.back();
  if (total == 0) return 0;
  const double rank = q * static_cast<double>(total);
  for (size_t i = 0; i < cum.size(); ++i) {
    if (static_cast<double>(cum[i]) >= rank) {
      if (i == bounds_.size()) return bounds_.empty() ? 0 : bounds_.back();
      const double lo = i == 0 ? 0 : bounds_[i - 1];
      const double hi = bounds_[i];
      const uint64_t below = i == 0 ? 0 : cum[i - 1];
      const uint64_t in = cum[i] - below;
      if (in == 0) return hi;
      return lo + (hi - lo) * (rank - static_cast<double>(below)) / static_cast<double>(in);
    }
  }
  return bounds_.empty() ? 0 : bounds_.back();
}

std::vector<double> MetricsRegistry::LatencyBuckets() {
  return {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
          5e-2, 0.1,    0.25, 0.5,  1,      2.5,  5,    10,     30,   60};
}

template <typename T>
Family<T>& MetricsRegistry::Add(const std::string& name, const std::string& help,
                                std::vector<std::string> labels, const char* type,
                                std::vector<double> bounds) {
  accord::MutexLock lock(&mu_);
  auto it = families_.find(name);
  if (it != families_.end()) {
    auto* f = dynamic_cast<Family<T>*>(it->second.get());
    if (f == nullptr || f->label_names() != labels) {
      ACCORD_LOG(ERROR) << "metric " << name << " registered twice with different type or labels";
      std::abort();
    }
    return *f;
  }
  auto f = std::make_unique<Family<T>>(name, help, std::move(labels), type, std::move(bounds));
  Family<T>& ref = *f;
  families_.emplace(name, std::move(f));
  return ref;
}

Family<Counter>& MetricsRegistry::AddCounter(const std::string& name, const std::string& help,
                                             std::vector<std::string> labels) {
  return Add<Counter>(name, help, std::move(labels), "counter", {});
}
Family<Gauge>& MetricsRegistry::AddGauge(const std::string& name, const std::string& help,
                                         std::vector<std::string> labels) {
  return Add<Gauge>(name, help, std::move(labels), "gauge", {});
}
Family<Histogram>& MetricsRegistry::AddHistogram(const std::string& name, const std::string& help,
                                                 std::vector<std::string> labels,
                                                 std::vector<double> bounds) {
  return Add<Histogram>(name, help, std::move(labels), "histogram", std::move(bounds));
}

size_t MetricsRegistry::NumSeries() const {
  accord::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [name, family] : families_) n += family->NumChildren();
  return n;
}

std::string MetricsRegistry::Render() const {
  std::string out;
  accord::MutexLock lock(&mu_);
  for (const auto& [name, family] : families_) family->Render(&out);
  return out;
}

template <typename T>
T& Family<T>::WithLabels(const LabelValues& values) {
  accord::MutexLock lock(&mu_);
  auto it = children_.find(values);
  if (it != children_.end()) return *it->second;
  std::unique_ptr<T> child;
  if constexpr (std::is_same_v<T, Histogram>) {
    child = std::make_unique<Histogram>(bounds_);
  } else {
    child = std::make_unique<T>();
  }
  T& ref = *child;
  children_.emplace(values, std::move(child));
  return ref;
}

template <typename T>
void Family<T>::RemoveByFirstLabel(const std::string& value) {
  accord::MutexLock lock(&mu_);
  for (auto it = children_.begin(); it != children_.end();) {
    if (!it->first.empty() && it->first[0] == value) {
      it = children_.erase(it);
    } else {
      ++it;
    }
  }
}

template <typename T>
void Family<T>::Render(std::string* out) const {
  absl::StrAppend(out, "# HELP ", name_, " ", EscapeHelp(help_), "\n# TYPE ", name_, " ", type_,
                  "\n");
  accord::MutexLock lock(&mu_);
  for (const auto& [values, child] : children_) {
    if constexpr (std::is_same_v<T, Histogram>) {
      const std::vector<uint64_t> cum = child->CumulativeCounts();
      for (size_t i = 0; i < cum.size(); ++i) {
        const std::string le = i < bounds_.size() ? FormatValue(bounds_[i]) : "+Inf";
        absl::StrAppend(out, name_, "_bucket", LabelBlock(labels_, values, "le", le), " ", cum[i],
                        "\n");
      }
      absl::StrAppend(out, name_, "_sum", LabelBlock(labels_, values), " ",
                      FormatValue(child->sum()), "\n");
      absl::StrAppend(out, name_, "_count", LabelBlock(labels_, values), " ", child->count(), "\n");
    } else {
      absl::StrAppend(out, name_, LabelBlock(labels_, values), " ", FormatValue(child->value()),
                      "\n");
    }
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

}  // namespace accord
