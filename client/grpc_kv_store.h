// KeyValueStore over the sidecar's KeyValueService (which forwards to the
// coordinator), scoped to one job.
#ifndef ACCORD_CLIENT_GRPC_KV_STORE_H_
#define ACCORD_CLIENT_GRPC_KV_STORE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/kv_store.h"
#include "grpcpp/channel.h"

namespace accord {

// Creates a store over `channel` (the sidecar's Unix socket). `target` names
// the endpoint in error messages. Each request says `rank` (the caller's), so
// a Get that ends without its keys can name the ranks that did not set them
// (docs/ARCHITECTURE.md, "Every wait names who is missing"); `world_size`
// (the job's) puts GetAmong's ranks in their canonical form.
//
// A request that finds the sidecar unreachable (UNAVAILABLE: stopped,
// restarted or restarting) is sent again with backoff, within the call's own
// bound, for as long as `session_over` returns OK: the rank's session decides
// when its sidecar is gone (past the client's reconnect grace), and the call
// then ends with the session's words, so a rank's key-value calls and its
// stream never disagree about the sidecar (docs/RELIABILITY.md, "Sidecar
// restart"). A Set of the same value twice is harmless. Thread-safe.
std::unique_ptr<KeyValueStore> MakeGrpcKeyValueStore(std::shared_ptr<grpc::Channel> channel,
                                                     std::string target, std::string job_id,
                                                     std::string token, int rank, int world_size,
                                                     std::function<absl::Status()> session_over);

}  // namespace accord

#endif  // ACCORD_CLIENT_GRPC_KV_STORE_H_
