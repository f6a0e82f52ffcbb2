// Client library against an in-process fake sidecar (tests/client/fake_sidecar.h).
#include "client/client.h"

#include <cstdlib>
#include <memory>
#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fake_sidecar.h"

namespace accord {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kLong = absl::Seconds(30);

GroupSpec ThreeParams(const std::string& id = "g") {
  return GroupSpec{id, {{"w", 8, 64}, {"b", 8, 8}, {"v", 4, 16}}};
}

class ClientTest : public ::testing::Test {
 protected:
  void StartFake(int world) {
    fake_ = std::make_unique<testing::FakeSidecar>(world);
    fake_->Start();
  }
  ClientOptions Options(int rank, int world) {
    ClientOptions o;
    o.socket_path = fake_->socket_path();
    o.job_id = "job";
    o.rank = rank;
    o.world_size = world;
    o.connect_timeout = kLong;
    o.reconnect_grace = reconnect_grace_;
    return o;
  }
  std::vector<std::unique_ptr<Client>> ConnectAll(int world) {
    std::vector<std::unique_ptr<Client>> out;
    for (int r = 0; r < world; ++r) {
      absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(Options(r, world));
      EXPECT_TRUE(c.ok()) << c.status();
      if (c.ok()) out.push_back(*std::move(c));
    }
    return out;
  }
  // Registers on every client concurrently (the fake answers when all did).
  void RegisterAll(std::vector<std::unique_ptr<Client>>& clients, const GroupSpec& spec,
                   const Policy& policy = Policy()) {
    std::vector<std::thread> threads;
    std::vector<absl::Status> results(clients.size());
    for (size_t i = 0; i < clients.size(); ++i) {
      threads.emplace_back(
          [&, i] { results[i] = clients[i]->RegisterGroup(spec, policy, absl::Now() + kLong); });
    }
    for (auto& t : threads) t.join();
    for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
  }

  std::unique_ptr<testing::FakeSidecar> fake_;
  // Most tests pin what a session without reconnects does.
  absl::Duration reconnect_grace_ = absl::ZeroDuration();
};

// The hello names the rank's launch (RankHello.launch_id): the option, else
// ACCORD_LAUNCH_ID, else torchrun's run id and restart count, else none.
TEST_F(ClientTest, TheHelloNamesTheLaunchFromTheOptionOrTheEnvironment) {
  StartFake(1);
  auto launch_of_hello = [&](const std::string& option) {
    ClientOptions o = Options(0, 1);
    o.launch_id = option;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    c->reset();
    std::string launch = "(no hello)";
    for (const v1::RankMessage& m : fake_->Received()) {
      if (m.has_hello()) launch = m.hello().launch_id();
    }
    return launch;
  };
  unsetenv("ACCORD_LAUNCH_ID");
  unsetenv("TORCHELASTIC_RUN_ID");
  unsetenv("TORCHELASTIC_RESTART_COUNT");
  EXPECT_EQ(launch_of_hello(""), "");
  setenv("TORCHELASTIC_RUN_ID", "abc", 1);
  EXPECT_EQ(launch_of_hello(""), "") << "a run id without a restart count names no launch";
  setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  EXPECT_EQ(launch_of_hello(""), "torchrun:abc:2");
  setenv("TORCHELASTIC_RUN_ID", "none", 1);
  EXPECT_EQ(launch_of_hello(""), "")
      << "torchrun's run id without --rdzv-id is \"none\" for every launch: no launch id";
  setenv("ACCORD_LAUNCH_ID", "mine", 1);
  EXPECT_EQ(launch_of_hello(""), "mine");
  EXPECT_EQ(launch_of_hello("given"), "given");
  unsetenv("ACCORD_LAUNCH_ID");
  unsetenv("TORCHELASTIC_RUN_ID");
  unsetenv("TORCHELASTIC_RESTART_COUNT");
}

TEST_F(ClientTest, ConnectToMissingSocketIsUnavailableAndNamesThePath) {
  ClientOptions o;
  o.socket_path = "/tmp/accord-no-such-dir/sidecar.sock";
  o.job_id = "job";
  o.rank = 0;
  o.world_size = 1;
  o.connect_timeout = absl::Seconds(2);  // tried again until then (the default is 30 s)
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(c.status().message(), HasSubstr("/tmp/accord-no-such-dir/sidecar.sock"));
  EXPECT_THAT(c.status().message(), HasSubstr("within 2s"));
}

TEST_F(ClientTest, InvalidOptionsAreRejectedBeforeConnecting) {
  StartFake(1);
  ClientOptions o = Options(3, 2);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fake_->sessions_started(), 0);
}

