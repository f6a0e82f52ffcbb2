#include "daemon/coordinator/group_state.h"

#include <iterator>

namespace accord::daemon {

std::shared_ptr<const Content> Contribution::Owner() const {
  return group->contents.Owner(content);  // never null: a pending contribution's content is held
}

uint64_t MixKey(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return k;
}

void GroupState::RecordDecision(int64_t step, const v1::Decision& d, uint64_t combined_key) {
  last_decided_step_ = step;
  // Earlier steps only `decided` manifests spoke for can never be wanted now
  // (every node that sent one holds that decision; docs/ARCHITECTURE.md,
  // "Decisions across a coordinator restart"). Their contents are released
  // with the decided steps' (ContentCache::Prune).
  for (auto it = pending.begin(); it != pending.end() && it->first < step;) {
    it = it->second.clock.started() ? std::next(it) : pending.erase(it);
  }
  last_.wait_us = d.wait_us();
  if (d.same_as_previous()) return;
  last_.ok = d.has_ok();
  last_.combined_key = combined_key;
  last_.decision = std::make_shared<const v1::Decision>(d);
}

}  // namespace accord::daemon
