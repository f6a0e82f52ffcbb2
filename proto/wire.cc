#include "proto/wire.h"

#include <algorithm>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace accord::wire {

std::string PackBits(const std::vector<bool>& bits) {
  std::string out((bits.size() + 7) / 8, '\0');
  for (size_t i = 0; i < bits.size(); ++i) {
    if (bits[i]) out[i / 8] = static_cast<char>(out[i / 8] | (1 << (i % 8)));
  }
  return out;
}

absl::StatusOr<std::vector<bool>> UnpackBits(const std::string& bytes, size_t n,
                                             absl::string_view what) {
  if (bytes.size() != (n + 7) / 8) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": bitset of ", bytes.size(),
                                                   " bytes for ", n, " entries (expected ",
                                                   (n + 7) / 8, " bytes)"));
  }
  if (n % 8 != 0 && !bytes.empty()) {
    const unsigned char last = static_cast<unsigned char>(bytes.back());
    if (last >> (n % 8)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": bits set past entry ", n, " in the bitset"));
    }
  }
  std::vector<bool> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = (static_cast<unsigned char>(bytes[i / 8]) >> (i % 8)) & 1;
  }
  return out;
}

std::string RankSetToBits(const RankSet& ranks) {
  std::string out((ranks.world_size() + 7) / 8, '\0');
  for (int r = 0; r < ranks.world_size(); ++r) {
    if (ranks.Contains(r)) out[r / 8] = static_cast<char>(out[r / 8] | (1 << (r % 8)));
  }
  return out;
}

absl::StatusOr<RankSet> RankSetFromBits(const std::string& bytes, int world_size,
                                        absl::string_view what) {
  absl::StatusOr<std::vector<bool>> bits = UnpackBits(bytes, world_size, what);
  if (!bits.ok()) return bits.status();
  RankSet set(world_size);
  for (int r = 0; r < world_size; ++r) {
    if ((*bits)[r]) set.Add(r);
  }
  return set;
}

absl::StatusOr<DType> DTypeFromProto(v1::DType d) {
  const int n = static_cast<int>(d);
  if (n >= 1 && n <= kNumDTypes) return static_cast<DType>(n);
  if (n >= v1::INT8 && n <= v1::COMPLEX128) {
    return WithKind(
        absl::InvalidArgumentError(absl::StrCat(
            "gradient dtype ", v1::DType_Name(d),
            " is not a float dtype; accord reduces float8_e4m3fn, float8_e5m2, float16, "
            "bfloat16, float32 and float64 gradients only")),
        v1::NON_FLOAT_DTYPE);
  }
  return DTypeFromNumber(n).status();
}

v1::DType DTypeToProto(DType d) { return static_cast<v1::DType>(static_cast<int>(d)); }

absl::StatusOr<Policy> PolicyFromProto(const v1::ReducePolicy& p) {
  Policy out;
  if (p.reduce_dtype() != v1::DTYPE_UNSPECIFIED) {
    absl::StatusOr<DType> d = DTypeFromProto(p.reduce_dtype());
    if (!d.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("reduce policy: ", d.status().message()));
    }
    out.reduce_dtype = *d;
  } else if (p.reduce_dtype_exact()) {
    return absl::InvalidArgumentError("reduce policy: reduce_dtype_exact without a reduce_dtype");
  }
  out.reduce_dtype_exact = p.reduce_dtype_exact();
  switch (p.fp8_tie()) {
    case v1::FP8_TIE_BREAK_UNSPECIFIED:
    case v1::FP8_TIE_BREAK_BFLOAT16:
      out.fp8_tie = Fp8TieBreak::kBFloat16;
      break;
    case v1::FP8_TIE_BREAK_FLOAT16:
      out.fp8_tie = Fp8TieBreak::kFloat16;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("reduce policy: unknown fp8 tie-break ", static_cast<int>(p.fp8_tie())));
  }
  return out;
}

