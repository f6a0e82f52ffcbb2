// NCCL backend with bounded waits (docs/GPU.md, "NCCL never hangs"): the
// communicator is non-blocking, and every wait (creation, each
// reduce-scatter, finalization) polls ncclCommGetAsyncError (and an event
// on the stream) against a deadline; on an error or at the deadline the
// communicator is aborted, which NCCL guarantees does not wait for peers.
#include "client/collective/nccl_collective.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

namespace accord {

struct NcclCollective::Comm {
  ncclComm_t comm = nullptr;
  cudaEvent_t done = nullptr;  // recorded after each reduce-scatter
};

namespace {

using Clock = std::chrono::steady_clock;

// The one place an ncclResult_t becomes a Status. Remote and system errors
// (a peer or the network) are UNAVAILABLE; the rest INTERNAL.
absl::Status NcclStatus(ncclResult_t r, ncclComm_t comm, const std::string& what) {
  const char* last = ncclGetLastError(comm);
  const std::string msg = absl::StrCat(what, ": ", ncclGetErrorString(r), " (NCCL says: \"",
                                       last != nullptr ? last : "", "\")");
  if (r == ncclRemoteError || r == ncclSystemError) {
    return absl::UnavailableError(
        absl::StrCat(msg,
                     "; a peer may have exited or be unreachable (check every rank's log and "
                     "NCCL_SOCKET_IFNAME)"));
  }
  return absl::InternalError(msg);
}

absl::Status CudaStatus(cudaError_t e, const std::string& what) {
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

// Backs off from spinning to short naps: a reduce-scatter usually completes
// within microseconds to milliseconds, a timeout is seconds.
void Backoff(int polls) {
  if (polls < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(polls < 1024 ? 20 : 200));
  }
}

// Polls until the communicator's pending work (and `event`, when given) has
// completed, NCCL reports an error, or `deadline` passes (DEADLINE_EXCEEDED).
absl::Status Poll(ncclComm_t comm, cudaEvent_t event, Clock::time_point deadline,
                  std::chrono::milliseconds timeout, const std::string& what) {
  for (int polls = 0;; ++polls) {
    ncclResult_t async = ncclSuccess;
    if (const ncclResult_t r = ncclCommGetAsyncError(comm, &async); r != ncclSuccess) {
      return NcclStatus(r, comm, absl::StrCat(what, ": ncclCommGetAsyncError"));
    }
    if (async != ncclSuccess && async != ncclInProgress) return NcclStatus(async, comm, what);
    if (async == ncclSuccess) {
      if (event == nullptr) return absl::OkStatus();
      const cudaError_t e = cudaEventQuery(event);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaStatus(e, absl::StrCat(what, ": cudaEventQuery"));
    }
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": not complete after ", timeout.count(),
          " ms (CollectiveOptions::timeout); a peer may have exited, hung or not issued the same "
          "collective; the communicator is aborted"));
    }
    Backoff(polls);
  }
}

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
  return absl::FailedPreconditionError(absl::StrCat("nccl: wire dtype ", DTypeName(d),
                                                    " needs NCCL >= 2.24 (built with ", NCCL_MAJOR,
                                                    ".", NCCL_MINOR, ")"));
}

// The device and library this communicator runs on (wire_policy.h).
absl::StatusOr<NcclRuntimeInfo> ReadRuntimeInfo(const std::string& what) {
  NcclRuntimeInfo info;
  if (const cudaError_t e = cudaGetDevice(&info.device); e != cudaSuccess) {
    return CudaStatus(e, absl::StrCat(what, ": cudaGetDevice (is a GPU visible?)"));
  }
  if (const cudaError_t e =
          cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, info.device);
      e != cudaSuccess) {
    return CudaStatus(e, absl::StrCat(what, ": reading the compute capability"));
  }
  if (const cudaError_t e =
          cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, info.device);
      e != cudaSuccess) {
    return CudaStatus(e, absl::StrCat(what, ": reading the compute capability"));
  }
  if (const ncclResult_t r = ncclGetVersion(&info.nccl_version); r != ncclSuccess) {
    return NcclStatus(r, nullptr, absl::StrCat(what, ": ncclGetVersion"));
  }
  info.built_with_fp8 = NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0);
  return info;
}

Fp8Options Fp8OptionsOf(const CollectiveOptions& options) {
  return {options.nccl_allow_saturating_fp8, options.nccl_widen_fp8_to};
}

// Resolves every wire dtype the caller declared (CollectiveOptions::wire_dtypes).
absl::Status CheckWireDTypesAtCreate(const NcclRuntimeInfo& info,
                                     const CollectiveOptions& options) {
  for (DType wire : options.wire_dtypes) {
    absl::StatusOr<DType> resolved =
        ResolveWireDType(Backend::kNccl, wire, info, Fp8OptionsOf(options));
    if (!resolved.ok()) {
      return absl::Status(resolved.status().code(), absl::StrCat("CollectiveOptions::wire_dtypes: ",
                                                                 resolved.status().message()));
    }
  }
  return absl::OkStatus();
}