TEST_F(ClientTest, HelloRejectedBySidecarReturnsItsCodeAndMessage) {
  StartFake(1);
  v1::DecisionError e;
  e.set_kind(v1::DUPLICATE_RANK);
  e.set_code(static_cast<int>(absl::StatusCode::kAlreadyExists));
  e.set_message("rank 0 of job \"job\" already joined");
  fake_->RejectHellos(e);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(Options(0, 1));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(c.status().message(), HasSubstr("already joined"));
}

TEST_F(ClientTest, TwoRanksGetTheSameDecisionWithZeroFillAndSkip) {
  StartFake(2);
  auto clients = ConnectAll(2);
  ASSERT_EQ(clients.size(), 2u);
  RegisterAll(clients, ThreeParams());
  // Rank 0 uses w and b; rank 1 uses only w; nobody uses v.
  DecisionFuture f0 =
      clients[0]->Submit({"g", 0, {DType::kFloat32, DType::kFloat32, std::nullopt}});
  DecisionFuture f1 = clients[1]->Submit({"g", 0, {DType::kFloat32, std::nullopt, std::nullopt}});
  absl::StatusOr<Decision> d0 = clients[0]->Wait(f0, absl::Now() + kLong);
  absl::StatusOr<Decision> d1 = clients[1]->Wait(f1, absl::Now() + kLong);
  ASSERT_TRUE(d0.ok()) << d0.status();
  ASSERT_TRUE(d1.ok()) << d1.status();
  EXPECT_EQ(*d0, *d1);
  EXPECT_EQ(d0->wire_dtype, DType::kFloat32);
  EXPECT_EQ(d0->included, (std::vector<bool>{true, true, false}));
  EXPECT_TRUE(f0.Ready());
  ASSERT_TRUE(clients[0]->Group("g").ok());
  EXPECT_EQ(*clients[0]->Group("g"), ThreeParams());
}

TEST_F(ClientTest, Fp16OnOneRankAndBf16OnAnotherGoOnTheWireAsFp32) {
  StartFake(2);
  auto clients = ConnectAll(2);
  ASSERT_EQ(clients.size(), 2u);
  RegisterAll(clients, ThreeParams());
  DecisionFuture f0 =
      clients[0]->Submit({"g", 1, {DType::kFloat16, DType::kFloat16, std::nullopt}});
  DecisionFuture f1 =
      clients[1]->Submit({"g", 1, {DType::kBFloat16, DType::kBFloat16, std::nullopt}});
  absl::StatusOr<Decision> d0 = clients[0]->Wait(f0, absl::Now() + kLong);
  absl::StatusOr<Decision> d1 = clients[1]->Wait(f1, absl::Now() + kLong);
  ASSERT_TRUE(d0.ok()) << d0.status();
  ASSERT_TRUE(d1.ok()) << d1.status();
  EXPECT_EQ(d0->wire_dtype, DType::kFloat32);
  EXPECT_EQ(*d0, *d1);
}