v1::ReducePolicy PolicyToProto(const Policy& p) {
  v1::ReducePolicy out;
  if (p.reduce_dtype) out.set_reduce_dtype(DTypeToProto(*p.reduce_dtype));
  out.set_reduce_dtype_exact(p.reduce_dtype_exact);
  out.set_fp8_tie(p.fp8_tie == Fp8TieBreak::kFloat16 ? v1::FP8_TIE_BREAK_FLOAT16
                                                     : v1::FP8_TIE_BREAK_BFLOAT16);
  return out;
}

absl::StatusOr<std::shared_ptr<const MemberSet>> MembersFromProto(const v1::Members& m,
                                                                  int world_size) {
  absl::StatusOr<MemberSet> set = MemberSet::FromForm(MembersFormFromProto(m), world_size);
  if (!set.ok()) return WithKind(set.status(), v1::INVALID_REQUEST);
  return std::make_shared<const MemberSet>(*std::move(set));
}

MembersForm MembersFormFromProto(const v1::Members& m) {
  MembersForm form;
  form.start = m.start();
  form.count = m.count();
  form.stride = m.stride();
  form.ranks.assign(m.ranks().begin(), m.ranks().end());
  return form;
}

v1::Members MembersToProto(const MemberSet& members) {
  const MembersForm form = members.Form();
  v1::Members out;
  out.set_start(form.start);
  out.set_count(form.count);
  out.set_stride(form.stride);
  out.mutable_ranks()->Add(form.ranks.begin(), form.ranks.end());
  return out;
}

namespace {

// The registration's id and parameters, validated; members not read.
absl::StatusOr<GroupSpec> SpecWithoutMembers(const v1::GroupRegistration& r) {
  GroupSpec spec;
  spec.group_id = r.group_id();
  spec.params.reserve(r.params_size());
  for (const v1::ParamSpec& p : r.params()) {
    spec.params.push_back(ParamSpec{p.name(), p.dim0(), p.numel()});
  }
  if (absl::Status s = ValidateGroupSpec(spec); !s.ok()) return s;
  return spec;
}

}  // namespace

absl::StatusOr<GroupSpec> GroupSpecFromProto(const v1::GroupRegistration& r, int world_size) {
  absl::StatusOr<GroupSpec> spec = SpecWithoutMembers(r);
  if (!spec.ok() || !r.has_members()) return spec;
  absl::StatusOr<std::shared_ptr<const MemberSet>> members =
      MembersFromProto(r.members(), world_size);
  if (!members.ok()) {
    return KindError(v1::INVALID_REQUEST,
                     absl::StrCat("group \"", r.group_id(), "\": ", members.status().message()));
  }
  spec->members = *std::move(members);
  return spec;
}

absl::StatusOr<GroupSpec> GroupSpecFromProto(const v1::GroupRegistration& r) {
  if (r.has_members()) {
    return KindError(v1::INVALID_REQUEST,
                     absl::StrCat("group \"", r.group_id(),
                                  "\" has members, but this receiver takes groups of every "
                                  "rank only; upgrade it"));
  }
  return SpecWithoutMembers(r);
}

v1::GroupRegistration GroupSpecToProto(const GroupSpec& spec, const Policy& policy) {
  v1::GroupRegistration r;
  r.set_group_id(spec.group_id);
  for (const ParamSpec& p : spec.params) {
    v1::ParamSpec* out = r.add_params();
    out->set_name(p.name);
    out->set_dim0(p.dim0);
    out->set_numel(p.numel);
  }
  *r.mutable_policy() = PolicyToProto(policy);
  if (spec.members && !spec.members->AllRanks()) {
    *r.mutable_members() = MembersToProto(*spec.members);
  }
  return r;
}

absl::Status ManifestDTypesFromProto(const v1::Manifest& m, size_t num_params,
                                     std::vector<DTypeMask>* out) {
  out->resize(num_params);
  return ManifestDTypesFromProto(m, num_params, out->data());
}

