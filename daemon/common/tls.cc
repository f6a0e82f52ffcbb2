#include "daemon/common/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace accord::daemon {

absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("--", flag, "=", path, ": cannot read the file"));
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace accord::daemon
