#include "client/collective/nccl_collective.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>

#include "absl/strings/str_cat.h"

// Wraps one NCCL call: returns INTERNAL (UNAVAILABLE for remote/system
// errors) naming the call, NCCL's error string and last message.
#define ACCORD_NCCL_RETURN_IF_ERROR(expr, what)                                                    \
  do {                                                                                             \
    const ncclResult_t accord_nccl_res_ = (expr);                                                  \
    if (accord_nccl_res_ != ncclSuccess) {                                                         \
      const bool accord_nccl_remote_ =                                                             \
          accord_nccl_res_ == ncclRemoteError || accord_nccl_res_ == ncclSystemError;              \
      const std::string accord_nccl_msg_ =                                                         \
          absl::StrCat(what, ": ", #expr, " failed: ", ncclGetErrorString(accord_nccl_res_), " (", \
                       ncclGetLastError(nullptr), ")");                                            \
      return accord_nccl_remote_ ? absl::UnavailableError(accord_nccl_msg_)                        \
                                 : absl::InternalError(accord_nccl_msg_);                          \
    }                                                                                              \
  } while (0)

namespace accord {

struct NcclCollective::Comm {
  ncclComm_t comm = nullptr;
};

namespace {

absl::StatusOr<ncclDataType_t> NcclType(DType d) {
  switch (d) {
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0)
    case DType::kFloat8E4M3FN:
      return ncclFloat8e4m3;
    case DType::kFloat8E5M2:
      return ncclFloat8e5m2;
#endif
    default:
      break;
  }
  return absl::UnimplementedError(absl::StrCat("nccl: wire dtype ", DTypeName(d),
                                               " needs NCCL >= 2.24 (built with ", NCCL_MAJOR, ".",
                                               NCCL_MINOR, ")"));
}

}  // namespace

NcclCollective::NcclCollective(int rank, int world_size, std::unique_ptr<Comm> comm)
    : rank_(rank), world_size_(world_size), comm_(std::move(comm)) {}

NcclCollective::~NcclCollective() {
  if (comm_ && comm_->comm != nullptr) ncclCommDestroy(comm_->comm);
}

absl::StatusOr<std::unique_ptr<Collective>> NcclCollective::Create(
    int rank, int world_size, KeyValueStore& kv, std::string key_prefix,
    const CollectiveOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl: rank ", rank, " is not within world size ", world_size));
  }
  const std::string key = absl::StrCat(key_prefix, "/nccl_unique_id");
  const std::string what =
      absl::StrCat("nccl: rank ", rank, " of ", world_size, " under \"", key_prefix, "\"");
  ncclUniqueId id;
  if (rank == 0) {
    ACCORD_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id), what);
    if (absl::Status s = kv.Set(key, std::string(id.internal, sizeof id.internal)); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(what, ": publishing the unique id: ", s.message()));
    }
  } else {
    absl::StatusOr<std::vector<std::string>> v = kv.Get({key}, options.timeout);
    if (!v.ok()) {
      return absl::Status(v.status().code(),
                          absl::StrCat(what,
                                       ": waiting for rank 0's unique id (is rank 0 up "
                                       "and using the same key prefix?): ",
                                       v.status().message()));
    }
    if ((*v)[0].size() != sizeof id.internal) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": unique id under \"", key, "\" has ",
                                                     (*v)[0].size(), " bytes, expected ",
                                                     sizeof id.internal));
    }
    std::memcpy(id.internal, (*v)[0].data(), sizeof id.internal);
  }
  auto comm = std::make_unique<Comm>();
  ACCORD_NCCL_RETURN_IF_ERROR(ncclCommInitRank(&comm->comm, world_size, id, rank), what);
  return std::unique_ptr<Collective>(new NcclCollective(rank, world_size, std::move(comm)));
}

absl::Status NcclCollective::ReduceScatterSum(const void* in, void* out, int64_t row_numel,
                                              DType wire, void* stream) {
  if (row_numel < 0) {
    return absl::InvalidArgumentError(absl::StrCat("nccl: row_numel ", row_numel));
  }
  absl::StatusOr<ncclDataType_t> type = NcclType(wire);
  if (!type.ok()) return type.status();
  ACCORD_NCCL_RETURN_IF_ERROR(
      ncclReduceScatter(in, out, static_cast<size_t>(row_numel), *type, ncclSum, comm_->comm,
                        static_cast<cudaStream_t>(stream)),
      absl::StrCat("nccl reduce-scatter on rank ", rank_, " of ", world_size_, " (", row_numel,
                   " elements of ", DTypeName(wire), " per rank)"));
  return absl::OkStatus();
}

}  // namespace accord
