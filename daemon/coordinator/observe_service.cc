#include "daemon/coordinator/observe_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/grpc_coordinator_service.h"

namespace accord::daemon {
namespace {

constexpr size_t kMaxIdBytes = 1024;

absl::Status CheckId(const std::string& id, const char* what) {
  if (id.size() > kMaxIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is ", id.size(), " bytes; ids are at most ", kMaxIdBytes));
  }
  return absl::OkStatus();
}

template <typename Response>
grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context, Response* response,
                                absl::StatusOr<Response> result) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (result.ok()) *response = *std::move(result);
  reactor->Finish(ToGrpcStatus(result.status()));
  return reactor;
}

}  // namespace

absl::Status ObserveGrpcService::Authorize(const std::string& job_id,
                                           const std::string& token) const {
  if (authorize_ == nullptr) return absl::OkStatus();
  return authorize_(job_id, token);
}

grpc::ServerUnaryReactor* ObserveGrpcService::Status(grpc::CallbackServerContext* context,
                                                     const v1::StatusRequest* request,
                                                     v1::StatusResponse* response) {
  absl::Status ok = CheckId(request->job_id(), "job_id");
  if (ok.ok()) ok = Authorize(request->job_id(), request->token());
  if (!ok.ok()) return Reply<v1::StatusResponse>(context, response, ok);
  return Reply(context, response, coordinator_->ObserveStatus(request->job_id()));
}

grpc::ServerUnaryReactor* ObserveGrpcService::SkipMatrix(grpc::CallbackServerContext* context,
                                                         const v1::SkipMatrixRequest* request,
                                                         v1::SkipMatrixResponse* response) {
  absl::Status ok = CheckId(request->job_id(), "job_id");
  if (ok.ok()) ok = CheckId(request->group_id(), "group_id");
  if (ok.ok()) ok = Authorize(request->job_id(), request->token());
  if (!ok.ok()) return Reply<v1::SkipMatrixResponse>(context, response, ok);
  return Reply(context, response,
               coordinator_->ObserveSkipMatrix(request->job_id(), request->group_id(),
                                               request->window_steps()));
}

grpc::ServerUnaryReactor* ObserveGrpcService::Stalls(grpc::CallbackServerContext* context,
                                                     const v1::StallsRequest* request,
                                                     v1::StallsResponse* response) {
  absl::Status ok = CheckId(request->job_id(), "job_id");
  if (ok.ok()) ok = Authorize(request->job_id(), request->token());
  if (!ok.ok()) return Reply<v1::StallsResponse>(context, response, ok);
  return Reply(context, response, coordinator_->ObserveStalls(request->job_id()));
}

}  // namespace accord::daemon
