// The daemons' termination signals (daemon/common/signals.h): blocked from
// the moment the program is loaded, so a SIGTERM that comes while a daemon
// starts waits for it instead of killing it by the default action.
#include "daemon/common/signals.h"

#include <pthread.h>
#include <signal.h>

#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

TEST(SignalsTest, TerminationSignalsAreBlockedBeforeMainRuns) {
  // Nothing in this test program blocked them: linking the signals code did.
  sigset_t blocked;
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, nullptr, &blocked), 0);
  EXPECT_TRUE(sigismember(&blocked, SIGTERM));
  EXPECT_TRUE(sigismember(&blocked, SIGINT));
  EXPECT_TRUE(sigismember(&blocked, SIGHUP));
}

TEST(SignalsTest, ASigtermThatCameBeforeTheWaitIsWhatTheWaitReturns) {
  ASSERT_EQ(raise(SIGTERM), 0);  // blocked: pending, the process lives on
  EXPECT_EQ(WaitForTerminationSignal(), SIGTERM);
}

TEST(SignalsTest, ASighupIsAReloadOnlyForTheWaitThatTakesOne) {
  ASSERT_EQ(raise(SIGHUP), 0);
  EXPECT_EQ(WaitForTerminationOrReloadSignal(), SIGHUP);
}

}  // namespace
}  // namespace accord::daemon
