/* The C ABI used from C (this file is compiled as C): connect, register,
 * submit, wait, error retrieval, close. Exits non-zero on the first failure. */
#include <stdio.h>
#include <string.h>

#include "client/accord.h"
#include "tests/client/fake_sidecar_c.h"

static int failures = 0;
#define EXPECT(cond)                                                                      \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "%s:%d: expected %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              accord_last_error());                                                       \
      ++failures;                                                                         \
    }                                                                                     \
  } while (0)

int main(void) {
  const char* socket_path = accord_test_fake_sidecar_start(1);
  accord_client* client = NULL;
  accord_options bad = {"/tmp/accord-no-such-dir/s.sock", "job", 0, 1, 0, NULL, 5000};
  EXPECT(accord_connect(&bad, &client) == ACCORD_UNAVAILABLE);
  EXPECT(strstr(accord_last_error(), "/tmp/accord-no-such-dir/s.sock") != NULL);
  EXPECT(client == NULL);

  accord_options opts = {socket_path, "job", 0, 1, 0, NULL, 30000};
  EXPECT(accord_connect(&opts, &client) == ACCORD_OK);
  if (client == NULL) return 1;

  accord_param params[3] = {{"w", 8, 64}, {"b", 8, 8}, {"v", 4, 16}};
  EXPECT(accord_register_group(client, "g", params, 3, 0, 0, 30000) == ACCORD_OK);
  EXPECT(accord_register_group(client, "", params, 3, 0, 0, 30000) == ACCORD_INVALID_ARGUMENT);
  EXPECT(strlen(accord_last_error()) > 0);
  /* Members of every rank register as none; a rank outside the job is refused. */
  int32_t every[1] = {0};
  EXPECT(accord_register_group_with_members(client, "m", params, 3, 0, 0, every, 1, 30000) ==
         ACCORD_OK);
  int32_t outside[1] = {1};
  EXPECT(accord_register_group_with_members(client, "n", params, 3, 0, 0, outside, 1, 30000) ==
         ACCORD_INVALID_ARGUMENT);
  EXPECT(strstr(accord_last_error(), "members") != NULL);
  /* The job has not failed: no verdict. */
  EXPECT(accord_wait_verdict(client, 0) == ACCORD_OK);

  int32_t dtypes[3] = {ACCORD_BFLOAT16, ACCORD_NO_GRAD, ACCORD_FLOAT16};
  accord_future* future = NULL;
  EXPECT(accord_submit(client, "g", 0, dtypes, 3, &future) == ACCORD_OK);
  uint8_t included[3] = {9, 9, 9};
  accord_decision d;
  memset(&d, 0, sizeof(d));
  d.included = included;
  d.included_capacity = 3;
  EXPECT(accord_wait(client, future, 30000, &d) == ACCORD_OK);
  EXPECT(d.step == 0);
  EXPECT(d.wire_dtype == ACCORD_FLOAT32); /* bf16 v fp16 */
  EXPECT(d.num_params == 3);
  EXPECT(d.num_included == 2);
  EXPECT(included[0] == 1 && included[1] == 0 && included[2] == 1);
  EXPECT(d.layout_fingerprint != 0);
  accord_future_free(future);

  /* A non-float dtype number is refused at submit. */
  int32_t ints[3] = {16, 0, 0};
  future = NULL;
  EXPECT(accord_submit(client, "g", 1, ints, 3, &future) == ACCORD_INVALID_ARGUMENT);
  EXPECT(future == NULL);
  /* A step going backwards is reported by accord_wait. */
  EXPECT(accord_submit(client, "g", 0, dtypes, 3, &future) == ACCORD_OK);
  EXPECT(accord_wait(client, future, 30000, &d) == ACCORD_INVALID_ARGUMENT);
  EXPECT(strstr(accord_last_error(), "steps must increase") != NULL);
  accord_future_free(future);

  accord_close(client);
  accord_test_fake_sidecar_stop();
  if (failures == 0) printf("c_abi_test: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
