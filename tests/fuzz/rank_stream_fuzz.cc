// Fuzz target: the sidecar's handling of rank streams. The input is a script
// of events for one Sidecar (no gRPC): up to four rank sessions open and
// close, send RankMessages (built from the bytes, or raw protobuf bytes that
// may not parse), and the coordinator side sends CoordinatorMessages or
// reconnects. Fake sinks record what the sidecar emits, and a session whose
// sink was closed is closed in the Sidecar as the gRPC reactor would.
//
// Besides the sanitizers' checks, the target asserts what the protocol
// relies on: every reply and upstream message has a body; a rank sink gets
// nothing after Close; a decision a rank receives names a group it
// registered; upstream manifests in full form decode for their group's
// registered size.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "accord/v1/accord.pb.h"
#include "daemon/sidecar/sidecar.h"
#include "proto/wire.h"

namespace {

using accord::daemon::Sidecar;

void Check(bool ok) {
  if (!ok) std::abort();
}

class Reader {
 public:
  Reader(const uint8_t* d, size_t n) : d_(d), n_(n) {}
  bool done() const { return i_ >= n_; }
  uint8_t Byte() { return i_ < n_ ? d_[i_++] : 0; }
  uint16_t U16() { return static_cast<uint16_t>(Byte() | (Byte() << 8)); }
  std::string Bytes(size_t n) {
    n = std::min(n, n_ - std::min(i_, n_));
    std::string s(reinterpret_cast<const char*>(d_ + i_), n);
    i_ += n;
    return s;
  }

