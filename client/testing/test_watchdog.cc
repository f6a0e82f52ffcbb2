// The test-process watchdog. CTest runs every GoogleTest case in a process of
// its own with ACCORD_TEST_WATCHDOG_S set (cmake/AccordOptions.cmake,
// accord_test): a process still running that long after it started prints
// every thread's stack (gdb) and aborts. A hang then fails within minutes,
// showing where each thread waits, instead of at CTest's timeout with
// nothing but the output so far (docs/RELIABILITY.md, "Hangs in CI").

#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace accord::testing {
namespace {

[[noreturn]] void Fire(double seconds) {
  std::fprintf(stderr,
               "\nwatchdog: this test process is still running %.0f s after it started "
               "(ACCORD_TEST_WATCHDOG_S): every thread's stack follows, then it aborts\n",
               seconds);
  std::fflush(stderr);
  // gdb attaches to its parent: allowed under Yama's ptrace scope 1 only so.
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  if (std::system("command -v gdb >/dev/null 2>&1") == 0) {
    const std::string gdb = "gdb -p " + std::to_string(getpid()) +
                            " -batch -nx -ex 'thread apply all bt 40' 1>&2 2>/dev/null";
    if (std::system(gdb.c_str()) != 0) std::fprintf(stderr, "watchdog: gdb failed\n");
  } else {
    std::fprintf(stderr, "watchdog: no gdb on PATH, so no stacks\n");
  }
  std::fflush(stderr);
  std::abort();
}

// Started before main(), so it also bounds static set-up and tear-down.
[[maybe_unused]] const bool kArmed = [] {
  const char* value = std::getenv("ACCORD_TEST_WATCHDOG_S");
  const double seconds = value == nullptr ? 0 : std::atof(value);
  if (seconds <= 0) return false;
  std::thread([seconds] {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    Fire(seconds);
  }).detach();
  return true;
}();

}  // namespace
}  // namespace accord::testing
