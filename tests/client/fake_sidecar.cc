#include "tests/client/fake_sidecar.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "core/manifest.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "proto/wire.h"

namespace accord::testing {

FakeSidecar::FakeSidecar(int world_size) : world_size_(world_size) {}

FakeSidecar::~FakeSidecar() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now());
  // The sessions are over; clear their state under the lock so the handoff
  // from the server's threads is visible (also to ThreadSanitizer, which
  // cannot see the synchronisation inside gRPC's shutdown).
  accord::MutexLock lock(&mu_);
  conns_.clear();
  received_.clear();
  groups_.clear();
  kv_.clear();
  reject_hello_.reset();
  mutate_ = nullptr;
  if (!socket_path_.empty()) unlink(socket_path_.c_str());
  if (!dir_.empty()) rmdir(dir_.c_str());
}

void FakeSidecar::Start() {
  char tmpl[] = "/tmp/accord-fake-XXXXXX";
  dir_ = mkdtemp(tmpl);
  socket_path_ = dir_ + "/sidecar.sock";
  grpc::ServerBuilder b;
  b.AddListeningPort("unix:" + socket_path_, grpc::InsecureServerCredentials());
  b.RegisterService(static_cast<v1::RankService::Service*>(this));
  b.RegisterService(static_cast<v1::KeyValueService::Service*>(this));
  server_ = b.BuildAndStart();
}

void FakeSidecar::RejectHellos(v1::DecisionError error) {
  accord::MutexLock lock(&mu_);
  reject_hello_ = std::move(error);
}

void FakeSidecar::MutateDecisions(std::function<void(v1::Decision*)> f) {
  accord::MutexLock lock(&mu_);
  mutate_ = std::move(f);
}

void FakeSidecar::DropSessions() {
  accord::MutexLock lock(&mu_);
  for (Conn* c : conns_) c->ctx->TryCancel();
}

void FakeSidecar::CloseSessions() {
  accord::MutexLock lock(&mu_);
  close_all_ = true;
  for (Conn* c : conns_) c->ctx->TryCancel();
}

void FakeSidecar::SendErrorToAll(const v1::DecisionError& e) {
  accord::MutexLock lock(&mu_);
  v1::RankReply r;
  *r.mutable_error() = e;
  Broadcast(r);
}

void FakeSidecar::TakeMembers() {
  accord::MutexLock lock(&mu_);
  members_ = true;
}

void FakeSidecar::SendToMembers(const GroupState& g, const v1::RankReply& r) {
  for (Conn* c : conns_) {
    if (c->rank >= 0 && (g.spec.members == nullptr || g.spec.members->Contains(c->rank))) {
      Write(c, r);
    }
  }
}

std::vector<v1::RankMessage> FakeSidecar::Received() const {
  accord::MutexLock lock(&mu_);
  return received_;
}

int FakeSidecar::sessions_started() const {
  accord::MutexLock lock(&mu_);
  return sessions_started_;
}

void FakeSidecar::Write(Conn* c, const v1::RankReply& r) {
  accord::MutexLock lock(&c->write_mu);
  c->stream->Write(r);
}

void FakeSidecar::Broadcast(const v1::RankReply& r) {
  for (Conn* c : conns_) {
    if (c->rank >= 0) Write(c, r);
  }
}