// Rank 0: draws the communicator's unique id and publishes it under `key`.
// Write-once: an id already there is another rank 0 of this incarnation, or
// an incarnation reused after a restart.
absl::StatusOr<ncclUniqueId> PublishUniqueId(KeyValueStore& kv, const std::string& key,
                                             const std::string& what) {
  absl::StatusOr<std::vector<std::string>> existing = kv.Get({key}, std::chrono::milliseconds(0));
  if (existing.ok()) {
    return absl::AlreadyExistsError(absl::StrCat(
        what, ": a unique id is already published under \"", key,
        "\"; two ranks 0, or an incarnation reused by a restarted job (give each run a new "
        "CollectiveOptions::incarnation)"));
  }
  if (existing.status().code() != absl::StatusCode::kDeadlineExceeded &&
      existing.status().code() != absl::StatusCode::kNotFound) {
    return absl::Status(existing.status().code(),
                        absl::StrCat(what, ": checking \"", key,
                                     "\" before publishing: ", existing.status().message()));
  }
  ncclUniqueId id;
  if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return NcclStatus(r, nullptr, absl::StrCat(what, ": ncclGetUniqueId"));
  }
  if (absl::Status s = kv.Set(key, std::string(id.internal, sizeof id.internal)); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(what, ": publishing the unique id: ", s.message()));
  }
  return id;
}

// Another rank: waits until `deadline` for rank 0's unique id under `key`.
absl::StatusOr<ncclUniqueId> FetchUniqueId(KeyValueStore& kv, const std::string& key,
                                           const std::string& what, Clock::time_point deadline) {
  ncclUniqueId id;
  const auto left =
      std::max(std::chrono::milliseconds(0),
               std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  absl::StatusOr<std::vector<std::string>> v = kv.Get({key}, left);
  if (!v.ok()) {
    return absl::Status(v.status().code(),
                        absl::StrCat(what,
                                     ": waiting for rank 0's unique id (is rank 0 up, with the "
                                     "same key prefix and incarnation?): ",
                                     v.status().message()));
  }
  if ((*v)[0].size() != sizeof id.internal) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": unique id under \"", key, "\" has ",
                                                   (*v)[0].size(), " bytes, expected ",
                                                   sizeof id.internal));
  }
  std::memcpy(id.internal, (*v)[0].data(), sizeof id.internal);
  return id;
}

}  // namespace

NcclCollective::NcclCollective(int rank, int world_size, std::unique_ptr<Comm> comm,
                               NcclRuntimeInfo info, const CollectiveOptions& options)
    : rank_(rank),
      world_size_(world_size),
      comm_(std::move(comm)),
      info_(info),
      options_(options) {}

NcclCollective::~NcclCollective() {
  if (comm_->comm != nullptr) {
    // Finalize flushes outstanding work and can wait for peers: bounded like
    // everything else; abort when it fails or times out.
    const ncclResult_t r = ncclCommFinalize(comm_->comm);
    const bool finalized =
        (r == ncclSuccess || r == ncclInProgress) &&
        Poll(comm_->comm, nullptr, Clock::now() + options_.timeout, options_.timeout, "finalize")
            .ok();
    if (finalized) {
      ncclCommDestroy(comm_->comm);
    } else {
      ncclCommAbort(comm_->comm);
    }
  }
  if (comm_->done != nullptr) cudaEventDestroy(comm_->done);
}

absl::Status NcclCollective::Abort(absl::Status error) {
  if (comm_->comm != nullptr) {
    ncclCommAbort(comm_->comm);
    comm_->comm = nullptr;
  }
  state_ = State::kAborted;
  abort_reason_ = error;
  return error;
}

