#include "daemon/common/upstream_channel.h"

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "daemon/common/tls.h"

namespace accord::daemon {
namespace {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const UpstreamFlags& f) {
  const bool tls = !f.ca_path.empty() || !f.cert_path.empty() || !f.key_path.empty();
  if (absl::Status s = CheckClientPlaintext(f.target, f.plaintext, tls, f.tls_flag_prefix);
      !s.ok()) {
    return s;
  }
  if (!tls) return grpc::InsecureChannelCredentials();
  const std::string& p = f.tls_flag_prefix;
  grpc::SslCredentialsOptions ssl;
  if (f.ca_path.empty()) {
    ACCORD_LOG(WARNING) << "TLS without --" << p << "ca: " << f.target
                        << " is verified against the system's CA store";
  } else {
    absl::StatusOr<std::string> ca = ReadPemFile(f.ca_path, p + "ca");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  if (f.cert_path.empty() != f.key_path.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mutual TLS needs both --", p, "cert and --", p, "key (or neither)"));
  }
  if (!f.cert_path.empty()) {
    absl::StatusOr<std::string> cert = ReadPemFile(f.cert_path, p + "cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile(f.key_path, p + "key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::pair<int, int>> KeepaliveMillis(absl::Duration time, absl::Duration timeout) {
  const int64_t time_ms = absl::ToInt64Milliseconds(time);
  const int64_t timeout_ms = absl::ToInt64Milliseconds(timeout);
  if (time_ms < 1 || timeout_ms < 1 || time_ms > INT32_MAX || timeout_ms > INT32_MAX) {
    return absl::InvalidArgumentError(
        "--keepalive_time and --keepalive_timeout must be between 1ms and about 24 days");
  }
  return std::make_pair(static_cast<int>(time_ms), static_cast<int>(timeout_ms));
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> UpstreamChannel(const UpstreamFlags& flags) {
  absl::StatusOr<std::pair<int, int>> keepalive =
      KeepaliveMillis(flags.keepalive_time, flags.keepalive_timeout);
  if (!keepalive.ok()) return keepalive.status();
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = Credentials(flags);
  if (!creds.ok()) return creds.status();
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, flags.max_message_bytes);
  args.SetInt(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, flags.max_message_bytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive->first);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive->second);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(flags.reconnect_max_backoff)));
  return grpc::CreateCustomChannel(flags.target, *std::move(creds), args);
}

}  // namespace accord::daemon
