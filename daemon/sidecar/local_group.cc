#include "daemon/sidecar/local_group.h"

#include <algorithm>
#include <utility>

namespace accord::daemon {

LocalStep& StepCollection::StepFor(int64_t step) {
  auto it = std::lower_bound(steps.begin(), steps.end(), step,
                             [](const LocalStep& st, int64_t s) { return st.step < s; });
  if (it != steps.end() && it->step == step) return *it;
  LocalStep fresh;
  if (!spare.empty()) {
    fresh = std::move(spare.back());
    spare.pop_back();
  }
  fresh.step = step;
  fresh.sent = false;
  fresh.ranks.clear();
  fresh.rows.clear();
  fresh.merged.clear();
  return *steps.insert(it, std::move(fresh));
}

void StepCollection::DropUpTo(int64_t step) {
  size_t n = 0;
  while (n < steps.size() && steps[n].step <= step) ++n;
  for (size_t i = 0; i < n; ++i) spare.push_back(std::move(steps[i]));
  steps.erase(steps.begin(), steps.begin() + n);
}

const LastFull* StepCollection::LastFullOf(int rank) const {
  auto it = std::lower_bound(last_full.begin(), last_full.end(), rank,
                             [](const LastFull& l, int r) { return l.rank < r; });
  return it != last_full.end() && it->rank == rank ? &*it : nullptr;
}

void StepCollection::RememberFull(int rank, uint64_t key, const std::vector<DTypeMask>& dtypes) {
  auto it = std::lower_bound(last_full.begin(), last_full.end(), rank,
                             [](const LastFull& l, int r) { return l.rank < r; });
  if (it == last_full.end() || it->rank != rank) it = last_full.insert(it, LastFull{rank, 0, {}});
  it->key = key;
  it->dtypes.assign(dtypes.begin(), dtypes.end());
}

StepCollection::Row StepCollection::AddRow(LocalStep& st, int rank,
                                           const std::vector<DTypeMask>& content) {
  const size_t num_params = content.size();
  auto pos = std::lower_bound(st.ranks.begin(), st.ranks.end(), rank);
  const size_t row = static_cast<size_t>(pos - st.ranks.begin());
  if (pos != st.ranks.end() && *pos == rank) {
    return std::equal(content.begin(), content.end(), st.rows.begin() + row * num_params)
               ? Row::kSame
               : Row::kDiffers;
  }
  st.ranks.insert(pos, rank);
  st.rows.insert(st.rows.begin() + row * num_params, content.begin(), content.end());
  if (st.merged.size() != num_params) st.merged.assign(num_params, 0);
  for (size_t i = 0; i < num_params; ++i) st.merged[i] |= content[i];
  return Row::kAdded;
}

int64_t Decided::Record(const v1::Decision& d) {
  const int64_t previous = step;
  // An older step answered again (a resumed rank's resend) changes nothing
  // the group's next `same_as_previous` stands for.
  const bool newest = d.step() >= previous;
  if (d.step() > step) step = d.step();
  if (newest && d.has_ok()) ok = d.ok();
  if (newest && d.has_error()) ok.reset();
  if (newest) {
    if (d.has_error()) {
      error = d;
    } else {
      error.reset();
    }
  }
  return previous;
}

LocalGroup* LocalGroups::Find(const std::string& group_id) {
  auto it = by_id_.find(group_id);
  return it == by_id_.end() ? nullptr : &it->second;
}

LocalGroup& LocalGroups::FindOrAdd(const std::string& group_id) {
  auto [it, inserted] = by_id_.try_emplace(group_id);
  LocalGroup& g = it->second;
  if (inserted) {
    g.group_id = group_id;
    g.index = static_cast<int>(order_.size());
    order_.push_back(&g);
  }
  return g;
}

void LocalGroups::Clear() {
  order_.clear();
  by_id_.clear();
}

void UsageDetailOf(const LocalStep& st, size_t num_params, UsageDetail* detail) {
  detail->clear();
  for (size_t k = 0; k < st.ranks.size(); ++k) {
    const DTypeMask* row = st.rows.data() + k * num_params;
    bool differs = false;
    for (size_t i = 0; i < num_params && !differs; ++i) {
      differs = (row[i] != 0) != (st.merged[i] != 0);
    }
    if (!differs) continue;
    RankUsageBits& u = detail->emplace_back();
    u.rank = st.ranks[k];
    u.used_bits.assign((num_params + 7) / 8, '\0');
    for (size_t i = 0; i < num_params; ++i) {
      if (row[i] != 0) u.used_bits[i / 8] = static_cast<char>(u.used_bits[i / 8] | (1 << (i % 8)));
    }
  }
}

}  // namespace accord::daemon
