#include "daemon/coordinator/usage_window.h"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace accord::daemon {
namespace {

// Adds one run of usage into the matrix rows (`rows[i].counts` sized to the
// world) with weight `w`.
void AddUsage(const std::vector<std::shared_ptr<const Content>>& contents, int64_t w,
              int num_params, v1::GroupSkipMatrix* m) {
  std::vector<bool> any(num_params, false);
  for (const auto& c : contents) {
    const int n = std::min<int>(num_params, static_cast<int>(c->dtypes.size()));
    std::vector<int> members = c->ranks->Members();
    for (int i = 0; i < n; ++i) {
      if (c->dtypes[i] != 0) any[i] = true;
    }
    for (int r : members) {
      const std::vector<bool>* used = nullptr;
      for (const auto& d : c->detail) {
        if (d.rank == r) used = &d.used;
      }
      for (int i = 0; i < num_params; ++i) {
        v1::SkipRow* row = m->mutable_rows(i);
        if (r < 0 || r >= row->counts_size()) continue;
        const bool has = i < n && c->dtypes[i] != 0 &&
                         (used == nullptr || (i < static_cast<int>(used->size()) && (*used)[i]));
        if (!has) row->set_counts(r, row->counts(r) + w);
      }
    }
  }
  for (int i = 0; i < num_params; ++i) {
    if (!any[i]) {
      v1::SkipRow* row = m->mutable_rows(i);
      row->set_skipped_everywhere(row->skipped_everywhere() + w);
    }
  }
}

}  // namespace

int64_t UsageWindow::Record(
    int64_t step, bool same,
    absl::FunctionRef<std::vector<std::shared_ptr<const Content>>()> contents) {
  int64_t added = 0;
  if (same && !runs_.empty() && runs_.back().first_step + runs_.back().steps == step) {
    ++runs_.back().steps;
  } else {
    UsageRun run;
    run.first_step = step;
    run.steps = 1;
    run.contents = contents();
    run.bytes = ContentBytes(run.contents);
    added = run.bytes;
    bytes_ += run.bytes;
    runs_.push_back(std::move(run));
  }
  ++steps_;
  return added;
}

void UsageWindow::Trim(const Limits& limits, int64_t& total) {
  const bool over_total = total > limits.total_bytes;
  while (!runs_.empty() &&
         (steps_ > limits.steps ||
          ((bytes_ > limits.bytes || total > limits.total_bytes) && runs_.size() > 1))) {
    UsageRun& front = runs_.front();
    const int64_t excess = steps_ - limits.steps;
    if (excess > 0 && excess < front.steps && bytes_ <= limits.bytes && !over_total) {
      front.first_step += excess;
      front.steps -= excess;
      steps_ -= excess;
      break;
    }
    steps_ -= front.steps;
    bytes_ -= front.bytes;
    total -= front.bytes;
    runs_.pop_front();
  }
}

std::deque<UsageRun> UsageWindow::Newest(int64_t window) const {
  std::deque<UsageRun> kept;
  int64_t remaining = window > 0 ? window : INT64_MAX;
  for (auto it = runs_.rbegin(); it != runs_.rend() && remaining > 0; ++it) {
    kept.push_front(*it);
    remaining -= it->steps;
  }
  return kept;
}

UsageWindow UsageWindow::Take() {
  UsageWindow taken;
  std::swap(taken, *this);
  return taken;
}

int64_t UsageWindow::ContentBytes(const std::vector<std::shared_ptr<const Content>>& contents) {
  int64_t bytes = 0;
  for (const auto& c : contents) {
    bytes += 64 + static_cast<int64_t>(c->dtypes.size()) * 2;
    for (const auto& d : c->detail) bytes += 32 + static_cast<int64_t>(d.used.size() / 8);
  }
  return bytes;
}

v1::GroupSkipMatrix UsageWindow::MatrixOf(const std::string& group_id,
                                          const std::vector<std::string>& names, int world,
                                          const std::deque<UsageRun>& runs, int64_t window) {
  v1::GroupSkipMatrix m;
  m.set_group_id(group_id);
  const int num_params = static_cast<int>(names.size());
  for (int i = 0; i < num_params; ++i) {
    v1::SkipRow* row = m.add_rows();
    row->set_param_index(i);
    row->set_param_name(names[i]);
    row->mutable_counts()->Resize(world, 0);
  }
  int64_t remaining = window > 0 ? window : INT64_MAX;
  int64_t first = -1, last = -1, steps = 0;
  for (auto it = runs.rbegin(); it != runs.rend() && remaining > 0; ++it) {
    const int64_t w = std::min(remaining, it->steps);
    remaining -= w;
    steps += w;
    if (last < 0) last = it->first_step + it->steps - 1;
    first = it->first_step + it->steps - w;
    AddUsage(it->contents, w, num_params, &m);
  }
  m.set_steps(steps);
  m.set_first_step(first);
  m.set_last_step(last);
  return m;
}

}  // namespace accord::daemon
