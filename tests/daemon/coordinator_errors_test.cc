// The coordinator's typed errors: every error carries its kind, its code
// comes from the kind (wire::CodeOfKind), from its cause, or is
// FAILED_PRECONDITION for a request out of order; every error sent is
// counted once.
#include <memory>

#include "daemon/common/clock.h"
#include "daemon/coordinator/coordinator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon/test_util.h"

namespace accord::daemon {
namespace {

using testing::Batch;
using testing::FakeNodeSink;
using ::testing::HasSubstr;
using testing::Hello;
using testing::MakeSpec;
using testing::NodeManifest;
using testing::Registration;
using testing::Repeat;

int Code(absl::StatusCode c) { return static_cast<int>(c); }

class CoordinatorErrorsTest : public ::testing::Test {
 protected:
  CoordinatorErrorsTest() : coord_(Options(), &clock_) {}
  static CoordinatorOptions Options() {
    CoordinatorOptions o;
    o.start_timer_thread = false;
    return o;
  }
  // Nodes `s` (rank 0) and `t` (rank 1) of a 2-rank job register group "g",
  // rank 0 submits step 0, then rank 1 leaves mid-step: the job fails.
  void FailByALeaveMidStep(Coordinator::SessionId s, Coordinator::SessionId t) {
    coord_.HandleMessage(s, Hello("job", "a", 2, {0}));
    coord_.HandleMessage(t, Hello("job", "b", 2, {1}));
    coord_.HandleMessage(s, Registration(MakeSpec("g", 1), {0}));
    coord_.HandleMessage(t, Registration(MakeSpec("g", 1), {1}));
    coord_.HandleMessage(s, Batch({NodeManifest("g", 0, {DType::kFloat32}, 2, {0})}));
    v1::NodeMessage left;
    left.mutable_rank_event()->set_rank(1);
    left.mutable_rank_event()->set_joined(false);
    coord_.HandleMessage(t, left);
  }
  FakeClock clock_;
  Coordinator coord_;
  FakeNodeSink sink_;
};

TEST_F(CoordinatorErrorsTest, AMessageBeforeHelloIsAnOutOfOrderRequestAndCounted) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  coord_.HandleMessage(s, Registration(MakeSpec("g", 1), {0}));
  ASSERT_EQ(sink_.errors().size(), 1u);
  const v1::DecisionError e = sink_.errors()[0];
  EXPECT_EQ(e.kind(), v1::INVALID_REQUEST);
  EXPECT_EQ(e.code(), Code(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(e.message(), HasSubstr("send NodeHello first"));
  EXPECT_EQ(coord_.stats().errors, 1);
}

TEST_F(CoordinatorErrorsTest, AnEmptyMessageIsInvalidArgumentByItsKindAndCounted) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  coord_.HandleMessage(s, v1::NodeMessage());
  ASSERT_EQ(sink_.errors().size(), 1u);
  EXPECT_EQ(sink_.errors()[0].kind(), v1::INVALID_REQUEST);
  EXPECT_EQ(sink_.errors()[0].code(), Code(wire::CodeOfKind(v1::INVALID_REQUEST)));
  EXPECT_EQ(coord_.stats().errors, 1);
}

TEST_F(CoordinatorErrorsTest, ARefusedHelloKeepsItsKindAndTheKindsCode) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  CoordinatorOptions o = Options();
  coord_.HandleMessage(s, Hello("job", "a", o.max_world_size + 1, {0}));
  ASSERT_EQ(sink_.errors().size(), 1u);
  EXPECT_EQ(sink_.errors()[0].kind(), v1::LIMIT_EXCEEDED);
  EXPECT_EQ(sink_.errors()[0].code(), Code(wire::CodeOfKind(v1::LIMIT_EXCEEDED)));
  EXPECT_EQ(sink_.errors()[0].job_id(), "job");
}

TEST_F(CoordinatorErrorsTest, ASecondHelloIsOutOfOrder) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  coord_.HandleMessage(s, Hello("job", "a", 1, {0}));
  coord_.HandleMessage(s, Hello("job", "a", 1, {0}));
  ASSERT_EQ(sink_.errors().size(), 1u);
  EXPECT_EQ(sink_.errors()[0].kind(), v1::INVALID_REQUEST);
  EXPECT_EQ(sink_.errors()[0].code(), Code(absl::StatusCode::kFailedPrecondition));
}

