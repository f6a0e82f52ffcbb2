// A KeyValueStore shared by the processes of one test: one file per key in a
// directory, written with an atomic rename; Get waits with inotify (no
// polling). Test-only.
#ifndef ACCORD_TESTS_COLLECTIVE_DIR_KV_STORE_H_
#define ACCORD_TESTS_COLLECTIVE_DIR_KV_STORE_H_

#include <poll.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "client/kv_store.h"

namespace accord::testing {

class DirKeyValueStore : public KeyValueStore {
 public:
  explicit DirKeyValueStore(std::string dir) : dir_(std::move(dir)) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    const std::string tmp = absl::StrCat(dir_, "/.tmp.", getpid(), ".", counter_++);
    {
      std::ofstream f(tmp, std::ios::binary);
      f.write(value.data(), static_cast<std::streamsize>(value.size()));
      if (!f) return absl::InternalError(absl::StrCat("cannot write ", tmp));
    }
    if (rename(tmp.c_str(), Path(key).c_str()) != 0) {
      return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", Path(key)));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // Watch before the first look so a key renamed in between is not missed.
    const int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0) return absl::InternalError("inotify_init1 failed");
    inotify_add_watch(fd, dir_.c_str(), IN_MOVED_TO | IN_CREATE);
    std::vector<std::string> values(keys.size());
    std::vector<std::string> missing;
    while (true) {
      missing.clear();
      for (size_t i = 0; i < keys.size(); ++i) {
        std::ifstream f(Path(keys[i]), std::ios::binary);
        if (!f) {
          missing.push_back(keys[i]);
          continue;
        }
        std::stringstream ss;
        ss << f.rdbuf();
        values[i] = ss.str();
      }
      if (missing.empty()) break;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        close(fd);
        return absl::DeadlineExceededError(absl::StrCat("keys missing after ", timeout.count(),
                                                        " ms: ", absl::StrJoin(missing, ", ")));
      }
      pollfd p{fd, POLLIN, 0};
      poll(&p, 1, static_cast<int>(left.count()));
      char buf[4096];
      while (read(fd, buf, sizeof buf) > 0) {
      }
    }
    close(fd);
    return values;
  }

 private:
  std::string Path(const std::string& key) const {
    return absl::StrCat(dir_, "/", absl::StrReplaceAll(key, {{"%", "%25"}, {"/", "%2F"}}));
  }
  const std::string dir_;
  std::atomic<int> counter_{0};
};

}  // namespace accord::testing

#endif  // ACCORD_TESTS_COLLECTIVE_DIR_KV_STORE_H_
