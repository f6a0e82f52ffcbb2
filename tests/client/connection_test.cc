// The client's connection state machine (client/connection.h), driven alone:
// no gRPC, no thread, time passed in.
#include "client/connection.h"

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace accord {
namespace {

using ::testing::HasSubstr;
using Phase = ClientConnection::Phase;
using StreamPhase = ClientConnection::StreamPhase;

const absl::Time kT0 = absl::FromUnixSeconds(1000);

ClientOptions Options(absl::Duration reconnect_grace = absl::Seconds(10)) {
  ClientOptions o;
  o.socket_path = "/tmp/sidecar.sock";
  o.job_id = "job-a";
  o.rank = 3;
  o.world_size = 4;
  o.connect_timeout = absl::Seconds(30);
  o.reconnect_grace = reconnect_grace;
  return o;
}

ClientConnection::StreamEnd Unavailable() { return {false, true, "connection refused"}; }
ClientConnection::StreamEnd Dropped() { return {false, false, "stream reset"}; }

// A started connection whose first stream was welcomed at kT0.
ClientConnection Welcomed(absl::Duration reconnect_grace = absl::Seconds(10)) {
  ClientConnection c(Options(reconnect_grace), /*seed=*/1);
  c.Start(kT0);
  c.StreamOpened();
  c.Welcomed("node-1", "run-1", 7, kT0);
  return c;
}

TEST(ClientConnectionTest, WelcomeMovesConnectingToWelcomedAndKeepsTheResumeFacts) {
  ClientConnection c(Options(), 1);
  c.Start(kT0);
  EXPECT_EQ(c.phase(), Phase::kConnecting);
  EXPECT_EQ(c.connect_deadline(), kT0 + absl::Seconds(30));
  EXPECT_FALSE(c.Welcomed("node-1", "run-1", 7, kT0).has_value());
  EXPECT_TRUE(c.welcomed());
  EXPECT_TRUE(c.CallStatus().ok());
  EXPECT_EQ(c.node_id(), "node-1");
  EXPECT_EQ(c.run_id(), "run-1");
  EXPECT_EQ(c.node_epoch(), 7u);
  // A welcome without a run id or epoch keeps the last ones.
  c.Welcomed("node-1", "", 0, kT0);
  EXPECT_EQ(c.run_id(), "run-1");
  EXPECT_EQ(c.node_epoch(), 7u);
}

TEST(ClientConnectionTest, StreamIsOverOnlyOnceReaderAndWriterStoppedInEitherOrder) {
  ClientConnection c(Options(), 1);
  c.StreamOpened();
  c.ReadEnded();
  EXPECT_EQ(c.stream_phase(), StreamPhase::kReadEnded);
  EXPECT_TRUE(c.read_ended());
  EXPECT_FALSE(c.writer_stopped());
  c.WriterStopped();
  EXPECT_EQ(c.stream_phase(), StreamPhase::kOver);
  c.StreamOpened();
  c.WriterStopped();
  EXPECT_EQ(c.stream_phase(), StreamPhase::kWriterStopped);
  EXPECT_FALSE(c.read_ended());
  c.ReadEnded();
  EXPECT_EQ(c.stream_phase(), StreamPhase::kOver);
}

TEST(ClientConnectionTest, UnreachableSidecarBeforeTheFirstWelcomeIsTriedAgainWithBackoff) {
  ClientConnection c(Options(), 1);
  c.Start(kT0);
  ClientConnection::AfterEnd after = c.StreamEnded(Unavailable(), kT0);
  ASSERT_FALSE(after.close.has_value());
  EXPECT_TRUE(after.first_miss);
  EXPECT_GE(after.retry_at, kT0 + absl::Milliseconds(25));
  EXPECT_LE(after.retry_at, kT0 + absl::Milliseconds(50));
  ClientConnection::Next next = c.RetryDue(after.retry_at);
  EXPECT_FALSE(next.close.has_value());
  EXPECT_FALSE(next.resume);
  EXPECT_EQ(c.phase(), Phase::kConnecting);
  // The second miss is not news.
  after = c.StreamEnded(Unavailable(), after.retry_at);
  EXPECT_FALSE(after.first_miss);
  EXPECT_FALSE(after.close.has_value());
}

TEST(ClientConnectionTest, FirstStreamClosesAtTheConnectTimeoutNamingTheSocket) {
  ClientConnection c(Options(), 1);
  c.Start(kT0);
  ClientConnection::AfterEnd after = c.StreamEnded(Unavailable(), kT0 + absl::Seconds(30));
  ASSERT_TRUE(after.close.has_value());
  EXPECT_EQ(after.close->code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(after.close->message(), HasSubstr("cannot reach the sidecar at /tmp/sidecar.sock"));
  EXPECT_TRUE(c.closed());
  EXPECT_EQ(c.CallStatus(), *after.close);
}

// The connect timeout can fall while an attempt is under way (its end not
// seen yet): a sidecar that no attempt reached is named unreachable, with the
// last attempt's words, unless the attempt under way connected.
TEST(ClientConnectionTest, AConnectTimeoutWithoutAWelcomeSaysWhetherTheSidecarWasReached) {
  ClientConnection c(Options(), 1);
  c.Start(kT0);
  absl::Status none = c.ConnectTimedOut(/*connected=*/false);  // no attempt ended yet
  EXPECT_EQ(none.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(none.message(), HasSubstr("no welcome from the sidecar at /tmp/sidecar.sock"));
  ASSERT_FALSE(c.StreamEnded(Unavailable(), kT0).close.has_value());
  absl::Status missed = c.ConnectTimedOut(/*connected=*/false);
  EXPECT_EQ(missed.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(missed.message(), HasSubstr("cannot reach the sidecar at /tmp/sidecar.sock"));
  EXPECT_THAT(missed.message(), HasSubstr("connection refused"));
  EXPECT_EQ(c.ConnectTimedOut(/*connected=*/true).code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(ClientConnectionTest, FirstStreamEndingOtherwiseClosesAtOnce) {
  ClientConnection c(Options(), 1);
  c.Start(kT0);
  ClientConnection::AfterEnd after = c.StreamEnded(Dropped(), kT0);
  ASSERT_TRUE(after.close.has_value());
  EXPECT_THAT(after.close->message(), HasSubstr("stream reset"));
  EXPECT_EQ(c.phase(), Phase::kClosed);
}

TEST(ClientConnectionTest, LostStreamReconnectsWithAResumeAndResumingReportsTheGap) {
  ClientConnection c = Welcomed();
  const absl::Time lost = kT0 + absl::Seconds(5);
  ClientConnection::AfterEnd after = c.StreamEnded(Dropped(), lost);
  ASSERT_FALSE(after.close.has_value());
  EXPECT_TRUE(after.lost);
  EXPECT_TRUE(c.reconnecting());
  EXPECT_LE(after.retry_at, lost + absl::Milliseconds(50));
  ClientConnection::Next next = c.RetryDue(after.retry_at);
  ASSERT_FALSE(next.close.has_value());
  EXPECT_TRUE(next.resume);
  // A failed attempt is not a new loss: the grace still counts from `lost`.
  after = c.StreamEnded(Unavailable(), lost + absl::Seconds(1));
  EXPECT_FALSE(after.lost);
  next = c.RetryDue(after.retry_at);
  ASSERT_TRUE(next.resume);
  std::optional<absl::Duration> gap = c.Welcomed("node-1", "run-1", 8, lost + absl::Seconds(2));
  ASSERT_TRUE(gap.has_value());
  EXPECT_EQ(*gap, absl::Seconds(2));
  EXPECT_TRUE(c.welcomed());
}

TEST(ClientConnectionTest, BackoffDoublesUpToItsCapWhileReconnecting) {
  ClientConnection c = Welcomed(absl::Hours(1));
  absl::Time now = kT0;
  absl::Duration longest = absl::ZeroDuration();
  for (int i = 0; i < 8; ++i) {
    ClientConnection::AfterEnd after = c.StreamEnded(Unavailable(), now);
    ASSERT_FALSE(after.close.has_value());
    longest = std::max(longest, after.retry_at - now);
    now = after.retry_at;
    ASSERT_TRUE(c.RetryDue(now).resume);
  }
  EXPECT_GT(longest, ClientConnection::kMaxBackoff / 2 - absl::Milliseconds(1));
  EXPECT_LE(longest, ClientConnection::kMaxBackoff);
}

TEST(ClientConnectionTest, PastTheGraceOneLastTryIsMadeBeforeTheSidecarIsJudgedGone) {
  ClientConnection c = Welcomed(absl::Seconds(1));
  ClientConnection::AfterEnd after = c.StreamEnded(Dropped(), kT0);
  const absl::Time past_grace = kT0 + absl::Seconds(2);
  // The first attempt that begins past the grace is still made.
  ClientConnection::Next next = c.RetryDue(past_grace);
  ASSERT_FALSE(next.close.has_value());
  EXPECT_TRUE(next.resume);
  // It failed too: the session is over, in words naming the node and socket.
  after = c.StreamEnded(Unavailable(), past_grace);
  EXPECT_LE(after.retry_at, past_grace);
  next = c.RetryDue(past_grace);
  ASSERT_TRUE(next.close.has_value());
  EXPECT_EQ(next.close->code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(next.close->message(),
              HasSubstr("the sidecar of node \"node-1\" at /tmp/sidecar.sock closed"));
  EXPECT_TRUE(c.closed());
}

TEST(ClientConnectionTest, WithoutAReconnectGraceALostStreamClosesTheSession) {
  ClientConnection c = Welcomed(absl::ZeroDuration());
  ClientConnection::AfterEnd after = c.StreamEnded(Dropped(), kT0);
  ASSERT_TRUE(after.close.has_value());
  EXPECT_THAT(after.close->message(), HasSubstr("does not reconnect"));
  EXPECT_THAT(after.close->message(), HasSubstr(": stream reset"));
}

TEST(ClientConnectionTest, FatalErrorFailsCallsAtOnceAndClosesWithItWhenTheStreamEnds) {
  ClientConnection c = Welcomed();
  const absl::Status denied = absl::PermissionDeniedError("bad token");
  c.FatalError(denied);
  EXPECT_EQ(c.CallStatus(), denied);
  EXPECT_FALSE(c.closed());
  ClientConnection::AfterEnd after = c.StreamEnded(Dropped(), kT0);
  ASSERT_TRUE(after.close.has_value());
  EXPECT_EQ(*after.close, denied);
  EXPECT_TRUE(c.closed());
}

TEST(ClientConnectionTest, StopEndsAWaitAsCancelledInEitherPhase) {
  ClientConnection connecting(Options(), 1);
  connecting.Start(kT0);
  ASSERT_FALSE(connecting.StreamEnded(Unavailable(), kT0).close.has_value());
  connecting.RequestStop();
  ClientConnection::Next next = connecting.RetryDue(kT0);
  ASSERT_TRUE(next.close.has_value());
  EXPECT_EQ(next.close->code(), absl::StatusCode::kCancelled);

  ClientConnection welcomed = Welcomed();
  welcomed.RequestStop();
  ClientConnection::AfterEnd after = welcomed.StreamEnded(Dropped(), kT0);
  ASSERT_TRUE(after.close.has_value());
  EXPECT_EQ(after.close->code(), absl::StatusCode::kCancelled);
}

TEST(ClientConnectionTest, LocalDecisionIsRemembered) {
  ClientConnection c = Welcomed();
  EXPECT_FALSE(c.holds_local_decisions());
  c.NoteLocalDecision();
  EXPECT_TRUE(c.holds_local_decisions());
}

}  // namespace
}  // namespace accord
