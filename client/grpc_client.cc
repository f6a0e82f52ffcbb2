// GrpcClient's construction, start and close, and Client::Connect.
#include "client/grpc_client.h"

#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/grpc_kv_store.h"
#include "core/lock_checks.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace accord {
namespace {

// How long closing the client waits for what it queued to be written.
constexpr absl::Duration kCloseFlush = absl::Seconds(1);

// A channel to the sidecar's socket whose own reconnect backoff is capped
// like the session's (gRPC's default grows to 120 s), so that a key-value
// call after a sidecar restart finds it within a second.
std::shared_ptr<grpc::Channel> SidecarChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

absl::Status ValidateOptions(const ClientOptions& o) {
  if (o.socket_path.empty()) {
    return absl::InvalidArgumentError(
        "ClientOptions.socket_path is empty; pass the sidecar's "
        "Unix socket path");
  }
  if (o.job_id.empty()) return absl::InvalidArgumentError("ClientOptions.job_id is empty");
  if (o.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.world_size is ", o.world_size, "; it must be at least 1"));
  }
  if (o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.rank ", o.rank, " is outside 0..", o.world_size - 1));
  }
  if (o.local_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.local_rank ", o.local_rank, " is negative"));
  }
  return absl::OkStatus();
}

}  // namespace

bool DecisionFuture::Ready() const {
  return state_ != nullptr && state_->completed.load(std::memory_order_acquire);
}

GrpcClient::GrpcClient(const ClientOptions& options)
    : options_(options),
      conn_(options, std::random_device()() ^ static_cast<uint64_t>(options.rank)),
      hub_(std::make_shared<FutureHub>()) {
  kv_ = MakeGrpcKeyValueStore(SidecarChannel(absl::StrCat("unix:", options.socket_path)),
                              absl::StrCat("the sidecar at ", options.socket_path), options.job_id,
                              options.token, options.rank, options.world_size, [this] {
                                accord::MutexLock lock(&mu_);
                                return conn_.CallStatus();
                              });
  accord::MutexLock lock(&mu_);
  buffers_.scratch.ranks = RankSet(options.world_size);
  buffers_.scratch.ranks.Add(options.rank);
}

GrpcClient::~GrpcClient() {
  {
    accord::MutexLock lock(&mu_);
    // What is queued (an adapter's last counts) is written first, within a
    // bound.
    auto written = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return (outbox_.empty() && !writing_) || !conn_.welcomed() || conn_.read_ended() ||
             conn_.closed();
    };
    mu_.AwaitWithTimeout(absl::Condition(&written), kCloseFlush);
    conn_.RequestStop();
    if (stream_.ctx != nullptr) stream_.ctx->TryCancel();
  }
  if (session_.joinable()) session_.join();
}

absl::Status GrpcClient::Start() {
  {
    accord::MutexLock lock(&mu_);
    conn_.Start(absl::Now());
    OpenStreamLocked();
    outbox_.push_back(HelloLocked(/*resume=*/false));
  }
  session_ = std::thread([this] { SessionLoop(); });

  accord::MutexLock lock(&mu_);
  auto answered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return conn_.welcomed() || !conn_.CallStatus().ok();
  };
  mu_.AwaitWithDeadline(absl::Condition(&answered), conn_.connect_deadline());
  if (absl::Status s = conn_.CallStatus(); !s.ok()) return s;
  if (!conn_.welcomed()) {
    // The deadline may fall while an attempt is under way: unless its channel
    // connected, the sidecar was never reached.
    const bool connected =
        stream_.channel != nullptr && stream_.channel->GetState(false) == GRPC_CHANNEL_READY;
    return conn_.ConnectTimedOut(connected);
  }
  return absl::OkStatus();
}

std::string LaunchIdFromEnvironment() {
  if (const char* id = std::getenv("ACCORD_LAUNCH_ID"); id != nullptr && *id != '\0') return id;
  // torchrun gives every worker of one start the same run id and restart
  // count; a restart counts up. Its run id is "none" unless --rdzv-id set
  // one (or --standalone drew one): the same for every launch, so no id.
  const char* run = std::getenv("TORCHELASTIC_RUN_ID");
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (run == nullptr || *run == '\0' || std::string_view(run) == "none" || restart == nullptr) {
    return "";
  }
  return absl::StrCat("torchrun:", run, ":", restart);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  static const bool lock_checks_configured = (ConfigureLockChecks(), true);
  (void)lock_checks_configured;
  ClientOptions resolved = options;
  if (resolved.launch_id.empty()) resolved.launch_id = LaunchIdFromEnvironment();
  auto client = std::make_unique<GrpcClient>(resolved);
  if (absl::Status s = client->Start(); !s.ok()) return s;
  return std::unique_ptr<Client>(std::move(client));
}

}  // namespace accord
