// The real daemons: TLS and mutual TLS between sidecar and coordinator (a
// throwaway CA made with openssl in a temp dir), job tokens end to end, the
// plaintext health port, and the rank socket's permissions. Readiness and
// failures are observed through the daemons' output lines and the client's
// statuses; nothing sleeps.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "accord/v1/accord.grpc.pb.h"
#include "client/client.h"
#include "client/testing/local_cluster.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace accord::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Makes a CA, a second (wrong) CA, a server certificate for localhost /
// 127.0.0.1 and a client certificate, all under `dir`.
bool MakeCertificates(const std::string& dir) {
  const std::string script = absl::StrCat(
      "set -e; cd '", dir, "'\n", "ec='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'\n",
      "openssl req -x509 $ec -keyout ca.key -out ca.crt -days 2 -subj '/CN=accord test CA'\n",
      "openssl req -x509 $ec -keyout wrong_ca.key -out wrong_ca.crt -days 2 "
      "-subj '/CN=some other CA'\n",
      "openssl req $ec -keyout server.key -out server.csr -subj '/CN=accord-coordinator'\n",
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\nextendedKeyUsage=serverAuth\\n' > "
      "server.ext\n",
      "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 "
      "-extfile server.ext -out server.crt\n",
      "openssl req $ec -keyout client.key -out client.csr -subj '/CN=accord-sidecar'\n",
      "printf 'extendedKeyUsage=clientAuth\\n' > client.ext\n",
      "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 "
      "-extfile client.ext -out client.crt\n",
      "openssl req $ec -keyout rogue.key -out rogue.csr -subj '/CN=rogue sidecar'\n",
      "openssl x509 -req -in rogue.csr -CA wrong_ca.crt -CAkey wrong_ca.key -CAcreateserial "
      "-days 2 -extfile client.ext -out rogue.crt\n");
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open((dir + "/openssl.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execlp("sh", "sh", "-c", script.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

class DaemonsSecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/accord-security-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = new std::string(tmpl);
    chmod(dir_->c_str(), 0755);
    have_certs_ = MakeCertificates(*dir_);
  }
  static void TearDownTestSuite() {
    std::system(absl::StrCat("rm -rf '", *dir_, "'").c_str());
    delete dir_;
  }
  void TearDown() override {
    if (HasFailure()) {
      for (auto* p : {coordinator_.get(), relay_.get(), sidecar_.get()}) {
        if (p != nullptr)
          std::fprintf(stderr, "--- %s:\n%s\n", p->name().c_str(), p->Output().c_str());
      }
    }
    sidecar_.reset();
    relay_.reset();
    coordinator_.reset();
  }

  static std::string F(const std::string& name) { return *dir_ + "/" + name; }

  // Starts the coordinator on 127.0.0.1:0; returns "localhost:PORT".
  std::string StartCoordinator(std::vector<std::string> flags) {
    std::vector<std::string> argv = {ACCORD_COORDINATOR_BIN, "--listen=127.0.0.1:0",
                                     "--metrics_port=-1"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto p = ChildProcess::Spawn(argv, "coordinator", /*echo=*/false);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return "";
    coordinator_ = *std::move(p);
    absl::StatusOr<std::string> line =
        coordinator_->WaitForLine("accord-coordinator listening on 127.0.0.1:", Deadline());
    EXPECT_TRUE(line.ok()) << line.status() << coordinator_->Output();
    if (!line.ok()) return "";
    std::string port = line->substr(line->rfind(':') + 1);
    while (!port.empty() && !std::isdigit(static_cast<unsigned char>(port.back()))) port.pop_back();
    return "localhost:" + port;
  }

  std::string StartSidecar(const std::string& coordinator, std::vector<std::string> flags,
                           const std::string& socket_name = "sidecar.sock") {
    const std::string socket = F(socket_name);
    std::vector<std::string> argv = {ACCORD_SIDECAR_BIN,   "--coordinator=" + coordinator,
                                     "--socket=" + socket, "--node_id=n0",
                                     "--metrics_port=-1",  "--reconnect_max_backoff=200ms"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto p = ChildProcess::Spawn(argv, "sidecar", /*echo=*/false);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return "";
    sidecar_ = *std::move(p);
    absl::StatusOr<std::string> line = sidecar_->WaitForLine("accord-sidecar serving", Deadline());
    EXPECT_TRUE(line.ok()) << line.status() << sidecar_->Output();
    return socket;
  }

  // Starts an accord-relay on 127.0.0.1:0 with `coordinator` upstream;
  // returns "localhost:PORT" (docs/ARCHITECTURE.md, "Relays").
  std::string StartRelay(const std::string& coordinator, std::vector<std::string> flags) {
    std::vector<std::string> argv = {
        ACCORD_RELAY_BIN,    "--listen=127.0.0.1:0",          "--coordinator=" + coordinator,
        "--relay_id=relay0", "--reconnect_max_backoff=200ms", "--metrics_port=-1"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto p = ChildProcess::Spawn(argv, "relay", /*echo=*/false);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return "";
    relay_ = *std::move(p);
    absl::StatusOr<std::string> line =
        relay_->WaitForLine("accord-relay listening on 127.0.0.1:", Deadline());
    EXPECT_TRUE(line.ok()) << line.status() << relay_->Output();
    if (!line.ok()) return "";
    std::string port = line->substr(line->rfind(':') + 1);
    while (!port.empty() && !std::isdigit(static_cast<unsigned char>(port.back()))) port.pop_back();
    return "localhost:" + port;
  }

  static absl::Time Deadline() { return absl::Now() + absl::Seconds(60); }

  // One rank of a world of 1: connect, register, submit step 0, wait.
  static absl::StatusOr<Decision> OneDecision(const std::string& socket, const std::string& token,
                                              absl::Duration wait) {
    ClientOptions o;
    o.socket_path = socket;
    o.job_id = "job-a";
    o.rank = 0;
    o.world_size = 1;
    o.token = token;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    if (!c.ok()) return c.status();
    GroupSpec spec{"g", {ParamSpec{"w", 8, 64}, ParamSpec{"b", 8, 8}}};
    if (absl::Status s = (*c)->RegisterGroup(spec, Policy(), absl::Now() + wait); !s.ok()) {
      return s;
    }
    DecisionFuture f = (*c)->Submit(GroupSubmission{"g", 0, {DType::kFloat32, std::nullopt}});
    return (*c)->Wait(f, absl::Now() + wait);
  }

  std::vector<std::string> ServerTls() const {
    return {"--tls_cert=" + F("server.crt"), "--tls_key=" + F("server.key"),
            "--tls_ca=" + F("ca.crt")};
  }

  static std::string* dir_;
  static bool have_certs_;
  std::unique_ptr<ChildProcess> coordinator_;
  std::unique_ptr<ChildProcess> relay_;
  std::unique_ptr<ChildProcess> sidecar_;
};

std::string* DaemonsSecurityTest::dir_ = nullptr;
bool DaemonsSecurityTest::have_certs_ = false;

#define REQUIRE_CERTS()                                                                   \
  if (!have_certs_) {                                                                     \
    GTEST_FAIL() << "openssl could not make test certificates; see " << F("openssl.log"); \
  }

TEST_F(DaemonsSecurityTest, MutualTlsEndToEndARankGetsADecision) {
  REQUIRE_CERTS();
  const std::string addr = StartCoordinator(ServerTls());
  const std::string socket = StartSidecar(
      addr,
      {"--tls_ca=" + F("ca.crt"), "--tls_cert=" + F("client.crt"), "--tls_key=" + F("client.key")});
  absl::StatusOr<Decision> d = OneDecision(socket, "", absl::Seconds(60));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->step, 0);
  EXPECT_EQ(d->included, (std::vector<bool>{true, false}));
}

TEST_F(DaemonsSecurityTest, SidecarWithoutClientCertificateIsRefused) {
  REQUIRE_CERTS();
  const std::string addr = StartCoordinator(ServerTls());
  const std::string socket = StartSidecar(addr, {"--tls_ca=" + F("ca.crt")});
  absl::StatusOr<std::string> line = sidecar_->WaitForLine("coordinator stream ended", Deadline());
  ASSERT_TRUE(line.ok()) << line.status();
  absl::StatusOr<Decision> d = OneDecision(socket, "", absl::Seconds(3));
  EXPECT_FALSE(d.ok());
  EXPECT_THAT(coordinator_->Output(), Not(HasSubstr("job-a")));
}

TEST_F(DaemonsSecurityTest, SidecarWithCertificateFromAnotherCaIsRefused) {
  REQUIRE_CERTS();
  const std::string addr = StartCoordinator(ServerTls());
  const std::string socket = StartSidecar(
      addr,
      {"--tls_ca=" + F("ca.crt"), "--tls_cert=" + F("rogue.crt"), "--tls_key=" + F("rogue.key")});
  ASSERT_TRUE(sidecar_->WaitForLine("coordinator stream ended", Deadline()).ok());
  absl::StatusOr<Decision> d = OneDecision(socket, "", absl::Seconds(3));
  EXPECT_FALSE(d.ok());
  EXPECT_THAT(coordinator_->Output(), Not(HasSubstr("job-a")));
}

TEST_F(DaemonsSecurityTest, SidecarTrustingTheWrongCaFailsWithAClearError) {
  REQUIRE_CERTS();
  const std::string addr = StartCoordinator(ServerTls());
  StartSidecar(addr, {"--tls_ca=" + F("wrong_ca.crt"), "--tls_cert=" + F("client.crt"),
                      "--tls_key=" + F("client.key")});
  absl::StatusOr<std::string> line = sidecar_->WaitForLine("coordinator stream ended", Deadline());
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_THAT(*line, HasSubstr("TLS handshake with the coordinator failed")) << *line;
  EXPECT_THAT(*line, HasSubstr("--tls_ca")) << *line;
}

TEST_F(DaemonsSecurityTest, PlaintextSidecarToTlsCoordinatorFails) {
  REQUIRE_CERTS();
  const std::string addr = StartCoordinator(ServerTls());
  const std::string socket = StartSidecar(addr, {});
  absl::StatusOr<std::string> line = sidecar_->WaitForLine("coordinator stream ended", Deadline());
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_THAT(*line, HasSubstr("TLS")) << *line;
  // And a plaintext gRPC health check cannot talk to the TLS port.
  EXPECT_FALSE(WaitHealthy(addr, absl::Now() + absl::Seconds(2)).ok());
  absl::StatusOr<Decision> d = OneDecision(socket, "", absl::Seconds(3));
  EXPECT_FALSE(d.ok());
}

TEST_F(DaemonsSecurityTest, NonLoopbackListenWithoutTlsNeedsExplicitPlaintext) {
  auto p = ChildProcess::Spawn({ACCORD_COORDINATOR_BIN, "--listen=0.0.0.0:0", "--metrics_port=-1"},
                               "coordinator", /*echo=*/false);
  ASSERT_TRUE(p.ok());
  absl::StatusOr<int> rc = (*p)->Wait(Deadline());
  ASSERT_TRUE(rc.ok());
  EXPECT_EQ(*rc, 2);
  EXPECT_THAT((*p)->FinalOutput(), HasSubstr("--plaintext"));
  auto s = ChildProcess::Spawn({ACCORD_SIDECAR_BIN, "--coordinator=10.255.255.1:7070",
                                "--socket=" + F("never.sock"), "--metrics_port=-1"},
                               "sidecar", /*echo=*/false);
  ASSERT_TRUE(s.ok());
  rc = (*s)->Wait(Deadline());
  ASSERT_TRUE(rc.ok());
  EXPECT_EQ(*rc, 2);
  EXPECT_THAT((*s)->FinalOutput(), HasSubstr("--tls_ca"));
}

// Both daemons that serve TCP build their credentials in one place
// (daemon/common/server_credentials.h) and say so when they serve in clear
// text.
TEST_F(DaemonsSecurityTest, TcpServingDaemonsWarnWhenServingWithoutTls) {
  const std::string addr = StartCoordinator({"--plaintext"});
  ASSERT_FALSE(addr.empty());
  EXPECT_TRUE(coordinator_->WaitForLine("serving without TLS (--plaintext)", Deadline()).ok())
      << coordinator_->Output();
  ASSERT_FALSE(StartRelay(addr, {"--plaintext"}).empty());
  EXPECT_TRUE(relay_->WaitForLine("serving without TLS (--plaintext)", Deadline()).ok())
      << relay_->Output();
}

TEST_F(DaemonsSecurityTest, TcpServingDaemonsWarnOnTlsWithoutClientCa) {
  REQUIRE_CERTS();
  const std::vector<std::string> tls_no_ca = {"--tls_cert=" + F("server.crt"),
                                              "--tls_key=" + F("server.key")};
  const std::string addr = StartCoordinator(tls_no_ca);
  ASSERT_FALSE(addr.empty());
  EXPECT_TRUE(coordinator_->WaitForLine("TLS without --tls_ca", Deadline()).ok())
      << coordinator_->Output();
  std::vector<std::string> relay_flags = tls_no_ca;
  relay_flags.push_back("--upstream_tls_ca=" + F("ca.crt"));
  ASSERT_FALSE(StartRelay(addr, relay_flags).empty());
  EXPECT_TRUE(relay_->WaitForLine("TLS without --tls_ca", Deadline()).ok()) << relay_->Output();
}

TEST_F(DaemonsSecurityTest, HealthPortServesPlaintextHealthBesideTls) {
  REQUIRE_CERTS();
  // A free port for --health_port (the one flag that cannot be 0).
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  close(fd);
  std::vector<std::string> flags = ServerTls();
  flags.push_back(absl::StrCat("--health_port=", port));
  StartCoordinator(flags);
  EXPECT_TRUE(WaitHealthy(absl::StrCat("127.0.0.1:", port), Deadline()).ok());
  // Nothing but health on that port: the key-value service is not there.
  auto stub = v1::KeyValueService::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::KeyValueGetRequest req;
  req.set_job_id("job-a");
  req.add_keys("k");
  v1::KeyValueGetResponse resp;
  EXPECT_EQ(stub->Get(&ctx, req, &resp).error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

// A relay between sidecar and coordinator: mutual TLS on both of its sides
// (it serves the sidecar with the server certificate and verifies client
// certificates; it dials the coordinator with the client certificate).
TEST_F(DaemonsSecurityTest, MutualTlsOnBothSidesOfARelayARankGetsADecision) {
  REQUIRE_CERTS();
  const std::string addr = StartCoordinator(ServerTls());
  std::vector<std::string> relay_flags = ServerTls();
  for (const std::string& f :
       {"--upstream_tls_ca=" + F("ca.crt"), "--upstream_tls_cert=" + F("client.crt"),
        "--upstream_tls_key=" + F("client.key")}) {
    relay_flags.push_back(f);
  }
  const std::string relay = StartRelay(addr, relay_flags);
  const std::string socket = StartSidecar(
      relay,
      {"--tls_ca=" + F("ca.crt"), "--tls_cert=" + F("client.crt"), "--tls_key=" + F("client.key")});
  absl::StatusOr<Decision> d = OneDecision(socket, "", absl::Seconds(60));
  ASSERT_TRUE(d.ok()) << d.status() << "\n" << relay_->Output();
  EXPECT_EQ(d->included, (std::vector<bool>{true, false}));
  EXPECT_THAT(coordinator_->Output(), HasSubstr("by node \"relay0\""));
}

// Job tokens through a relay: the relay checks each sidecar's hello against
// its --tokens_file exactly as the coordinator does, and the coordinator
// checks the token the relay forwards.
TEST_F(DaemonsSecurityTest, JobTokensThroughARelay) {
  std::ofstream(F("tokens")) << "# test\njob-a tokA\njob-b tokB\n";
  std::ofstream(F("token-b")) << "tokB\n";
  std::ofstream(F("token-a")) << "tokA\n";
  const std::string addr = StartCoordinator({"--tokens_file=" + F("tokens")});
  const std::string relay = StartRelay(addr, {"--tokens_file=" + F("tokens")});
  std::string socket = StartSidecar(relay, {"--token_file=" + F("token-b")}, "wrong-relay.sock");
  absl::StatusOr<Decision> d = OneDecision(socket, "", absl::Seconds(30));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kPermissionDenied) << d.status();
  EXPECT_THAT(d.status().message(), HasSubstr("job-a"));
  EXPECT_THAT(d.status().message(), Not(HasSubstr("tokB")));
  sidecar_.reset();
  socket = StartSidecar(relay, {"--token_file=" + F("token-a")}, "right-relay.sock");
  d = OneDecision(socket, "tokA", absl::Seconds(60));
  EXPECT_TRUE(d.ok()) << d.status() << "\n" << relay_->Output();
}

TEST_F(DaemonsSecurityTest, JobTokensEndToEnd) {
  std::ofstream(F("tokens")) << "# test\njob-a tokA\njob-b tokB\n";
  std::ofstream(F("token-b")) << "tokB\n";
  const std::string addr = StartCoordinator({"--tokens_file=" + F("tokens")});
  // Another job's token: the coordinator refuses the sidecar's hello and the
  // rank gets PERMISSION_DENIED.
  std::string socket = StartSidecar(addr, {"--token_file=" + F("token-b")}, "wrong.sock");
  absl::StatusOr<Decision> d = OneDecision(socket, "", absl::Seconds(30));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kPermissionDenied) << d.status();
  EXPECT_THAT(d.status().message(), HasSubstr("job-a"));
  EXPECT_THAT(d.status().message(), Not(HasSubstr("tokB")));
  sidecar_.reset();
  // The right token through ACCORD_TOKEN: a decision; a rank presenting a
  // different token is refused by the sidecar.
  setenv("ACCORD_TOKEN", "tokA", 1);
  socket = StartSidecar(addr, {}, "right.sock");
  unsetenv("ACCORD_TOKEN");
  absl::StatusOr<Decision> bad = OneDecision(socket, "tokB", absl::Seconds(30));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kPermissionDenied) << bad.status();
  d = OneDecision(socket, "tokA", absl::Seconds(60));
  EXPECT_TRUE(d.ok()) << d.status();
  EXPECT_THAT(coordinator_->Output(), HasSubstr("permission denied"));
}

// connect(2) to `path` as uid/gid in a forked child: 0 on success, else errno.
int ConnectAs(const std::string& path, uid_t uid, gid_t gid) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (setgroups(0, nullptr) != 0 || setgid(gid) != 0 || setuid(uid) != 0) _exit(200);
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
    const int rc = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    _exit(rc == 0 ? 0 : (errno & 0x7f));
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_F(DaemonsSecurityTest, RankSocketIs0660AndRefusesOtherUsers) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as another user (setuid)";
  constexpr uid_t kStranger = 54321;
  constexpr gid_t kStrangerGroup = 54321;
  constexpr gid_t kRankGroup = 54322;
  const std::string addr = StartCoordinator({});
  const std::string socket =
      StartSidecar(addr, {absl::StrCat("--socket_group=", kRankGroup)}, "perm.sock");
  struct stat st {};
  ASSERT_EQ(stat(socket.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0660u);
  EXPECT_EQ(st.st_gid, kRankGroup);
  // The directory is world-searchable, so only the socket's mode decides.
  EXPECT_EQ(ConnectAs(socket, kStranger, kStrangerGroup), EACCES);
  EXPECT_EQ(ConnectAs(socket, kStranger, kRankGroup), 0);
}

}  // namespace
}  // namespace accord::testing
