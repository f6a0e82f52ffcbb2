/* accord C ABI: the client library for trainers written in C or bound from
 * other languages. Opaque handles; every call returns an int status equal to
 * the absl/gRPC canonical code (ACCORD_OK == 0). After a failed call,
 * accord_last_error() returns the message on the calling thread.
 *
 * Thread-safety: a client handle may be used from several threads; a future
 * handle from one thread at a time. */
#ifndef ACCORD_CLIENT_ACCORD_H_
#define ACCORD_CLIENT_ACCORD_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes: the canonical codes (absl::StatusCode). */
enum {
  ACCORD_OK = 0,
  ACCORD_CANCELLED = 1,
  ACCORD_UNKNOWN = 2,
  ACCORD_INVALID_ARGUMENT = 3,
  ACCORD_DEADLINE_EXCEEDED = 4,
  ACCORD_NOT_FOUND = 5,
  ACCORD_ALREADY_EXISTS = 6,
  ACCORD_PERMISSION_DENIED = 7,
  ACCORD_RESOURCE_EXHAUSTED = 8,
  ACCORD_FAILED_PRECONDITION = 9,
  ACCORD_ABORTED = 10,
  ACCORD_OUT_OF_RANGE = 11,
  ACCORD_UNIMPLEMENTED = 12,
  ACCORD_INTERNAL = 13,
  ACCORD_UNAVAILABLE = 14,
  ACCORD_DATA_LOSS = 15,
  ACCORD_UNAUTHENTICATED = 16
};

/* Gradient dtypes: the wire numbers (accord.v1.DType). 0 = no gradient. */
enum {
  ACCORD_NO_GRAD = 0,
  ACCORD_FLOAT8_E4M3FN = 1,
  ACCORD_FLOAT8_E5M2 = 2,
  ACCORD_FLOAT16 = 3,
  ACCORD_BFLOAT16 = 4,
  ACCORD_FLOAT32 = 5,
  ACCORD_FLOAT64 = 6
};

typedef struct accord_client accord_client;
typedef struct accord_future accord_future;

typedef struct accord_options {
  const char* socket_path; /* the sidecar's Unix socket */
  const char* job_id;
  int32_t rank;
  int32_t world_size;
  int32_t local_rank;
  const char* token;          /* may be NULL */
  int64_t connect_timeout_ms; /* <= 0: 30 s */
} accord_options;

typedef struct accord_param {
  const char* name;
  int64_t dim0;
  int64_t numel;
} accord_param;

/* The decision, filled by accord_wait. `included` is the caller's buffer of
 * `included_capacity` bytes; it receives one byte per parameter (1: in the
 * buffer, zero-filled where a rank has no gradient; 0: skipped everywhere). */
typedef struct accord_decision {
  int64_t step;
  int32_t wire_dtype; /* ACCORD_FLOAT* */
  uint64_t layout_fingerprint;
  int32_t num_params;
  int32_t num_included;
  uint8_t* included;
  size_t included_capacity;
} accord_decision;

/* The message of the last failed call on this thread ("" if none). Valid
 * until the next accord call on the same thread. */
const char* accord_last_error(void);

/* Connects to the sidecar; on success *out is a handle for accord_close. */
int accord_connect(const accord_options* options, accord_client** out);

/* Registers a group and waits until every rank registered it (or the
 * timeout). reduce_dtype: 0 for none, else ACCORD_FLOAT*. */
int accord_register_group(accord_client* client, const char* group_id, const accord_param* params,
                          size_t num_params, int32_t reduce_dtype, int reduce_dtype_exact,
                          int64_t timeout_ms);

/* The same for a group reduced by some ranks only: `members` lists them
 * (num_members ranks, strictly ascending, this rank among them); NULL or
 * num_members == 0: every rank, as accord_register_group. */
int accord_register_group_with_members(accord_client* client, const char* group_id,
                                       const accord_param* params, size_t num_params,
                                       int32_t reduce_dtype, int reduce_dtype_exact,
                                       const int32_t* members, size_t num_members,
                                       int64_t timeout_ms);

/* Waits up to timeout_ms for the job's verdict: ACCORD_OK when the job has
 * not failed by then; else the code of the error it failed with (or the
 * session ended with), its message in accord_last_error(). */
int accord_wait_verdict(accord_client* client, int64_t timeout_ms);

/* Submits one manifest (never blocks on the network). grad_dtypes has one
 * entry per parameter: ACCORD_NO_GRAD or the gradient's dtype. On success
 * *out is a future for accord_wait, freed with accord_future_free. Errors in
 * the submission itself are reported by accord_wait. */
int accord_submit(accord_client* client, const char* group_id, int64_t step,
                  const int32_t* grad_dtypes, size_t num_params, accord_future** out);

/* Waits up to timeout_ms for the decision and fills *out. */
int accord_wait(accord_client* client, accord_future* future, int64_t timeout_ms,
                accord_decision* out);

void accord_future_free(accord_future* future);

/* Disconnects and frees the client. NULL is allowed. */
void accord_close(accord_client* client);

#ifdef __cplusplus
}
#endif

#endif /* ACCORD_CLIENT_ACCORD_H_ */
