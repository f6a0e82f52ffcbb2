// A FIFO "gate" that holds a rank process (accord-rank-scenario --gate_*)
// before a step until the test releases it: an event, not a timed wait.
#ifndef ACCORD_TESTS_FAULT_GATE_H_
#define ACCORD_TESTS_FAULT_GATE_H_

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace accord::testing {

// A FIFO a gated rank blocks on until Release().
class Gate {
 public:
  Gate() {
    char tmpl[] = "/tmp/accord-gate-XXXXXX";
    dir_ = mkdtemp(tmpl);
    path_ = dir_ + "/gate";
    mkfifo(path_.c_str(), 0600);
  }
  ~Gate() {
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }
  const std::string& path() const { return path_; }
  // Lets the rank blocked in open(2) go. The rank prints "waiting at gate"
  // just before it opens the FIFO, so on a loaded machine it may not be in
  // open(2) yet (ENXIO): retry for up to 30 s; false when no rank came.
  bool Release() {
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (true) {
      const int fd = open(path_.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) {
        close(fd);
        return true;
      }
      if (errno != ENXIO || absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

 private:
  std::string dir_;
  std::string path_;
};

}  // namespace accord::testing

#endif  // ACCORD_TESTS_FAULT_GATE_H_