absl::StatusOr<std::unique_ptr<Collective>> NcclCollective::Create(
    int rank, int world_size, KeyValueStore& kv, std::string key_prefix,
    const CollectiveOptions& options) {
  const Clock::time_point deadline = Clock::now() + options.timeout;
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl: rank ", rank, " is not within world size ", world_size));
  }
  if (options.incarnation.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl: rank ", rank, " under \"", key_prefix,
        "\": CollectiveOptions::incarnation is empty; pass the run's id (the same on every rank, "
        "new after each restart) so that no rank reads a previous run's unique id"));
  }
  const std::string key = absl::StrCat(key_prefix, "/", options.incarnation, "/nccl_unique_id");
  const std::string what = absl::StrCat("nccl: rank ", rank, " of ", world_size, " under \"",
                                        key_prefix, "\" incarnation \"", options.incarnation, "\"");
  absl::StatusOr<NcclRuntimeInfo> info = ReadRuntimeInfo(what);
  if (!info.ok()) return info.status();
  // Refused wire dtypes fail here, before the rendezvous, not at the first
  // reduce-scatter (docs/GPU.md, "fp8").
  if (absl::Status s = CheckWireDTypesAtCreate(*info, options); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  }

  absl::StatusOr<ncclUniqueId> id =
      rank == 0 ? PublishUniqueId(kv, key, what) : FetchUniqueId(kv, key, what, deadline);
  if (!id.ok()) return id.status();

  auto comm = std::make_unique<Comm>();
  if (const cudaError_t e = cudaEventCreateWithFlags(&comm->done, cudaEventDisableTiming);
      e != cudaSuccess) {
    return CudaStatus(e, absl::StrCat(what, ": cudaEventCreateWithFlags"));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = ncclCommInitRankConfig(&comm->comm, world_size, *id, rank, &config);
  absl::Status init;
  if (r != ncclSuccess && r != ncclInProgress) {
    init = NcclStatus(r, comm->comm, absl::StrCat(what, ": ncclCommInitRankConfig"));
  } else {
    init = Poll(comm->comm, nullptr, deadline, options.timeout,
                absl::StrCat(what,
                             ": creating the communicator (ncclCommInitRankConfig; every "
                             "rank must join within the timeout)"));
  }
  if (!init.ok()) {
    if (comm->comm != nullptr) ncclCommAbort(comm->comm);
    cudaEventDestroy(comm->done);
    return init;
  }
  return std::unique_ptr<Collective>(
      new NcclCollective(rank, world_size, std::move(comm), *info, options));
}

absl::Status NcclCollective::CheckWireDType(DType wire) const {
  return NcclWireDTypeStatus(wire, info_, options_.nccl_allow_saturating_fp8);
}

absl::StatusOr<DType> NcclCollective::WireDTypeFor(DType wire) const {
  return ResolveWireDType(Backend::kNccl, wire, info_, Fp8OptionsOf(options_));
}

absl::Status NcclCollective::ReduceScatterSum(const void* in, void* out, int64_t row_numel,
                                              DType wire, void* stream) {
  const int64_t op = ops_++;
  const std::string what =
      absl::StrCat("nccl reduce-scatter #", op, " on rank ", rank_, " of ", world_size_, " (",
                   row_numel, " elements of ", DTypeName(wire), " per rank)");
  if (state_ == State::kAborted) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the communicator was aborted after an earlier error (",
                     abort_reason_.message(), "); create a new one with a new incarnation"));
  }
  if (absl::Status s = CheckWireDType(wire); !s.ok()) return s;
  absl::StatusOr<ncclDataType_t> type = NcclType(wire);
  if (!type.ok()) return type.status();
  if (row_numel < 0 || (row_numel > 0 && (in == nullptr || out == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": row_numel ", row_numel, " with in=", in != nullptr, " out=", out != nullptr));
  }
  if (row_numel == 0) return absl::OkStatus();
  const auto s = static_cast<cudaStream_t>(stream);
  const Clock::time_point deadline = Clock::now() + options_.timeout;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (const cudaError_t e = cudaStreamIsCapturing(s, &capture); e != cudaSuccess) {
    return CudaStatus(e, absl::StrCat(what, ": cudaStreamIsCapturing"));
  }
  const ncclResult_t r =
      ncclReduceScatter(in, out, static_cast<size_t>(row_numel), *type, ncclSum, comm_->comm, s);
  if (r != ncclSuccess && r != ncclInProgress) {
    return Abort(NcclStatus(r, comm_->comm, absl::StrCat(what, ": ncclReduceScatter")));
  }
  // Non-blocking communicator: ncclInProgress means the enqueue finishes in
  // the background; nothing may be added to the stream before it has.
  if (r == ncclInProgress) {
    if (absl::Status p = Poll(comm_->comm, nullptr, deadline, options_.timeout,
                              absl::StrCat(what, ": enqueueing"));
        !p.ok()) {
      return Abort(std::move(p));
    }
  }
  // While capturing, the collective runs at the graph's replay and a captured
  // event cannot be queried: the enqueue is all there is to wait for.
  if (capture != cudaStreamCaptureStatusNone) return absl::OkStatus();
  if (const cudaError_t e = cudaEventRecord(comm_->done, s); e != cudaSuccess) {
    return Abort(CudaStatus(e, absl::StrCat(what, ": cudaEventRecord")));
  }
  if (absl::Status p = Poll(comm_->comm, comm_->done, deadline, options_.timeout, what); !p.ok()) {
    return Abort(std::move(p));
  }
  return absl::OkStatus();
}

}  // namespace accord