TEST_F(CoordinatorErrorsTest, ARankEventOutsideTheWorldIsCounted) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  coord_.HandleMessage(s, Hello("job", "a", 2, {0, 1}));
  v1::NodeMessage event;
  event.mutable_rank_event()->set_rank(7);
  event.mutable_rank_event()->set_joined(true);
  coord_.HandleMessage(s, event);
  ASSERT_EQ(sink_.errors().size(), 1u);
  EXPECT_EQ(sink_.errors()[0].kind(), v1::INVALID_REQUEST);
  EXPECT_EQ(sink_.errors()[0].code(), Code(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(coord_.stats().errors, 1);
}

TEST_F(CoordinatorErrorsTest, AnUnknownRepeatAsksForTheFullFormByAFieldNotByText) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  coord_.HandleMessage(s, Hello("job", "a", 1, {0}));
  coord_.HandleMessage(s, Registration(MakeSpec("g", 2), {0}));
  coord_.HandleMessage(s, Batch({Repeat("g", 0, 1234)}));
  ASSERT_EQ(sink_.decisions().size(), 1u);
  const v1::DecisionError e = sink_.decisions()[0].error();
  EXPECT_EQ(e.kind(), v1::INVALID_MANIFEST);
  EXPECT_EQ(e.code(), Code(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(e.resend_full_form());
  EXPECT_EQ(e.group_id(), "g");
  EXPECT_EQ(e.step(), 0);
  EXPECT_EQ(coord_.stats().errors, 1);
}

TEST_F(CoordinatorErrorsTest, AnIntegerGradientIsANonFloatDtypeError) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  coord_.HandleMessage(s, Hello("job", "a", 1, {0}));
  coord_.HandleMessage(s, Registration(MakeSpec("g", 1), {0}));
  v1::Manifest m = NodeManifest("g", 0, {DType::kFloat32}, 1, {0});
  m.set_uniform_dtype(v1::INT32);
  m.clear_dtype_masks();
  coord_.HandleMessage(s, Batch({m}));
  ASSERT_EQ(sink_.decisions().size(), 1u);
  EXPECT_EQ(sink_.decisions()[0].error().kind(), v1::NON_FLOAT_DTYPE);
  EXPECT_EQ(sink_.decisions()[0].error().code(), Code(wire::CodeOfKind(v1::NON_FLOAT_DTYPE)));
}

// The job's verdict goes to every node after the answers to its steps: the
// node whose ranks wait for nothing learns it too.
TEST_F(CoordinatorErrorsTest, AFailedJobsVerdictReachesEveryNodeAfterTheAnswersToItsSteps) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  FakeNodeSink other;
  const Coordinator::SessionId t = coord_.OpenSession(&other);
  FailByALeaveMidStep(s, t);
  for (FakeNodeSink* sink : {&sink_, &other}) {
    const std::vector<v1::CoordinatorMessage> m = sink->messages();
    ASSERT_GE(m.size(), 2u);
    ASSERT_TRUE(m.back().has_error());
    EXPECT_TRUE(m.back().error().job_failed());
    EXPECT_EQ(m.back().error().kind(), v1::JOB_FAILED);
    EXPECT_THAT(m.back().error().message(), HasSubstr("rank 1 left"));
    EXPECT_TRUE(m[m.size() - 2].has_decisions()) << "the answers come first";
  }
  EXPECT_EQ(coord_.stats().errors, 1);
}

