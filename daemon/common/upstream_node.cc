#include "daemon/common/upstream_node.h"

#include <algorithm>
#include <random>
#include <utility>

#include "proto/wire.h"

namespace accord::daemon {

void GroupRegistrations::Add(const v1::GroupRegistration& registration,
                             const std::vector<int>& ranks) {
  std::string bytes = registration.SerializeAsString();
  auto it = std::find_if(variants_.begin(), variants_.end(),
                         [&](const Variant& v) { return v.bytes == bytes; });
  if (it == variants_.end()) {
    variants_.push_back(Variant{registration, std::move(bytes), {}});
    it = variants_.end() - 1;
  }
  it->ranks.insert(ranks.begin(), ranks.end());
}

void InflightManifests::Add(int64_t step, std::shared_ptr<const v1::Manifest> full,
                            size_t announced, bool decided) {
  auto at = std::upper_bound(entries_.begin(), entries_.end(), step,
                             [](int64_t s, const Entry& e) { return s < e.step; });
  entries_.insert(at, Entry{step, std::move(full), announced, decided});
}

void InflightManifests::AppendEntry(const Entry& e, const UpstreamNode& node,
                                    const MemberSet* members, v1::ManifestBatch* out) {
  v1::Manifest* m = out->add_manifests();
  *m = *e.full;
  m->set_step(e.step);
  if (e.decided) m->set_decided(true);
  // Without rank_bits a manifest stands for the node's announced ranks as
  // the receiver reads it: those of its build, unless more came since.
  if (m->rank_bits().empty() && e.announced != node.announced().size()) {
    m->set_rank_bits(wire::RankSetToBits(node.FirstAnnounced(e.announced, members)));
  }
}

void InflightManifests::DropUpTo(int64_t step) {
  size_t n = 0;
  while (n < entries_.size() && entries_[n].step <= step) ++n;
  if (step > decided_step_) {
    decided_step_ = step;
    decided_.clear();
  }
  for (size_t i = 0; i < n; ++i) {
    if (entries_[i].step == decided_step_) decided_.push_back(std::move(entries_[i]));
  }
  entries_.erase(entries_.begin(), entries_.begin() + n);
}

bool InflightManifests::AppendStep(int64_t step, const UpstreamNode& node, const MemberSet* members,
                                   v1::ManifestBatch* out) const {
  auto it = std::lower_bound(entries_.begin(), entries_.end(), step,
                             [](const Entry& e, int64_t s) { return e.step < s; });
  bool any = false;
  for (; it != entries_.end() && it->step == step; ++it) {
    AppendEntry(*it, node, members, out);
    any = true;
  }
  return any;
}

void InflightManifests::AppendAll(const UpstreamNode& node, const MemberSet* members,
                                  v1::ManifestBatch* out) const {
  for (const Entry& e : decided_) {
    AppendEntry(e, node, members, out);
    out->mutable_manifests()->rbegin()->set_decided(true);
  }
  for (const Entry& e : entries_) AppendEntry(e, node, members, out);
}

size_t InflightManifests::CountBefore(int64_t step) const {
  size_t n = 0;
  while (n < entries_.size() && entries_[n].step < step) ++n;
  return n;
}

v1::NodeMessage PartialReport(absl::string_view group_id, int64_t step, absl::Duration waited,
                              const std::vector<int>& reported) {
  v1::NodeMessage up;
  v1::NodeProgress* p = up.mutable_progress();
  p->set_group_id(std::string(group_id));
  p->set_step(step);
  p->set_partial(true);
  p->set_waited_us(absl::ToInt64Microseconds(waited));
  for (int r : reported) p->add_reported(r);
  return up;
}

void UpstreamNode::Send(v1::NodeMessage message) {
  if (sink_ != nullptr) sink_->Send(std::move(message));
}

void UpstreamNode::StartJob(absl::string_view job_id, int world_size, absl::string_view token,
                            absl::string_view resume_run_id, uint64_t resume_epoch) {
  job_.job_id = std::string(job_id);
  job_.world_size = world_size;
  announced_set_ = RankSet(world_size);
  job_.token = std::string(token);
  job_.run_id = std::string(resume_run_id);
  // A new local incarnation of the job (NodeHello.node_epoch), unless the
  // ranks that make it resume one.
  if (resume_epoch != 0) {
    job_.epoch = resume_epoch;
    return;
  }
  std::random_device rd;
  job_.epoch = ((static_cast<uint64_t>(rd()) << 32) ^ rd()) | 1;
}

void UpstreamNode::EndJob() {
  job_ = Job();
  stream_ = Stream();
  announced_.clear();
  announced_set_ = RankSet();
  announce_order_.clear();
  left_.clear();
}

v1::NodeMessage UpstreamNode::StartStreamHello() {
  stream_.hello_sent = true;
  v1::NodeMessage m;
  v1::NodeHello* h = m.mutable_hello();
  h->set_job_id(job_.job_id);
  h->set_node_id(node_id_);
  h->set_world_size(job_.world_size);
  h->set_token(job_.token);
  for (int r : announced_) h->add_ranks(r);
  h->set_answers_progress(true);
  // Runs (docs/ARCHITECTURE.md): a stream of a run the node was placed in
  // resumes it; otherwise the node's ranks start or join one.
  h->set_run_id(job_.run_id);
  h->set_run_start(job_.run_id.empty() ? v1::NodeHello::RUN_START_NEW
                                       : v1::NodeHello::RUN_START_RESUME);
  h->set_node_epoch(job_.epoch);
  return m;
}

RankSet UpstreamNode::FirstAnnounced(size_t n) const {
  RankSet out(job_.world_size);
  for (size_t i = 0; i < n && i < announce_order_.size(); ++i) out.Add(announce_order_[i]);
  return out;
}

RankSet UpstreamNode::FirstAnnounced(size_t n, const MemberSet* members) const {
  RankSet out(job_.world_size);
  for (size_t i = 0; i < n && i < announce_order_.size(); ++i) {
    if (members == nullptr || members->Contains(announce_order_[i])) out.Add(announce_order_[i]);
  }
  return out;
}

bool UpstreamNode::IsAnnounced(const RankSet& ranks, const MemberSet* members) const {
  if (members == nullptr) return ranks == announced_set_;
  const std::vector<uint64_t>& a = announced_set_.words();
  const std::vector<uint64_t>& m = members->rank_set().words();
  const std::vector<uint64_t>& r = ranks.words();
  if (r.size() != a.size() || m.size() != a.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (r[i] != (a[i] & m[i])) return false;
  }
  return true;
}

bool UpstreamNode::IsAnnounced(const std::vector<int>& ascending, const MemberSet* members) const {
  auto it = ascending.begin();
  for (int r : announced_) {
    if (members != nullptr && !members->Contains(r)) continue;
    if (it == ascending.end() || *it != r) return false;
    ++it;
  }
  return it == ascending.end();
}

void UpstreamNode::Announce(int rank) {
  if (announced_.insert(rank).second) announce_order_.push_back(rank);
  left_.erase(rank);
  announced_set_.Add(rank);
}

void UpstreamNode::AnnounceRanks(const std::vector<int>& ranks) {
  for (int r : ranks) {
    const bool news = announced_.count(r) == 0 || left_.count(r) != 0;
    Announce(r);
    if (!news || !stream_.hello_sent) continue;
    v1::NodeMessage join;
    join.mutable_rank_event()->set_rank(r);
    join.mutable_rank_event()->set_joined(true);
    Send(std::move(join));
  }
  if (!stream_.hello_sent) Send(StartStreamHello());
}

void UpstreamNode::LeaveRank(int rank, int64_t last_step, const std::string& cause) {
  v1::NodeMessage left;
  left.mutable_rank_event()->set_rank(rank);
  left.mutable_rank_event()->set_joined(false);
  left.mutable_rank_event()->set_last_step(last_step);
  left.mutable_rank_event()->set_cause(cause);
  Send(std::move(left));
  if (announced_.count(rank) != 0) left_.insert(rank);
}

void UpstreamNode::ForwardRankEvent(const v1::RankEvent& event) {
  if (event.joined()) {
    Announce(event.rank());
  } else if (announced_.count(event.rank()) != 0) {
    left_.insert(event.rank());
  }
  v1::NodeMessage up;
  *up.mutable_rank_event() = event;
  Send(std::move(up));
}

void UpstreamNode::Connected(std::vector<v1::NodeMessage> registrations,
                             v1::ManifestBatch inflight) {
  stream_.hello_sent = false;
  stream_.welcomed = false;
  stream_.batch_repeat = false;  // until the new stream's Welcome offers them
  std::vector<v1::NodeMessage> messages;
  if (has_job()) {
    messages.push_back(StartStreamHello());
    for (v1::NodeMessage& m : registrations) messages.push_back(std::move(m));
    // The new stream's previous batch is the resend (or none).
    stream_.previous.Record(inflight);
    if (inflight.manifests_size() > 0) {
      v1::NodeMessage batch;
      *batch.mutable_manifests() = std::move(inflight);
      messages.push_back(std::move(batch));
    }
  } else {
    stream_.previous.Clear();
  }
  if (sink_ != nullptr) sink_->Reset(std::move(messages));
}

void UpstreamNode::OnWelcome(const v1::Welcome& welcome) {
  stream_.welcomed = true;
  stream_.batch_repeat = welcome.batch_repeat();
  stream_.deadline_ms = welcome.deadline_ms();
  stream_.members = welcome.members();
  if (!welcome.run_id().empty() && has_job()) job_.run_id = welcome.run_id();
}

bool UpstreamNode::SendBatch(v1::ManifestBatch batch) {
  if (batch.manifests_size() == 0) return false;
  if (stream_.batch_repeat && stream_.previous.RepeatedBy(batch)) {
    SendBatchRepeat(batch.manifests(0).step());
    return true;
  }
  v1::NodeMessage up;
  *up.mutable_manifests() = std::move(batch);
  SendNewBatch(std::move(up));
  return false;
}

void UpstreamNode::SendBatchRepeat(int64_t step) { Send(stream_.previous.RepeatAt(step)); }

void UpstreamNode::SendNewBatch(v1::NodeMessage batch) {
  stream_.previous.Record(batch.manifests());
  Send(std::move(batch));
}

}  // namespace accord::daemon
