// ACCORD_<NAME> environment fallbacks for every flag a daemon's file defines
// (daemon/common/flags_env.h).
#include "daemon/common/flags_env.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "gtest/gtest.h"

ABSL_FLAG(int, accord_test_answer, 1, "a flag of this file");
ABSL_FLAG(std::string, accord_test_word, "default", "another flag of this file");

namespace accord::daemon {
namespace {

TEST(FlagsEnvTest, EveryFlagOfTheFileTakesItsVariableAndTheCommandLineWins) {
  EXPECT_EQ(FlagsDefinedIn(__FILE__),
            (std::vector<std::string>{"accord_test_answer", "accord_test_word"}));
  ::setenv("ACCORD_ACCORD_TEST_ANSWER", "42", 1);
  ::setenv("ACCORD_ACCORD_TEST_WORD", "from-env", 1);
  std::string prog = "flags_env_test", word = "--accord_test_word=from-cli";
  char* argv[] = {prog.data(), word.data(), nullptr};
  ParseFlagsWithEnv(2, argv, __FILE__, "test");
  EXPECT_EQ(absl::GetFlag(FLAGS_accord_test_answer), 42);
  EXPECT_EQ(absl::GetFlag(FLAGS_accord_test_word), "from-cli");
}

}  // namespace
}  // namespace accord::daemon