TEST_F(CoordinatorErrorsTest, AFailedJobsFailureResentToALateManifestIsNotCountedAgain) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  FakeNodeSink other;
  const Coordinator::SessionId t = coord_.OpenSession(&other);
  FailByALeaveMidStep(s, t);
  const int64_t counted = coord_.stats().errors;
  EXPECT_EQ(counted, 1);
  coord_.HandleMessage(s, Batch({NodeManifest("g", 1, {DType::kFloat32}, 2, {0})}));
  const std::vector<v1::Decision> d = sink_.decisions();
  ASSERT_FALSE(d.empty());
  EXPECT_EQ(d.back().error().kind(), v1::JOB_FAILED);
  EXPECT_EQ(coord_.stats().errors, counted);
}

GroupSpec WithMembers(GroupSpec spec, std::vector<int> members, int world) {
  spec.members = std::make_shared<const MemberSet>(*MemberSet::FromRanks(members, world));
  return spec;
}

TEST_F(CoordinatorErrorsTest, ARegistrationByARankOutsideItsMembersIsAnInvalidRequestAndCounted) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  coord_.HandleMessage(s, Hello("job", "a", 4, {0, 1}));
  coord_.HandleMessage(s, Registration(WithMembers(MakeSpec("g", 1), {1, 2}, 4), {0, 1}));
  const std::vector<v1::RegistrationResult> r = sink_.registrations();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].error().kind(), v1::INVALID_REQUEST);
  EXPECT_EQ(r[0].error().code(), Code(wire::CodeOfKind(v1::INVALID_REQUEST)));
  EXPECT_THAT(r[0].error().message(), HasSubstr("rank 0 is not among the members"));
  EXPECT_EQ(coord_.stats().errors, 1);
}

TEST_F(CoordinatorErrorsTest, MembersInANonCanonicalFormAreAnInvalidRequest) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  coord_.HandleMessage(s, Hello("job", "a", 4, {0, 1}));
  v1::NodeMessage reg = Registration(MakeSpec("g", 1), {0, 1});
  // Every rank must travel as no members.
  v1::Members* m = reg.mutable_registration()->mutable_registration()->mutable_members();
  m->set_start(0);
  m->set_count(4);
  m->set_stride(1);
  coord_.HandleMessage(s, reg);
  const std::vector<v1::RegistrationResult> r = sink_.registrations();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].error().kind(), v1::INVALID_REQUEST);
  EXPECT_THAT(r[0].error().message(), HasSubstr("every rank"));
  EXPECT_EQ(coord_.stats().errors, 1);
}

TEST_F(CoordinatorErrorsTest, AMemberSetMismatchIsARegistrationMismatchCountedOnce) {
  const Coordinator::SessionId s = coord_.OpenSession(&sink_);
  FakeNodeSink other;
  const Coordinator::SessionId t = coord_.OpenSession(&other);
  coord_.HandleMessage(s, Hello("job", "a", 4, {0, 1}));
  coord_.HandleMessage(t, Hello("job", "b", 4, {2, 3}));
  coord_.HandleMessage(s, Registration(WithMembers(MakeSpec("g", 1), {0, 1, 2}, 4), {0, 1}));
  coord_.HandleMessage(t, Registration(WithMembers(MakeSpec("g", 1), {2, 3}, 4), {2, 3}));
  for (FakeNodeSink* sink : {&sink_, &other}) {
    const std::vector<v1::RegistrationResult> r = sink->registrations();
    ASSERT_EQ(r.size(), 1u);
    EXPECT_EQ(r[0].error().kind(), v1::REGISTRATION_MISMATCH);
    EXPECT_EQ(r[0].error().code(), Code(wire::CodeOfKind(v1::REGISTRATION_MISMATCH)));
  }
  EXPECT_EQ(coord_.stats().errors, 1);
}

}  // namespace
}  // namespace accord::daemon
