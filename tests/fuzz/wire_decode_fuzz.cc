// Fuzz target: every message a sidecar or coordinator decodes from a socket.
// The input is a serialized RankMessage or NodeMessage (the first byte picks
// which); each registration, manifest and batch inside goes through the same
// validation the daemons apply (registrations with members also as a
// receiver that takes them decodes them). Nothing may crash, hang or trip a sanitizer;
// a message that decodes must re-encode to an equal core value.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "accord/v1/accord.pb.h"
#include "core/decide.h"
#include "proto/wire.h"

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

void DecodeManifests(const accord::v1::ManifestBatch& batch, size_t num_params, int world,
                     int sender_rank, const accord::GroupSpec* spec) {
  for (const accord::v1::Manifest& m : batch.manifests()) {
    if (m.repeat()) continue;
    absl::StatusOr<accord::Manifest> core =
        accord::wire::ManifestFromProto(m, num_params, world, sender_rank);
    if (!core.ok()) continue;
    Check(accord::ValidateManifest(*core, m.group_id(), num_params, world).ok());
    accord::v1::Manifest again;
    accord::wire::ManifestToProto(m.group_id(), *core, sender_rank < 0, &again);
    absl::StatusOr<accord::Manifest> back =
        accord::wire::ManifestFromProto(again, num_params, world, sender_rank);
    Check(back.ok() && *back == *core);
    const bool complete =
        spec != nullptr &&
        (spec->members ? core->ranks == spec->members->rank_set() : core->ranks.Full());
    if (complete) {
      absl::StatusOr<accord::Decision> d = accord::Decide(*spec, world, *core, accord::Policy{});
      if (d.ok()) {
        accord::v1::DecisionOk ok;
        accord::wire::DecisionToProto(*d, &ok);
        absl::StatusOr<accord::Decision> rt =
            accord::wire::DecisionFromProto(d->step, ok, num_params);
        Check(rt.ok() && *rt == *d);
      }
    }
  }
}

// A registration with members, as a receiver that takes them decodes it: a
// decoded spec re-encodes to the same spec and the same members form.
void DecodeMembers(const accord::v1::GroupRegistration& r, int world) {
  absl::StatusOr<accord::GroupSpec> s = accord::wire::GroupSpecFromProto(r, world);
  if (!s.ok()) return;
  Check(r.has_members() == (s->members != nullptr));
  if (s->members == nullptr) return;
  Check(!s->members->AllRanks() && s->members->world_size() == world);
  const accord::v1::GroupRegistration again = accord::wire::GroupSpecToProto(*s, accord::Policy{});
  absl::StatusOr<accord::GroupSpec> back = accord::wire::GroupSpecFromProto(again, world);
  Check(back.ok() && *back == *s);
  Check(accord::wire::MembersToProto(*back->members).SerializeAsString() ==
        again.members().SerializeAsString());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int selector = data[0];
  const int world = 1 + data[1] % 70;
  const std::string bytes(reinterpret_cast<const char*>(data + 2), size - 2);
  accord::GroupSpec spec_storage;
  const accord::GroupSpec* spec = nullptr;
  size_t num_params = 1 + (selector >> 2) % 40;
  if (selector & 1) {
    accord::v1::RankMessage msg;
    if (!msg.ParseFromString(bytes)) return 0;
    if (msg.has_registration()) {
      DecodeMembers(msg.registration(), world);
      absl::StatusOr<accord::GroupSpec> s = accord::wire::GroupSpecFromProto(msg.registration());
      (void)accord::wire::PolicyFromProto(msg.registration().policy());
      if (s.ok()) {
        Check(accord::ValidateGroupSpec(*s).ok());
        spec_storage = *s;
        spec = &spec_storage;
        num_params = s->params.size();
        absl::StatusOr<accord::Layout> layout = accord::ComputeLayout(
            *s, world, std::vector<bool>(num_params, true), accord::DType::kFloat32);
        Check(layout.ok());
      }
    }
    if (msg.has_manifests()) {
      DecodeManifests(msg.manifests(), num_params, world, (selector >> 1) % world, spec);
    }
  } else {
    accord::v1::NodeMessage msg;
    if (!msg.ParseFromString(bytes)) return 0;
    if (msg.has_registration()) {
      DecodeMembers(msg.registration().registration(), world);
      absl::StatusOr<accord::GroupSpec> s =
          accord::wire::GroupSpecFromProto(msg.registration().registration());
      if (s.ok()) {
        spec_storage = *s;
        spec = &spec_storage;
        num_params = s->params.size();
      }
    }
    if (msg.has_manifests()) DecodeManifests(msg.manifests(), num_params, world, -1, spec);
  }
  return 0;
}