TEST_F(ClientTest, RepeatedContentTravelsAsRepeatAndSameAsPreviousResolvesWithTheNewStep) {
  StartFake(1);
  auto clients = ConnectAll(1);
  ASSERT_EQ(clients.size(), 1u);
  RegisterAll(clients, ThreeParams());
  std::vector<std::optional<DType>> usage = {DType::kBFloat16, std::nullopt, DType::kBFloat16};
  std::vector<Decision> decisions;
  for (int64_t step = 0; step < 3; ++step) {
    DecisionFuture f = clients[0]->Submit({"g", step, usage});
    absl::StatusOr<Decision> d = clients[0]->Wait(f, absl::Now() + kLong);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->step, step);
    decisions.push_back(*d);
  }
  EXPECT_EQ(decisions[2].included, decisions[0].included);
  EXPECT_EQ(decisions[2].wire_dtype, DType::kBFloat16);
  EXPECT_EQ(decisions[2].layout_fingerprint, decisions[0].layout_fingerprint);
  std::vector<bool> repeats;
  for (const v1::RankMessage& m : fake_->Received()) {
    if (!m.has_manifests()) continue;
    for (const v1::Manifest& pm : m.manifests().manifests()) repeats.push_back(pm.repeat());
  }
  EXPECT_EQ(repeats, (std::vector<bool>{false, true, true}));
}

TEST_F(ClientTest, ChangedContentAfterRepeatsIsSentInFull) {
  StartFake(1);
  auto clients = ConnectAll(1);
  ASSERT_EQ(clients.size(), 1u);
  RegisterAll(clients, ThreeParams());
  const std::vector<std::optional<DType>> a = {DType::kFloat32, std::nullopt, DType::kFloat32};
  const std::vector<std::optional<DType>> b = {DType::kFloat32, DType::kFloat32, DType::kFloat32};
  for (int64_t step = 0; step < 3; ++step) {
    DecisionFuture f = clients[0]->Submit({"g", step, step == 2 ? b : a});
    absl::StatusOr<Decision> d = clients[0]->Wait(f, absl::Now() + kLong);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->included[1], step == 2);
  }
  std::vector<bool> repeats;
  for (const v1::RankMessage& m : fake_->Received()) {
    if (!m.has_manifests()) continue;
    for (const v1::Manifest& pm : m.manifests().manifests()) repeats.push_back(pm.repeat());
  }
  EXPECT_EQ(repeats, (std::vector<bool>{false, true, false}));
}

TEST_F(ClientTest, SubmitBatchSendsOneMessageForManyGroups) {
  StartFake(1);
  auto clients = ConnectAll(1);
  ASSERT_EQ(clients.size(), 1u);
  for (const char* id : {"a", "b", "c"}) RegisterAll(clients, ThreeParams(id));
  std::vector<GroupSubmission> batch;
  for (const char* id : {"a", "b", "c"}) {
    batch.push_back({id, 0, {DType::kFloat32, DType::kFloat32, DType::kFloat32}});
  }
  std::vector<DecisionFuture> fs = clients[0]->SubmitBatch(batch);
  ASSERT_EQ(fs.size(), 3u);
  for (const DecisionFuture& f : fs) {
    absl::StatusOr<Decision> d = clients[0]->Wait(f, absl::Now() + kLong);
    ASSERT_TRUE(d.ok()) << d.status();
  }
  int batches = 0;
  for (const v1::RankMessage& m : fake_->Received()) {
    if (!m.has_manifests()) continue;
    ++batches;
    EXPECT_EQ(m.manifests().manifests_size(), 3);
  }
  EXPECT_EQ(batches, 1);
}

