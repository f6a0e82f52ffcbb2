#include "daemon/sidecar/key_ledger.h"

#include <utility>

namespace accord::daemon {

int64_t KeyLedger::SizeOf(const v1::KeyValueSetRequest& r) {
  return static_cast<int64_t>(r.key().size() + r.value().size());
}

void KeyLedger::Note(const v1::KeyValueSetRequest& request) {
  accord::MutexLock l(&mu_);
  Scope* scope = nullptr;
  for (Scope& s : scopes_) {
    if (s.job_id == request.job_id() && s.run_id == request.run_id()) scope = &s;
  }
  if (scope == nullptr) {
    scopes_.push_back(Scope{request.job_id(), request.run_id(), {}, {}, 0});
    scope = &scopes_.back();
  }
  const int64_t size = SizeOf(request);
  auto [at, added] = scope->by_key.try_emplace(request.key(), scope->sets.size());
  if (added) {
    scope->sets.push_back(request);
  } else {
    scope->bytes -= SizeOf(scope->sets[at->second]);
    bytes_ -= SizeOf(scope->sets[at->second]);
    scope->sets[at->second] = request;
  }
  scope->bytes += size;
  bytes_ += size;
  // The newest scope stays even alone past the bound: it is the one a
  // rendezvous in progress needs.
  while (bytes_ > max_bytes_ && scopes_.size() > 1) {
    bytes_ -= scopes_.front().bytes;
    scopes_.pop_front();
  }
}

void KeyLedger::Prune(
    const std::function<bool(const std::string& job_id, const std::string& run_id)>& live) {
  accord::MutexLock l(&mu_);
  for (auto it = scopes_.begin(); it != scopes_.end();) {
    if (live(it->job_id, it->run_id)) {
      ++it;
      continue;
    }
    bytes_ -= it->bytes;
    it = scopes_.erase(it);
  }
}

void KeyLedger::Forget(const std::string& job_id, const std::string& run_id) {
  Prune([&](const std::string& j, const std::string& r) { return j != job_id || r != run_id; });
}

std::vector<v1::KeyValueSetRequest> KeyLedger::All() const {
  accord::MutexLock l(&mu_);
  std::vector<v1::KeyValueSetRequest> out;
  for (const Scope& s : scopes_) out.insert(out.end(), s.sets.begin(), s.sets.end());
  return out;
}

int64_t KeyLedger::bytes() const {
  accord::MutexLock l(&mu_);
  return bytes_;
}

int KeyLedger::scopes() const {
  accord::MutexLock l(&mu_);
  return static_cast<int>(scopes_.size());
}

}  // namespace accord::daemon
