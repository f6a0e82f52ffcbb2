// An in-process RankService for client tests: a whole job in one process.
// It decides with core's Decide once every rank of the world submitted a
// group's step, answers "same as previous" when the decision repeats, and
// can be told to misbehave (bad decisions, errors, closing streams).
#ifndef ACCORD_TESTS_CLIENT_FAKE_SIDECAR_H_
#define ACCORD_TESTS_CLIENT_FAKE_SIDECAR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "accord/v1/accord.grpc.pb.h"
#include "core/decide.h"
#include "core/sync.h"
#include "grpcpp/server.h"

namespace accord::testing {

// The node epoch every welcome of the fake carries (Welcome.node_epoch).
inline constexpr uint64_t kFakeNodeEpoch = 0x5eed0e9;

class FakeSidecar final : public v1::RankService::Service, public v1::KeyValueService::Service {
 public:
  explicit FakeSidecar(int world_size);
  ~FakeSidecar() override;

  // Serves on a fresh socket under a temporary directory.
  void Start();
  const std::string& socket_path() const { return socket_path_; }

  // Behaviour switches (set before the clients act).
  // Every hello is answered with this error instead of a welcome.
  void RejectHellos(v1::DecisionError error);
  // Transforms each outgoing decision (e.g. corrupt it).
  void MutateDecisions(std::function<void(v1::Decision*)> f);
  // Closes every open session (the server side ends the streams); later
  // sessions are refused.
  void CloseSessions();
  // Ends every open session but serves new ones (a dropped stream: the
  // client reconnects and resumes).
  void DropSessions();
  // Sends a session-wide error to every session.
  void SendErrorToAll(const v1::DecisionError& e);
  // Welcomes with Welcome.members and takes registrations with members: a
  // group is answered, and its steps decided, among its members (the
  // registration result and decisions go to them only).
  void TakeMembers();

  // Everything the fake received, in order (hellos, registrations, batches).
  std::vector<v1::RankMessage> Received() const;
  int sessions_started() const;

  grpc::Status Session(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<v1::RankReply, v1::RankMessage>* stream) override;
  grpc::Status Set(grpc::ServerContext* ctx, const v1::KeyValueSetRequest* req,
                   v1::KeyValueSetResponse* resp) override;
  grpc::Status Get(grpc::ServerContext* ctx, const v1::KeyValueGetRequest* req,
                   v1::KeyValueGetResponse* resp) override;

 private:
  struct Conn {
    grpc::ServerReaderWriter<v1::RankReply, v1::RankMessage>* stream;
    grpc::ServerContext* ctx;
    accord::Mutex write_mu;
    int rank = -1;
    bool closing = false;
  };
  struct GroupState {
    GroupSpec spec;
    Policy policy;
    std::vector<int> registered;
    std::map<int, std::vector<DTypeMask>> last_content;  // per rank, for repeat form
    std::map<int64_t, Manifest> merged;                  // open steps
    std::optional<Decision> last;
    // Every decided step in full form: a rank that resumes after a decision
    // was broadcast while it had no stream resends that step's manifest and
    // gets the decision again, as from the real sidecar.
    std::map<int64_t, v1::Decision> decided;
  };

  void Write(Conn* c, const v1::RankReply& r);
  void Broadcast(const v1::RankReply& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // To the sessions of the group's members (every session when none).
  void SendToMembers(const GroupState& g, const v1::RankReply& r)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnRegistration(Conn* c, const v1::GroupRegistration& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnManifest(Conn* c, const v1::Manifest& m, v1::DecisionBatch* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int world_size_;
  std::string dir_;
  std::string socket_path_;
  std::unique_ptr<grpc::Server> server_;

  mutable accord::Mutex mu_;
  std::vector<Conn*> conns_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::RankMessage> received_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, GroupState> groups_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> kv_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::DecisionError> reject_hello_ ABSL_GUARDED_BY(mu_);
  std::function<void(v1::Decision*)> mutate_ ABSL_GUARDED_BY(mu_);
  int sessions_started_ ABSL_GUARDED_BY(mu_) = 0;
  bool close_all_ ABSL_GUARDED_BY(mu_) = false;
  bool members_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace accord::testing

#endif  // ACCORD_TESTS_CLIENT_FAKE_SIDECAR_H_