 private:
  const uint8_t* d_;
  size_t n_;
  size_t i_ = 0;
};

constexpr int kSessions = 4;
constexpr int kGroups = 3;
// Parameter count of group gK in the structured messages.
int ParamsOf(int g) { return 1 + g; }

class FakeRankSink : public accord::daemon::RankSink {
 public:
  void Send(std::shared_ptr<const accord::v1::RankReply> reply) override {
    Check(!closed);  // nothing after Close
    Check(reply != nullptr && reply->body_case() != accord::v1::RankReply::BODY_NOT_SET);
    replies.push_back(*reply);
  }
  void Close(const absl::Status& status) override {
    Check(!status.ok());  // the sidecar closes a rank only with an error
    closed = true;
  }
  std::vector<accord::v1::RankReply> replies;
  bool closed = false;
};

class FakeUpstream : public accord::daemon::UpstreamSink {
 public:
  void Send(accord::v1::NodeMessage m) override { Observe(m); }
  void Reset(std::vector<accord::v1::NodeMessage> ms) override {
    for (const auto& m : ms) Observe(m);
  }
  void Reconnect() override { ++reconnects; }
  void Observe(const accord::v1::NodeMessage& m) {
    Check(m.body_case() != accord::v1::NodeMessage::BODY_NOT_SET);
    ++messages;
    // The job's world is the one the node hello announces: a rank's hello may
    // name world + 1, and partial manifests' rank bits are sized by it.
    if (m.has_hello()) world = m.hello().world_size();
    if (m.has_registration()) {
      registered[m.registration().registration().group_id()].insert(
          m.registration().registration().params_size());
    }
    for (const accord::v1::Manifest& x : m.manifests().manifests()) {
      if (x.repeat()) continue;
      auto it = registered.find(x.group_id());
      Check(it != registered.end());  // a group is announced before its manifests
      // Without rank_bits a node manifest speaks for all of the node's ranks.
      const int sender = x.rank_bits().empty() ? 0 : -1;
      bool decodes = false;
      for (int n : it->second) {
        decodes = decodes || accord::wire::ManifestFromProto(x, n, world, sender).ok();
      }
      Check(decodes);
    }
  }
  // Group -> parameter counts of the registrations sent for it.
  std::map<std::string, std::set<int>> registered;
  int world = 0;
  int64_t messages = 0;
  int reconnects = 0;
};

std::optional<accord::DType> DTypeFrom(uint8_t b) {
  switch (b % 6) {
    case 0:
      return std::nullopt;
    case 1:
      return accord::DType::kFloat32;
    case 2:
      return accord::DType::kBFloat16;
    case 3:
      return accord::DType::kFloat16;
    case 4:
      return accord::DType::kFloat64;
    default:
      return static_cast<accord::DType>(b >> 3);  // any value, also invalid ones
  }
}

// A RankMessage built from a few bytes: hello, registration or manifests.
accord::v1::RankMessage StructuredRankMessage(Reader& in, int world) {
  accord::v1::RankMessage m;
  const uint8_t kind = in.Byte();
  switch (kind % 4) {
    case 0: {
      accord::v1::RankHello* h = m.mutable_hello();
      h->set_job_id((kind & 0x80) ? "j2" : "j");
      h->set_rank(static_cast<int8_t>(in.Byte()) % 6);
      h->set_world_size((kind & 0x40) ? world + 1 : world);
      break;
    }
    case 1: {
      const int g = in.Byte() % kGroups;
      accord::GroupSpec spec;
      spec.group_id = absl::StrCat("g", g);
      for (int i = 0; i < ParamsOf(g); ++i) {
        const int64_t dim0 = 1 + in.Byte() % 4;
        spec.params.push_back({absl::StrCat("p", i), dim0, dim0 * (1 + (kind >> 6))});
      }
      *m.mutable_registration() = accord::wire::GroupSpecToProto(spec, accord::Policy());
      break;
    }
    default: {
      const int n = 1 + in.Byte() % 3;
      for (int k = 0; k < n; ++k) {
        const int g = in.Byte() % kGroups;
        const int64_t step = static_cast<int8_t>(in.Byte());
        const uint8_t flags = in.Byte();
        accord::v1::Manifest* pm = m.mutable_manifests()->add_manifests();
        if (flags & 1) {
          pm->set_group_id(absl::StrCat("g", g));
          pm->set_step(step);
          pm->set_repeat(true);
          pm->set_cache_key(in.Byte() | (static_cast<uint64_t>(in.Byte()) << 40));
          continue;
        }
        std::vector<std::optional<accord::DType>> d;
        const int params = (flags & 2) ? ParamsOf(g) + 1 : ParamsOf(g);
        for (int i = 0; i < params; ++i) d.push_back(DTypeFrom(in.Byte()));
        accord::wire::ManifestToProto(absl::StrCat("g", g),
                                      accord::RankManifest(step, 0, std::max(world, 1), d),
                                      /*with_ranks=*/false, pm);
        if (flags & 4) pm->set_cache_key(0);
      }
      break;
    }
  }
  return m;
}

// A CoordinatorMessage built from a few bytes: decisions (ok, same as
// previous, error), registration results or a job error.
accord::v1::CoordinatorMessage StructuredCoordinatorMessage(Reader& in) {
  accord::v1::CoordinatorMessage m;
  const uint8_t kind = in.Byte();
  const int g = in.Byte() % kGroups;
  const std::string gid = absl::StrCat("g", g);
  switch (kind % 4) {
    case 0: {
      m.mutable_registration()->set_group_id(gid);
      if (kind & 0x10) {
        *m.mutable_registration()->mutable_error() = accord::wire::MakeError(
            accord::v1::REGISTRATION_MISMATCH, absl::FailedPreconditionError("mismatch"));
      } else {
        m.mutable_registration()->set_spec_fingerprint(in.Byte() + 1);
      }
      break;
    }
    case 1: {
      auto e = accord::wire::MakeError(
          (kind & 0x10) ? accord::v1::DUPLICATE_RANK : accord::v1::MISSING_RANKS,
          absl::DeadlineExceededError("job failed"));
      if (kind & 0x20) e.add_ranks(in.Byte() % 6);
      *m.mutable_error() = e;
      break;
    }
    default: {
      const int n = 1 + in.Byte() % 3;
      for (int k = 0; k < n; ++k) {
        accord::v1::Decision* d = m.mutable_decisions()->add_decisions();
        d->set_group_id(absl::StrCat("g", in.Byte() % kGroups));
        d->set_step(static_cast<int8_t>(in.Byte()));
        const uint8_t how = in.Byte();
        if (how % 4 == 0) {
          d->set_same_as_previous(true);
        } else if (how % 4 == 1) {
          // The sidecar resends the step in full form on this error.
          *d->mutable_error() = accord::wire::MakeError(
              accord::v1::INVALID_MANIFEST,
              absl::FailedPreconditionError("unknown key; resend this step in full form"));
        } else if (how % 4 == 2) {
          *d->mutable_error() = accord::wire::MakeError(accord::v1::MISSING_RANKS,
                                                        absl::DeadlineExceededError("missing"));
        } else {
          d->mutable_ok()->set_wire_dtype(accord::v1::FLOAT32);
          d->mutable_ok()->set_included_bits(std::string(1, static_cast<char>(how)));
          d->mutable_ok()->set_layout_fingerprint(how);
        }
      }
      break;
    }
  }
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in(data, size);
  const int world = 1 + in.Byte() % 5;
  accord::daemon::SidecarOptions options;
  options.node_id = "n0";
  options.max_ranks = 1 + in.Byte() % 4;
  options.start_timer_thread = false;  // one thread per input would dominate
  FakeUpstream up;
  up.world = world;
  Sidecar sidecar(options);
  sidecar.SetUpstream(&up);

  std::array<std::unique_ptr<FakeRankSink>, kSessions> sinks;
  std::array<std::optional<Sidecar::SessionId>, kSessions> ids;
  // Ranks each open session registered a group for (for the decision check).
  std::array<std::set<std::string>, kSessions> registered;
  std::array<size_t, kSessions> checked{};

  auto close = [&](int s) {
    if (!ids[s]) return;
    sidecar.CloseRank(*ids[s]);
    ids[s].reset();
    sinks[s].reset();
    registered[s].clear();
    checked[s] = 0;
  };
  for (int ops = 0; !in.done() && ops < 256; ++ops) {
    const uint8_t op = in.Byte();
    const int s = (op >> 4) % kSessions;
    switch (op % 8) {
      case 0:
        if (!ids[s]) {
          sinks[s] = std::make_unique<FakeRankSink>();
          ids[s] = sidecar.OpenRank(sinks[s].get());
        }
        break;
      case 1:
        close(s);
        break;
      case 2:
      case 3:
      case 4: {
        if (!ids[s]) break;
        accord::v1::RankMessage m = StructuredRankMessage(in, world);
        if (m.has_registration()) registered[s].insert(m.registration().group_id());
        sidecar.HandleRankMessage(*ids[s], m);
        break;
      }
      case 5: {
        if (!ids[s]) break;
        accord::v1::RankMessage m;
        if (m.ParseFromString(in.Bytes(in.Byte()))) {
          if (m.has_registration()) registered[s].insert(m.registration().group_id());
          sidecar.HandleRankMessage(*ids[s], m);
        }
        break;
      }
      case 6:
        sidecar.HandleCoordinatorMessage(StructuredCoordinatorMessage(in));
        break;
      default:
        if (op & 0x80) {
          accord::v1::CoordinatorMessage m;
          if (m.ParseFromString(in.Bytes(in.Byte()))) sidecar.HandleCoordinatorMessage(m);
        } else {
          sidecar.OnUpstreamConnected();
        }
        break;
    }
    // What each rank received since the last look.
    for (int k = 0; k < kSessions; ++k) {
      if (!sinks[k]) continue;
      for (; checked[k] < sinks[k]->replies.size(); ++checked[k]) {
        for (const auto& d : sinks[k]->replies[checked[k]].decisions().decisions()) {
          // A decision (not a per-manifest error about an unknown group)
          // reaches only a rank that registered its group.
          if (!d.has_error()) Check(registered[k].count(d.group_id()) > 0);
        }
      }
      if (sinks[k]->closed) close(k);  // the reactor ends the stream
    }
  }
  accord::daemon::SidecarStats stats = sidecar.stats();
  Check(stats.ranks >= 0 && stats.ranks <= options.max_ranks);
  for (int k = 0; k < kSessions; ++k) close(k);
  Check(sidecar.stats().ranks == 0);
  return 0;
}