absl::Status ManifestDTypesFromProto(const v1::Manifest& m, size_t num_params, DTypeMask* out) {
  // Messages are built only on the error paths: the common path allocates
  // nothing beyond `out`'s first use.
  auto where = [&] {
    return absl::StrCat("manifest for group \"", m.group_id(), "\" step ", m.step());
  };
  if (m.repeat()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where(), ": repeat form must be resolved against the sender's cache"));
  }
  if (m.step() < 0) return absl::InvalidArgumentError(absl::StrCat(where(), ": negative step"));
  const std::string& bits = m.used_bits();
  if (bits.size() != (num_params + 7) / 8) {
    return absl::InvalidArgumentError(absl::StrCat(where(), " used_bits: bitset of ", bits.size(),
                                                   " bytes for ", num_params, " entries (expected ",
                                                   (num_params + 7) / 8, " bytes)"));
  }
  if (num_params % 8 != 0 && !bits.empty() &&
      (static_cast<unsigned char>(bits.back()) >> (num_params % 8)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where(), " used_bits: bits set past entry ", num_params, " in the bitset"));
  }
  auto used = [&](size_t i) { return (static_cast<unsigned char>(bits[i / 8]) >> (i % 8)) & 1; };
  const bool uniform = m.uniform_dtype() != v1::DTYPE_UNSPECIFIED;
  const bool masks = !m.dtype_masks().empty();
  if (uniform && masks) {
    return absl::InvalidArgumentError(
        absl::StrCat(where(), ": both uniform_dtype and dtype_masks are set; send one"));
  }
  bool any_used = false;
  for (char c : bits) any_used |= c != 0;
  if (any_used && !uniform && !masks) {
    return absl::InvalidArgumentError(
        absl::StrCat(where(), ": parameters are used but no dtype is given"));
  }
  std::fill(out, out + num_params, DTypeMask{0});
  if (uniform) {
    absl::StatusOr<DType> d = DTypeFromProto(m.uniform_dtype());
    if (!d.ok()) {
      return WithKind(absl::InvalidArgumentError(absl::StrCat(where(), ": ", d.status().message())),
                      KindOf(d.status()));
    }
    const DTypeMask mask = MaskOf(*d);
    for (size_t i = 0; i < num_params; ++i) {
      out[i] = used(i) ? mask : DTypeMask{0};
    }
  } else if (masks) {
    if (m.dtype_masks().size() != num_params) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), ": ", m.dtype_masks().size(), " dtype entries for ", num_params, " parameters"));
    }
    for (size_t i = 0; i < num_params; ++i) {
      const DTypeMask mask = static_cast<DTypeMask>(m.dtype_masks()[i]);
      if ((mask & ~kValidDTypeMask) != 0) {
        return absl::InvalidArgumentError(absl::StrCat(where(), ": parameter ", i,
                                                       " has a non-float or unknown dtype (mask 0x",
                                                       absl::Hex(mask), ")"));
      }
      if ((mask != 0) != (used(i) != 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), ": parameter ", i,
                         used(i) ? " is used but has no dtype" : " is unused but has a dtype"));
      }
      out[i] = mask;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Manifest> ManifestFromProto(const v1::Manifest& m, size_t num_params, int world_size,
                                           int sender_rank) {
  auto where = [&] {
    return absl::StrCat("manifest for group \"", m.group_id(), "\" step ", m.step());
  };
  Manifest out;
  if (absl::Status s = ManifestDTypesFromProto(m, num_params, &out.dtypes); !s.ok()) return s;
  out.step = m.step();
  if (sender_rank >= 0) {
    if (!m.rank_bits().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": a rank's manifest must not carry rank_bits"));
    }
    if (sender_rank >= world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": rank ", sender_rank, " outside world size ", world_size));
    }
    out.ranks = RankSet(world_size);
    out.ranks.Add(sender_rank);
  } else {
    absl::StatusOr<RankSet> ranks =
        RankSetFromBits(m.rank_bits(), world_size, absl::StrCat(where(), " rank_bits"));
    if (!ranks.ok()) return ranks.status();
    if (ranks->Empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": speaks for no rank"));
    }
    out.ranks = *std::move(ranks);
  }
  return out;
}

