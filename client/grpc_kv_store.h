// KeyValueStore over the sidecar's KeyValueService (which forwards to the
// coordinator), scoped to one job.
#ifndef ACCORD_CLIENT_GRPC_KV_STORE_H_
#define ACCORD_CLIENT_GRPC_KV_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/kv_store.h"
#include "grpcpp/channel.h"

namespace accord {

// Creates a store over `channel` (the sidecar's Unix socket). `target` names
// the endpoint in error messages. Each request says `rank` (the caller's), so
// a Get that ends without its keys can name the ranks that did not set them
// (docs/ARCHITECTURE.md, "Every wait names who is missing"). A request that
// finds the sidecar unreachable (UNAVAILABLE: restarted, or restarting) is
// sent again with backoff for up to `retry_unavailable_for` (a Set of the
// same value twice is harmless). Thread-safe.
std::unique_ptr<KeyValueStore> MakeGrpcKeyValueStore(std::shared_ptr<grpc::Channel> channel,
                                                     std::string target, std::string job_id,
                                                     std::string token, int rank,
                                                     absl::Duration retry_unavailable_for);

}  // namespace accord

#endif  // ACCORD_CLIENT_GRPC_KV_STORE_H_