TEST_F(ClientTest, BadSubmissionsCompleteTheirFutureWithAPreciseError) {
  StartFake(1);
  auto clients = ConnectAll(1);
  ASSERT_EQ(clients.size(), 1u);
  RegisterAll(clients, ThreeParams());
  Client& c = *clients[0];
  absl::StatusOr<Decision> unknown =
      c.Wait(c.Submit({"nope", 0, {DType::kFloat32}}), absl::Now() + kLong);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(unknown.status().message(), HasSubstr("\"nope\""));
  absl::StatusOr<Decision> count =
      c.Wait(c.Submit({"g", 0, {DType::kFloat32}}), absl::Now() + kLong);
  EXPECT_EQ(count.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(count.status().message(), HasSubstr("1 entries but the group registered 3"));
  ASSERT_TRUE(c.Wait(c.Submit({"g", 5, {DType::kFloat32, DType::kFloat32, DType::kFloat32}}),
                     absl::Now() + kLong)
                  .ok());
  absl::StatusOr<Decision> back = c.Wait(
      c.Submit({"g", 4, {DType::kFloat32, DType::kFloat32, DType::kFloat32}}), absl::Now() + kLong);
  EXPECT_EQ(back.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(back.status().message(), HasSubstr("already submitted step 5"));
}

TEST_F(ClientTest, WaitPastTheCallersDeadlineIsALocalTimeout) {
  StartFake(2);
  auto clients = ConnectAll(2);
  ASSERT_EQ(clients.size(), 2u);
  RegisterAll(clients, ThreeParams());
  // Rank 1 never submits, so the fake never decides.
  DecisionFuture f = clients[0]->Submit({"g", 0, {DType::kFloat32, std::nullopt, std::nullopt}});
  absl::StatusOr<Decision> d = clients[0]->Wait(f, absl::Now());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(IsLocalTimeout(d.status())) << d.status();
  EXPECT_THAT(d.status().message(), HasSubstr("step 0"));
  EXPECT_FALSE(f.Ready());
}

TEST_F(ClientTest, RegistrationPastTheCallersDeadlineIsALocalTimeout) {
  StartFake(2);
  auto clients = ConnectAll(2);
  ASSERT_EQ(clients.size(), 2u);
  // Rank 1 never registers, so the fake never answers.
  absl::Status s = clients[0]->RegisterGroup(ThreeParams(), Policy(), absl::Now());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(IsLocalTimeout(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("group \"g\""));
}

TEST_F(ClientTest, TheCoordinatorsDeadlineVerdictIsNotALocalTimeout) {
  StartFake(2);
  auto clients = ConnectAll(2);
  ASSERT_EQ(clients.size(), 2u);
  RegisterAll(clients, ThreeParams());
  DecisionFuture f = clients[0]->Submit({"g", 0, {DType::kFloat32, std::nullopt, std::nullopt}});
  v1::DecisionError e;
  e.set_kind(v1::MISSING_RANKS);
  e.set_code(static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  e.set_message("job \"job\" group \"g\" step 0: not every rank reported; missing ranks 1");
  e.set_group_id("g");
  e.set_step(0);
  e.set_job_failed(true);
  fake_->SendErrorToAll(e);
  absl::StatusOr<Decision> d = clients[0]->Wait(f, absl::Now() + kLong);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(IsLocalTimeout(d.status())) << d.status();
  EXPECT_THAT(d.status().message(), HasSubstr("missing ranks 1"));
  EXPECT_TRUE(f.Ready());
}

TEST_F(ClientTest, MalformedIncludedBitsAreRejected) {
  StartFake(1);
  fake_->MutateDecisions([](v1::Decision* d) { d->mutable_ok()->set_included_bits("\x01\x00"); });
  auto clients = ConnectAll(1);
  ASSERT_EQ(clients.size(), 1u);
  RegisterAll(clients, ThreeParams());
  absl::StatusOr<Decision> d = clients[0]->Wait(
      clients[0]->Submit({"g", 0, {DType::kFloat32, DType::kFloat32, DType::kFloat32}}),
      absl::Now() + kLong);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(d.status().message(), HasSubstr("malformed decision for group \"g\" step 0"));
}

TEST_F(ClientTest, WrongLayoutFingerprintIsRejected) {
  StartFake(1);
  fake_->MutateDecisions([](v1::Decision* d) {
    d->mutable_ok()->set_layout_fingerprint(d->ok().layout_fingerprint() ^ 1);
  });
  auto clients = ConnectAll(1);
  ASSERT_EQ(clients.size(), 1u);
  RegisterAll(clients, ThreeParams());
  absl::StatusOr<Decision> d = clients[0]->Wait(
      clients[0]->Submit({"g", 0, {DType::kFloat32, DType::kFloat32, DType::kFloat32}}),
      absl::Now() + kLong);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(d.status().message(), HasSubstr("layout fingerprint"));
}

TEST_F(ClientTest, SidecarClosingTheStreamFailsPendingAndLaterWorkAsUnavailable) {
  StartFake(2);
  auto clients = ConnectAll(2);
  ASSERT_EQ(clients.size(), 2u);
  RegisterAll(clients, ThreeParams());
  DecisionFuture f = clients[0]->Submit({"g", 0, {DType::kFloat32, std::nullopt, std::nullopt}});
  fake_->CloseSessions();
  absl::StatusOr<Decision> d = clients[0]->Wait(f, absl::Now() + kLong);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(d.status().message(),
              HasSubstr("sidecar at " + fake_->socket_path() + " closed the connection"));
  absl::StatusOr<Decision> later =
      clients[0]->Wait(clients[0]->Submit({"g", 1, {DType::kFloat32, std::nullopt, std::nullopt}}),
                       absl::Now() + kLong);
  EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable);
}

// A dropped stream (docs/RELIABILITY.md, "Sidecar restart"): the client
// reconnects, says what it holds (per group, the last step it has a
// decision for) and resends its registration and its undecided manifest in
// full form; the pending future then gets its decision.
TEST_F(ClientTest, ADroppedStreamIsResumedAndThePendingStepDecided) {
  reconnect_grace_ = kLong;
  StartFake(2);
  auto clients = ConnectAll(2);
  ASSERT_EQ(clients.size(), 2u);
  RegisterAll(clients, ThreeParams());
  const GroupSubmission s0{"g", 0, {DType::kFloat32, std::nullopt, std::nullopt}};
  std::vector<DecisionFuture> step0 = {clients[0]->Submit(s0), clients[1]->Submit(s0)};
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(clients[r]->Wait(step0[r], absl::Now() + kLong).ok());
  const GroupSubmission s1{"g", 1, {DType::kFloat32, DType::kBFloat16, std::nullopt}};
  DecisionFuture pending = clients[0]->Submit(s1);
  fake_->DropSessions();
  DecisionFuture other = clients[1]->Submit(s1);
  absl::StatusOr<Decision> d = clients[0]->Wait(pending, absl::Now() + kLong);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->step, 1);
  EXPECT_EQ(d->wire_dtype, DType::kFloat32);
  ASSERT_TRUE(clients[1]->Wait(other, absl::Now() + kLong).ok());
  // Rank 0's resume: its hello, then its registration, then step 1 in full.
  const std::vector<v1::RankMessage> got = fake_->Received();
  int at = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].has_hello() && got[i].hello().rank() == 0 && got[i].hello().has_resume()) {
      at = static_cast<int>(i);
    }
  }
  ASSERT_GE(at, 0) << "no resume hello from rank 0";
  const v1::RankResume& resume = got[at].hello().resume();
  ASSERT_EQ(resume.groups_size(), 1);
  EXPECT_EQ(resume.groups(0).group_id(), "g");
  EXPECT_EQ(resume.groups(0).decided_step(), 0);
  EXPECT_FALSE(resume.holds_local_decisions());
  // The epoch of its welcome: a restarted sidecar goes on as that incarnation.
  EXPECT_EQ(resume.node_epoch(), testing::kFakeNodeEpoch);
  bool resent = false;
  for (size_t i = at + 1; i < got.size(); ++i) {
    for (const v1::Manifest& m : got[i].manifests().manifests()) {
      if (m.step() == 1 && !m.repeat()) resent = true;
    }
  }
  EXPECT_TRUE(resent) << "step 1 was not resent in full form";
}