void ManifestToProto(absl::string_view group_id, const Manifest& m, bool with_ranks,
                     v1::Manifest* out) {
  out->Clear();
  out->set_group_id(std::string(group_id));
  out->set_step(m.step);
  std::vector<bool> used(m.dtypes.size());
  DTypeMask all = 0;
  bool uniform = true;
  for (size_t i = 0; i < m.dtypes.size(); ++i) {
    used[i] = m.dtypes[i] != 0;
    if (m.dtypes[i] == 0) continue;
    if (all == 0) all = m.dtypes[i];
    if (m.dtypes[i] != all) uniform = false;
  }
  out->set_used_bits(PackBits(used));
  if (all != 0) {
    if (uniform && (all & (all - 1)) == 0) {
      for (DType d : kAllDTypes) {
        if (all == MaskOf(d)) out->set_uniform_dtype(DTypeToProto(d));
      }
    } else {
      std::string masks(m.dtypes.begin(), m.dtypes.end());
      out->set_dtype_masks(std::move(masks));
    }
  }
  if (with_ranks) out->set_rank_bits(RankSetToBits(m.ranks));
  out->set_cache_key(ManifestKey(m));
}

void DecisionToProto(const Decision& d, v1::DecisionOk* out) {
  out->set_wire_dtype(DTypeToProto(d.wire_dtype));
  out->set_included_bits(PackBits(d.included));
  out->set_layout_fingerprint(d.layout_fingerprint);
  int n = 0;
  for (bool b : d.included) n += b ? 1 : 0;
  out->set_num_included(n);
}

absl::StatusOr<Decision> DecisionFromProto(int64_t step, const v1::DecisionOk& ok,
                                           size_t num_params) {
  Decision d;
  d.step = step;
  absl::StatusOr<DType> wire = DTypeFromProto(ok.wire_dtype());
  if (!wire.ok())
    return absl::InvalidArgumentError(absl::StrCat("decision: ", wire.status().message()));
  d.wire_dtype = *wire;
  absl::StatusOr<std::vector<bool>> inc =
      UnpackBits(ok.included_bits(), num_params, "decision included_bits");
  if (!inc.ok()) return inc.status();
  d.included = *std::move(inc);
  d.layout_fingerprint = ok.layout_fingerprint();
  return d;
}

absl::Status WithKind(absl::Status status, v1::ErrorKind kind) {
  if (status.ok() || kind == v1::ERROR_KIND_UNSPECIFIED) return status;
  status.SetPayload(kErrorKindPayloadUrl, absl::Cord(absl::StrCat(static_cast<int>(kind))));
  return status;
}

v1::ErrorKind KindOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kErrorKindPayloadUrl);  // absl or std optional
  int n = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &n) ||
      !v1::ErrorKind_IsValid(n)) {
    return v1::ERROR_KIND_UNSPECIFIED;
  }
  return static_cast<v1::ErrorKind>(n);
}

