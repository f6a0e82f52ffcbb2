#include "tests/client/fake_sidecar_c.h"

#include <memory>

#include "tests/client/fake_sidecar.h"

namespace {
std::unique_ptr<accord::testing::FakeSidecar> g_fake;  // the C test is single-threaded
}  // namespace

extern "C" const char* accord_test_fake_sidecar_start(int world_size) {
  g_fake = std::make_unique<accord::testing::FakeSidecar>(world_size);
  g_fake->Start();
  return g_fake->socket_path().c_str();
}

extern "C" void accord_test_fake_sidecar_stop(void) { g_fake.reset(); }