// The adapter's counts add up in the client, which sends the totals; a
// resumed stream gets the totals again after the hello; counts that cannot
// be are refused without sending anything.
TEST_F(ClientTest, AdapterCountsGoUpAsTotalsAndAgainOnAResumedStream) {
  reconnect_grace_ = kLong;
  StartFake(1);
  auto clients = ConnectAll(1);
  ASSERT_EQ(clients.size(), 1u);
  auto counts_received = [&] {
    std::vector<v1::AdapterCounts> out;
    for (const v1::RankMessage& m : fake_->Received()) {
      if (m.has_adapter_counts()) out.push_back(m.adapter_counts());
    }
    return out;
  };
  auto wait_for = [&](size_t n) {
    const absl::Time until = absl::Now() + kLong;
    while (counts_received().size() < n && absl::Now() < until)
      absl::SleepFor(absl::Milliseconds(5));
    return counts_received();
  };
  ASSERT_TRUE(clients[0]->AddAdapterCounts({16, 2, 1}).ok());
  ASSERT_TRUE(clients[0]->AddAdapterCounts({16, 1, 0}).ok());
  absl::Status bad = clients[0]->AddAdapterCounts({1, 2, 0});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), ::testing::HasSubstr("redone <= repaired <= speculated"));
  std::vector<v1::AdapterCounts> got = wait_for(2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1].speculated(), 32);
  EXPECT_EQ(got[1].repaired(), 3);
  EXPECT_EQ(got[1].redone(), 1);
  fake_->DropSessions();
  got = wait_for(3);
  ASSERT_EQ(got.size(), 3u) << "the totals again on the resumed stream";
  EXPECT_EQ(got[2].speculated(), 32);
  EXPECT_EQ(got[2].repaired(), 3);
}

