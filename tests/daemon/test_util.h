// Fakes and message builders shared by the daemon tests.
#ifndef ACCORD_TESTS_DAEMON_TEST_UTIL_H_
#define ACCORD_TESTS_DAEMON_TEST_UTIL_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "accord/v1/accord.pb.h"
#include "core/manifest.h"
#include "core/sync.h"
#include "daemon/coordinator/coordinator.h"
#include "proto/wire.h"

namespace accord::daemon::testing {

// Records every message; tests wait on a count (no sleeps).
class FakeNodeSink : public NodeSink {
 public:
  void Send(std::shared_ptr<const v1::CoordinatorMessage> message) override {
    accord::MutexLock l(&mu_);
    messages_.push_back(*message);
    last_sent_ = message;
    cv_wait_.SignalAll();
  }
  std::vector<v1::CoordinatorMessage> messages() {
    accord::MutexLock l(&mu_);
    return messages_;
  }
  // The last message object sent (to check that fan-outs share one).
  std::shared_ptr<const v1::CoordinatorMessage> last_sent() {
    accord::MutexLock l(&mu_);
    return last_sent_;
  }
  void Clear() {
    accord::MutexLock l(&mu_);
    messages_.clear();
  }
  // All decisions received, flattened.
  std::vector<v1::Decision> decisions() {
    std::vector<v1::Decision> out;
    for (const auto& m : messages()) {
      if (m.has_decisions()) {
        for (const auto& d : m.decisions().decisions()) out.push_back(d);
      }
    }
    return out;
  }
  std::vector<v1::RegistrationResult> registrations() {
    std::vector<v1::RegistrationResult> out;
    for (const auto& m : messages()) {
      if (m.has_registration()) out.push_back(m.registration());
    }
    return out;
  }
  std::vector<v1::DecisionError> errors() {
    std::vector<v1::DecisionError> out;
    for (const auto& m : messages()) {
      if (m.has_error()) out.push_back(m.error());
    }
    return out;
  }
  void AwaitRegistrations(size_t n) {
    accord::MutexLock l(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      size_t k = 0;
      for (const auto& m : messages_) k += m.has_registration() ? 1 : 0;
      return k >= n;
    };
    while (!enough()) cv_wait_.Wait(&mu_);
  }
  void AwaitDecisions(size_t n) {
    accord::MutexLock l(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      size_t k = 0;
      for (const auto& m : messages_) k += m.has_decisions() ? m.decisions().decisions_size() : 0;
      return k >= n;
    };
    while (!enough()) cv_wait_.Wait(&mu_);
  }

 private:
  accord::Mutex mu_;
  accord::CondVar cv_wait_;
  std::vector<v1::CoordinatorMessage> messages_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const v1::CoordinatorMessage> last_sent_ ABSL_GUARDED_BY(mu_);
};

inline GroupSpec MakeSpec(const std::string& id, int num_params) {
  GroupSpec spec;
  spec.group_id = id;
  for (int i = 0; i < num_params; ++i) {
    spec.params.push_back(ParamSpec{"layer" + std::to_string(i) + ".weight", 8, 64});
  }
  return spec;
}

inline v1::NodeMessage Hello(const std::string& job, const std::string& node, int world,
                             std::vector<int> ranks) {
  v1::NodeMessage m;
  m.mutable_hello()->set_job_id(job);
  m.mutable_hello()->set_node_id(node);
  m.mutable_hello()->set_world_size(world);
  for (int r : ranks) m.mutable_hello()->add_ranks(r);
  return m;
}

inline v1::NodeMessage Registration(const GroupSpec& spec, std::vector<int> ranks,
                                    const Policy& policy = Policy()) {
  v1::NodeMessage m;
  *m.mutable_registration()->mutable_registration() = wire::GroupSpecToProto(spec, policy);
  for (int r : ranks) m.mutable_registration()->add_ranks(r);
  return m;
}

// A node manifest in full form; `dtypes[i]` nullopt = no gradient. Empty
// rank_bits (all of the node's ranks) unless `ranks` is given.
inline v1::Manifest NodeManifest(const std::string& group, int64_t step,
                                 const std::vector<std::optional<DType>>& dtypes, int world,
                                 const std::vector<int>& node_ranks,
                                 const std::vector<int>& explicit_ranks = {}) {
  Manifest core = RankManifest(step, node_ranks[0], world, dtypes);
  for (int r : node_ranks) core.ranks.Add(r);
  v1::Manifest m;
  wire::ManifestToProto(group, core, /*with_ranks=*/false, &m);
  if (!explicit_ranks.empty()) {
    RankSet set(world);
    for (int r : explicit_ranks) set.Add(r);
    m.set_rank_bits(wire::RankSetToBits(set));
  }
  return m;
}

inline v1::Manifest Repeat(const std::string& group, int64_t step, uint64_t key) {
  v1::Manifest m;
  m.set_group_id(group);
  m.set_step(step);
  m.set_repeat(true);
  m.set_cache_key(key);
  return m;
}

inline v1::NodeMessage Batch(std::vector<v1::Manifest> manifests) {
  v1::NodeMessage m;
  for (auto& x : manifests) *m.mutable_manifests()->add_manifests() = std::move(x);
  return m;
}

}  // namespace accord::daemon::testing

#endif  // ACCORD_TESTS_DAEMON_TEST_UTIL_H_
