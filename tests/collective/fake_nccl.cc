#include "tests/collective/fake_nccl.h"

#include <cuda_runtime_api.h>

#include <cstring>

namespace accord::testing {

FakeNccl& Fake() {
  static FakeNccl fake;
  return fake;
}

void ResetFake() { Fake() = FakeNccl(); }

}  // namespace accord::testing

using accord::testing::Fake;
using accord::testing::FakeNccl;

namespace {
int comm_storage;
int event_storage;
ncclComm_t FakeComm() { return reinterpret_cast<ncclComm_t>(&comm_storage); }

// ncclInProgress while polls remain (-1: forever), then `final`.
ncclResult_t Countdown(ncclResult_t final) {
  FakeNccl& f = Fake();
  if (f.polls_left < 0) return ncclInProgress;
  if (f.polls_left > 0) {
    --f.polls_left;
    return ncclInProgress;
  }
  return final;
}
}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  *version = Fake().version;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id->internal, 0x5a, sizeof id->internal);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int, ncclUniqueId, int,
                                    ncclConfig_t* config) {
  FakeNccl& f = Fake();
  ++f.init_calls;
  f.last_blocking = config->blocking;
  *comm = FakeComm();
  f.phase = FakeNccl::Phase::kInit;
  f.polls_left = f.init_polls;
  return f.init_result;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t* async) {
  FakeNccl& f = Fake();
  switch (f.phase) {
    case FakeNccl::Phase::kInit:
      *async = Countdown(f.init_final);
      break;
    case FakeNccl::Phase::kEnqueue:
      *async = Countdown(ncclSuccess);
      if (*async == ncclSuccess) f.phase = FakeNccl::Phase::kOp;
      break;
    case FakeNccl::Phase::kOp:
      *async = f.op_async;
      break;
    case FakeNccl::Phase::kFinalize:
      *async = Countdown(ncclSuccess);
      break;
    case FakeNccl::Phase::kIdle:
      *async = ncclSuccess;
      break;
  }
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t) {
  ++Fake().aborts;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t) {
  ++Fake().destroys;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t) {
  FakeNccl& f = Fake();
  ++f.finalizes;
  f.phase = FakeNccl::Phase::kFinalize;
  f.polls_left = f.finalize_polls;
  return ncclInProgress;
}

ncclResult_t ncclReduceScatter(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                               cudaStream_t) {
  FakeNccl& f = Fake();
  ++f.reduce_scatters;
  f.event_left = f.event_polls;
  if (f.rs_result != ncclSuccess && f.rs_result != ncclInProgress) return f.rs_result;
  f.phase = FakeNccl::Phase::kEnqueue;
  f.polls_left = f.op_enqueue_polls;
  return f.op_enqueue_polls > 0 ? ncclInProgress : ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "other NCCL error";
  }
}

const char* ncclGetLastError(ncclComm_t) { return Fake().last_error.c_str(); }

cudaError_t cudaGetDevice(int* device) {
  if (!Fake().has_device) return cudaErrorNoDevice;
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrComputeCapabilityMajor ? Fake().cc_major : Fake().cc_minor;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  *event = reinterpret_cast<cudaEvent_t>(&event_storage);
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }

cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) {
  ++Fake().event_records;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t) {
  FakeNccl& f = Fake();
  if (f.event_left < 0) return cudaErrorNotReady;
  if (f.event_left > 0) {
    --f.event_left;
    return cudaErrorNotReady;
  }
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* status) {
  *status = Fake().capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaErrorNoDevice ? "cudaErrorNoDevice" : "cudaError";
}

const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaErrorNoDevice ? "no CUDA-capable device is detected" : "fake CUDA error";
}

}  // extern "C"