absl::StatusCode CodeOfKind(v1::ErrorKind kind) {
  switch (kind) {
    case v1::REGISTRATION_MISMATCH:
      return absl::StatusCode::kFailedPrecondition;
    case v1::INVALID_MANIFEST:
      return absl::StatusCode::kInvalidArgument;
    case v1::NON_FLOAT_DTYPE:
      return absl::StatusCode::kInvalidArgument;
    case v1::UNKNOWN_GROUP:
      return absl::StatusCode::kNotFound;
    case v1::MISSING_RANKS:
      return absl::StatusCode::kDeadlineExceeded;
    case v1::STEP_REGRESSION:
      return absl::StatusCode::kFailedPrecondition;
    case v1::DUPLICATE_RANK:
      return absl::StatusCode::kAlreadyExists;
    case v1::JOB_FAILED:
      // A JOB_FAILED decision repeats the code of the failure that failed
      // the job; this is the code of one raised without such a failure.
      return absl::StatusCode::kAborted;
    case v1::PERMISSION_DENIED:
      return absl::StatusCode::kPermissionDenied;
    case v1::LIMIT_EXCEEDED:
      return absl::StatusCode::kResourceExhausted;
    case v1::UNAVAILABLE:
      return absl::StatusCode::kUnavailable;
    case v1::WORLD_SIZE_MISMATCH:
      return absl::StatusCode::kFailedPrecondition;
    case v1::INVALID_REQUEST:
      return absl::StatusCode::kInvalidArgument;
    case v1::RUN_ENDED:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kUnknown;
  }
}

absl::Status KindError(v1::ErrorKind kind, absl::string_view message) {
  return WithKind(absl::Status(CodeOfKind(kind), message), kind);
}

v1::DecisionError MakeError(v1::ErrorKind kind, const absl::Status& status) {
  v1::DecisionError e;
  e.set_kind(kind != v1::ERROR_KIND_UNSPECIFIED ? kind : KindOf(status));
  e.set_code(static_cast<int>(status.code()));
  e.set_message(std::string(status.message()));
  e.set_param_index(-1);
  return e;
}

absl::Status ErrorToStatus(const v1::DecisionError& e) {
  int code = e.code();
  if (code <= 0 || code > 16) code = static_cast<int>(absl::StatusCode::kUnknown);
  return WithKind(absl::Status(static_cast<absl::StatusCode>(code), e.message()), e.kind());
}

void BatchKeyHasher::Add(absl::string_view group_id, uint64_t cache_key) {
  hasher_.AddBytes(group_id);
  hasher_.AddU64(cache_key);
}

uint64_t BatchKeyHasher::Finish() const {
  const uint64_t key = hasher_.Finish();
  return key != 0 ? key : 1;
}

void StreamBatchRecord::Record(const v1::ManifestBatch& batch) {
  entries_.clear();
  BatchKeyHasher hasher;
  for (const v1::Manifest& m : batch.manifests()) {
    entries_.emplace_back(m.group_id(), m.cache_key());
    hasher.Add(m.group_id(), m.cache_key());
  }
  key_ = entries_.empty() ? 0 : hasher.Finish();
}

bool StreamBatchRecord::RepeatedBy(const v1::ManifestBatch& batch) const {
  const int n = batch.manifests_size();
  if (n == 0 || static_cast<size_t>(n) != entries_.size() || batch.repeat_batch_key() != 0) {
    return false;
  }
  const int64_t step = batch.manifests(0).step();
  for (int i = 0; i < n; ++i) {
    const v1::Manifest& m = batch.manifests(i);
    if (!m.repeat() || m.step() != step ||
        !Matches(static_cast<size_t>(i), m.group_id(), m.cache_key())) {
      return false;
    }
  }
  return true;
}

v1::ManifestBatch StreamBatchRecord::ExpandAt(int64_t step) const {
  v1::ManifestBatch batch;
  batch.mutable_manifests()->Reserve(static_cast<int>(entries_.size()));
  for (const auto& [group_id, cache_key] : entries_) {
    v1::Manifest* m = batch.add_manifests();
    m->set_group_id(group_id);
    m->set_step(step);
    m->set_repeat(true);
    m->set_cache_key(cache_key);
  }
  return batch;
}

v1::NodeMessage StreamBatchRecord::RepeatAt(int64_t step) const {
  v1::NodeMessage m;
  m.mutable_manifests()->set_repeat_step(step);
  m.mutable_manifests()->set_repeat_batch_key(key_);
  return m;
}

}  // namespace accord::wire
