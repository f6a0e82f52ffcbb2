/* A C entry point to the fake sidecar, for the C ABI test. */
#ifndef ACCORD_TESTS_CLIENT_FAKE_SIDECAR_C_H_
#define ACCORD_TESTS_CLIENT_FAKE_SIDECAR_C_H_

#ifdef __cplusplus
extern "C" {
#endif

/* Starts a fake sidecar for a job of `world_size` ranks; returns its socket
 * path (owned by the fake). */
const char* accord_test_fake_sidecar_start(int world_size);
void accord_test_fake_sidecar_stop(void);

#ifdef __cplusplus
}
#endif

#endif /* ACCORD_TESTS_CLIENT_FAKE_SIDECAR_C_H_ */
