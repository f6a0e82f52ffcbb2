// A scriptable stand-in for the NCCL and CUDA runtime calls that
// client/collective/nccl_collective.cc makes, linked in place of libnccl and
// libcudart (the link seam): the NCCL backend's bounded waits, aborts and
// bootstrap run on a machine without a GPU. Test-only; single-threaded.
#ifndef ACCORD_TESTS_COLLECTIVE_FAKE_NCCL_H_
#define ACCORD_TESTS_COLLECTIVE_FAKE_NCCL_H_

#include <nccl.h>

#include <string>

namespace accord::testing {

struct FakeNccl {
  // Runtime facts.
  int version = 22809;
  int cc_major = 9;
  int cc_minor = 0;
  bool has_device = true;
  // ncclCommInitRankConfig's return, then what ncclCommGetAsyncError reports:
  // ncclInProgress for `init_polls` polls (-1: forever), then `init_final`.
  ncclResult_t init_result = ncclInProgress;
  int init_polls = 2;
  ncclResult_t init_final = ncclSuccess;
  // ncclReduceScatter's return, then the async state during the operation:
  // ncclInProgress for `op_enqueue_polls` polls, then `op_async`.
  ncclResult_t rs_result = ncclSuccess;
  int op_enqueue_polls = 0;
  ncclResult_t op_async = ncclSuccess;
  // cudaEventQuery: cudaErrorNotReady for `event_polls` queries (-1: forever).
  int event_polls = 1;
  bool capturing = false;
  // ncclCommFinalize: ncclInProgress for `finalize_polls` polls (-1: forever).
  int finalize_polls = 1;

  // What happened.
  int init_calls = 0;
  int last_blocking = -1;  // ncclConfig_t::blocking of the last init
  int reduce_scatters = 0;
  int event_records = 0;
  int aborts = 0;
  int destroys = 0;
  int finalizes = 0;
  std::string last_error = "peer 3 closed the connection";

  // Internal: which phase the async error reflects.
  enum class Phase { kIdle, kInit, kEnqueue, kOp, kFinalize } phase = Phase::kIdle;
  int polls_left = 0;
  int event_left = 0;
};

// The one fake; Reset() before each test.
FakeNccl& Fake();
void ResetFake();

}  // namespace accord::testing

#endif  // ACCORD_TESTS_COLLECTIVE_FAKE_NCCL_H_
