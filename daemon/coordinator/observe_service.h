// ObserveService (observe.proto) over the Coordinator's observe views: a
// thin adapter that validates requests and converts statuses.
#ifndef ACCORD_DAEMON_COORDINATOR_OBSERVE_SERVICE_H_
#define ACCORD_DAEMON_COORDINATOR_OBSERVE_SERVICE_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "accord/v1/observe.grpc.pb.h"
#include "daemon/coordinator/coordinator.h"

namespace accord::daemon {

// Checks a request's token for a job (empty job: a request about every job).
// Returns PERMISSION_DENIED / UNAUTHENTICATED to refuse. Hook for the job
// token checks; without one every request is allowed.
using ObserveAuthorizer =
    std::function<absl::Status(const std::string& job_id, const std::string& token)>;

class ObserveGrpcService final : public v1::ObserveService::CallbackService {
 public:
  explicit ObserveGrpcService(Coordinator* coordinator, ObserveAuthorizer authorize = nullptr)
      : coordinator_(coordinator), authorize_(std::move(authorize)) {}

  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* context,
                                   const v1::StatusRequest* request,
                                   v1::StatusResponse* response) override;
  grpc::ServerUnaryReactor* SkipMatrix(grpc::CallbackServerContext* context,
                                       const v1::SkipMatrixRequest* request,
                                       v1::SkipMatrixResponse* response) override;
  grpc::ServerUnaryReactor* Stalls(grpc::CallbackServerContext* context,
                                   const v1::StallsRequest* request,
                                   v1::StallsResponse* response) override;

 private:
  absl::Status Authorize(const std::string& job_id, const std::string& token) const;

  Coordinator* const coordinator_;
  const ObserveAuthorizer authorize_;
};

}  // namespace accord::daemon

#endif  // ACCORD_DAEMON_COORDINATOR_OBSERVE_SERVICE_H_