grpc::Status FakeSidecar::Session(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::RankReply, v1::RankMessage>* stream) {
  Conn conn;
  conn.stream = stream;
  conn.ctx = ctx;
  {
    accord::MutexLock lock(&mu_);
    ++sessions_started_;
    if (close_all_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake sidecar closing");
    conns_.push_back(&conn);
  }
  v1::RankMessage msg;
  while (stream->Read(&msg)) {
    accord::MutexLock lock(&mu_);
    received_.push_back(msg);
    switch (msg.body_case()) {
      case v1::RankMessage::kHello: {
        v1::RankReply r;
        if (reject_hello_) {
          *r.mutable_error() = *reject_hello_;
          Write(&conn, r);
          break;
        }
        conn.rank = msg.hello().rank();
        r.mutable_welcome()->set_node_id("fake-node");
        r.mutable_welcome()->set_node_epoch(kFakeNodeEpoch);
        r.mutable_welcome()->set_members(members_);
        Write(&conn, r);
        break;
      }
      case v1::RankMessage::kRegistration:
        OnRegistration(&conn, msg.registration());
        break;
      case v1::RankMessage::kManifests: {
        // Decisions go out per group, to its members.
        for (const v1::Manifest& m : msg.manifests().manifests()) {
          v1::DecisionBatch out;
          OnManifest(&conn, m, &out);
          if (out.decisions_size() == 0) continue;
          v1::RankReply r;
          *r.mutable_decisions() = out;
          SendToMembers(groups_[m.group_id()], r);
        }
        break;
      }
      case v1::RankMessage::kAdapterCounts:  // recorded in received_ only
      case v1::RankMessage::BODY_NOT_SET:
        break;
    }
  }
  accord::MutexLock lock(&mu_);
  conns_.erase(std::find(conns_.begin(), conns_.end(), &conn));
  return grpc::Status::OK;
}

void FakeSidecar::OnRegistration(Conn* c, const v1::GroupRegistration& r) {
  absl::StatusOr<GroupSpec> spec =
      members_ ? wire::GroupSpecFromProto(r, world_size_) : wire::GroupSpecFromProto(r);
  absl::StatusOr<Policy> policy = wire::PolicyFromProto(r.policy());
  if (!spec.ok() || !policy.ok()) {
    v1::RankReply reply;
    reply.mutable_registration()->set_group_id(r.group_id());
    *reply.mutable_registration()->mutable_error() =
        wire::MakeError(v1::INVALID_MANIFEST, spec.ok() ? policy.status() : spec.status());
    Write(c, reply);
    return;
  }
  GroupState& g = groups_[r.group_id()];
  if (g.registered.empty()) {
    g.spec = *spec;
    g.policy = *policy;
  }
  g.registered.push_back(c->rank);
  const int needed = LayoutWorld(g.spec, world_size_);
  if (static_cast<int>(g.registered.size()) < needed) return;
  // Every member registered: answer them all at once.
  v1::RankReply reply;
  v1::RegistrationResult* res = reply.mutable_registration();
  res->set_group_id(r.group_id());
  res->set_spec_fingerprint(SpecFingerprint(g.spec));
  SendToMembers(g, reply);
}

void FakeSidecar::OnManifest(Conn* c, const v1::Manifest& m, v1::DecisionBatch* out) {
  auto it = groups_.find(m.group_id());
  if (it == groups_.end()) return;
  GroupState& g = it->second;
  if (auto done = g.decided.find(m.step()); done != g.decided.end()) {
    v1::RankReply again;
    *again.mutable_decisions()->add_decisions() = done->second;
    Write(c, again);
    return;
  }
  Manifest rank_m;
  if (m.repeat()) {
    rank_m = RankManifest(m.step(), c->rank, world_size_, {});
    rank_m.dtypes = g.last_content[c->rank];
  } else {
    absl::StatusOr<Manifest> parsed =
        wire::ManifestFromProto(m, g.spec.params.size(), world_size_, c->rank);
    if (!parsed.ok()) return;
    rank_m = *parsed;
    g.last_content[c->rank] = rank_m.dtypes;
  }
  auto [slot, fresh] = g.merged.try_emplace(m.step(), rank_m);
  if (!fresh) (void)Merge(slot->second, rank_m);
  const bool complete =
      g.spec.members ? slot->second.ranks == g.spec.members->rank_set() : slot->second.ranks.Full();
  if (!complete) return;
  absl::StatusOr<Decision> d = Decide(g.spec, world_size_, slot->second, g.policy);
  g.merged.erase(slot);
  v1::Decision* pd = out->add_decisions();
  pd->set_group_id(m.group_id());
  pd->set_step(m.step());
  if (!d.ok()) {
    *pd->mutable_error() = wire::MakeError(v1::INVALID_MANIFEST, d.status());
    g.decided[m.step()] = *pd;
  } else {
    v1::Decision& full = g.decided[m.step()];
    full = *pd;
    wire::DecisionToProto(*d, full.mutable_ok());
    if (mutate_) mutate_(&full);
    Decision cmp = *d;
    if (g.last) cmp.step = g.last->step;
    if (g.last && cmp == *g.last) {
      pd->set_same_as_previous(true);
    } else {
      wire::DecisionToProto(*d, pd->mutable_ok());
    }
    g.last = *d;
  }
  if (mutate_) mutate_(pd);
}

grpc::Status FakeSidecar::Set(grpc::ServerContext*, const v1::KeyValueSetRequest* req,
                              v1::KeyValueSetResponse*) {
  accord::MutexLock lock(&mu_);
  kv_[req->job_id() + "/" + req->key()] = req->value();
  return grpc::Status::OK;
}

grpc::Status FakeSidecar::Get(grpc::ServerContext*, const v1::KeyValueGetRequest* req,
                              v1::KeyValueGetResponse* resp) {
  accord::MutexLock lock(&mu_);
  for (const std::string& k : req->keys()) {
    auto it = kv_.find(req->job_id() + "/" + k);
    if (it == kv_.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("key \"", k, "\" not set"));
    }
    resp->add_values(it->second);
  }
  return grpc::Status::OK;
}

}  // namespace accord::testing