// A sidecar that never takes the rank back: past the grace every call fails
// with one error naming the node and the socket.
TEST_F(ClientTest, ASidecarNotBackWithinTheGraceFailsEveryCallNamingIt) {
  reconnect_grace_ = absl::Milliseconds(300);
  StartFake(2);
  auto clients = ConnectAll(2);
  ASSERT_EQ(clients.size(), 2u);
  RegisterAll(clients, ThreeParams());
  DecisionFuture f = clients[0]->Submit({"g", 0, {DType::kFloat32, std::nullopt, std::nullopt}});
  fake_->CloseSessions();
  absl::StatusOr<Decision> d = clients[0]->Wait(f, absl::Now() + kLong);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(d.status().message(),
            "job job: the sidecar of node \"fake-node\" at " + fake_->socket_path() +
                " closed its ranks' connections and did not come back within 300ms (the "
                "client's reconnect grace, ClientOptions.reconnect_grace), so this node's ranks "
                "cannot take part: check accord-sidecar on this node (its log, --socket=" +
                fake_->socket_path() + ") and restart the job");
}

TEST_F(ClientTest, SessionWideErrorFailsEveryPendingFuture) {
  StartFake(2);
  auto clients = ConnectAll(2);
  ASSERT_EQ(clients.size(), 2u);
  RegisterAll(clients, ThreeParams());
  DecisionFuture f = clients[0]->Submit({"g", 0, {DType::kFloat32, std::nullopt, std::nullopt}});
  v1::DecisionError e;
  e.set_kind(v1::JOB_FAILED);
  e.set_code(static_cast<int>(absl::StatusCode::kAborted));
  e.set_message("job \"job\" failed: rank 1 left at step -1");
  fake_->SendErrorToAll(e);
  absl::StatusOr<Decision> d = clients[0]->Wait(f, absl::Now() + kLong);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(d.status().message(), HasSubstr("rank 1 left"));
}

TEST_F(ClientTest, KeyValueStoreRoundTripsThroughTheSidecar) {
  StartFake(1);
  auto clients = ConnectAll(1);
  ASSERT_EQ(clients.size(), 1u);
  ASSERT_TRUE(clients[0]->kv().Set("nccl/id", std::string("\x00\x01", 2)).ok());
  absl::StatusOr<std::vector<std::string>> v =
      clients[0]->kv().Get({"nccl/id"}, std::chrono::milliseconds(0));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)[0], std::string("\x00\x01", 2));
  absl::StatusOr<std::vector<std::string>> missing =
      clients[0]->kv().Get({"absent"}, std::chrono::milliseconds(0));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace accord
