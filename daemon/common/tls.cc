#include "daemon/common/tls.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

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

bool IsLoopbackAddress(absl::string_view address) {
  absl::string_view a = absl::StripAsciiWhitespace(address);
  if (absl::StartsWith(a, "unix:") || absl::StartsWith(a, "unix-abstract:")) return true;
  absl::ConsumePrefix(&a, "dns:///");
  absl::ConsumePrefix(&a, "ipv4:");
  absl::ConsumePrefix(&a, "ipv6:");
  std::string host;
  if (absl::StartsWith(a, "[")) {
    const size_t close = a.find(']');
    if (close == absl::string_view::npos) return false;
    host = std::string(a.substr(1, close - 1));
  } else {
    const size_t colon = a.rfind(':');
    // More than one colon without brackets: a bare IPv6 address.
    if (colon != absl::string_view::npos && a.find(':') == colon) {
      host = std::string(a.substr(0, colon));
    } else {
      host = std::string(a);
    }
  }
  host = absl::AsciiStrToLower(host);
  if (host == "localhost" || host == "::1" || host == "ip6-localhost") return true;
  std::vector<absl::string_view> octets = absl::StrSplit(host, '.');
  if (octets.size() != 4) return false;
  int values[4];
  for (int i = 0; i < 4; ++i) {
    if (!absl::SimpleAtoi(octets[i], &values[i]) || values[i] < 0 || values[i] > 255) return false;
  }
  return values[0] == 127;
}

absl::Status CheckServerPlaintext(absl::string_view listen, bool plaintext_flag,
                                  bool tls_flags_given) {
  if (tls_flags_given && plaintext_flag) {
    return absl::FailedPreconditionError(
        "--plaintext contradicts --tls_cert/--tls_key/--tls_ca; give one or the other");
  }
  if (tls_flags_given || plaintext_flag || IsLoopbackAddress(listen)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "--listen=", listen,
      " is reachable from the network and no TLS is configured: give --tls_cert and --tls_key "
      "(and --tls_ca to require client certificates), or --plaintext to serve job tokens and "
      "manifests in clear text on a trusted network, or listen on 127.0.0.1"));
}

absl::Status CheckClientPlaintext(absl::string_view target, bool plaintext_flag,
                                  bool tls_flags_given, absl::string_view tls_flag_prefix) {
  const std::string p(tls_flag_prefix);
  // "tls_" -> --plaintext, "upstream_tls_" -> --upstream_plaintext.
  const std::string plaintext = absl::StrCat(
      absl::string_view(p).substr(0, p.size() - std::min<size_t>(p.size(), 4)), "plaintext");
  if (tls_flags_given && plaintext_flag) {
    return absl::FailedPreconditionError(absl::StrCat("--", plaintext, " contradicts --", p,
                                                      "ca/--", p, "cert/--", p,
                                                      "key; give one or the other"));
  }
  if (tls_flags_given || plaintext_flag || IsLoopbackAddress(target)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "--coordinator=", target, " is not on this machine and no TLS is configured: give --", p,
      "ca (the CA that signed the coordinator's certificate; plus --", p, "cert/--", p,
      "key when the coordinator requires client certificates), or --", plaintext,
      " to send the job token and manifests in clear text"));
}

}  // namespace accord::daemon
