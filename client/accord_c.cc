// The C ABI over the C++ client. No exception or C++ type crosses it.
#include "client/accord.h"

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"

struct accord_client {
  std::unique_ptr<accord::Client> client;
};

struct accord_future {
  accord::DecisionFuture future;
};

namespace {

thread_local std::string last_error;

int Fail(const absl::Status& s) {
  last_error = std::string(s.message());
  return static_cast<int>(s.code());
}

int Ok() {
  last_error.clear();
  return ACCORD_OK;
}

absl::Time DeadlineIn(int64_t timeout_ms) {
  return absl::Now() + absl::Milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
}

}  // namespace

extern "C" {

const char* accord_last_error(void) { return last_error.c_str(); }

int accord_connect(const accord_options* options, accord_client** out) {
  if (options == nullptr || out == nullptr) {
    return Fail(absl::InvalidArgumentError("accord_connect: options and out must not be NULL"));
  }
  *out = nullptr;
  accord::ClientOptions o;
  o.socket_path = options->socket_path ? options->socket_path : "";
  o.job_id = options->job_id ? options->job_id : "";
  o.rank = options->rank;
  o.world_size = options->world_size;
  o.local_rank = options->local_rank;
  o.token = options->token ? options->token : "";
  if (options->connect_timeout_ms > 0) {
    o.connect_timeout = absl::Milliseconds(options->connect_timeout_ms);
  }
  absl::StatusOr<std::unique_ptr<accord::Client>> c = accord::Client::Connect(o);
  if (!c.ok()) return Fail(c.status());
  *out = new accord_client{*std::move(c)};
  return Ok();
}

int accord_register_group(accord_client* client, const char* group_id, const accord_param* params,
                          size_t num_params, int32_t reduce_dtype, int reduce_dtype_exact,
                          int64_t timeout_ms) {
  return accord_register_group_with_members(client, group_id, params, num_params, reduce_dtype,
                                            reduce_dtype_exact, nullptr, 0, timeout_ms);
}

int accord_register_group_with_members(accord_client* client, const char* group_id,
                                       const accord_param* params, size_t num_params,
                                       int32_t reduce_dtype, int reduce_dtype_exact,
                                       const int32_t* members, size_t num_members,
                                       int64_t timeout_ms) {
  if (client == nullptr || group_id == nullptr || (params == nullptr && num_params > 0)) {
    return Fail(absl::InvalidArgumentError(
        "accord_register_group: client, group_id and params must not be NULL"));
  }
  accord::GroupSpec spec;
  if (members != nullptr && num_members > 0) {
    absl::StatusOr<std::shared_ptr<const accord::MemberSet>> m = accord::MembersOf(
        std::vector<int>(members, members + num_members), client->client->options().world_size);
    if (!m.ok()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("accord_register_group(\"", group_id,
                                                          "\"): members: ", m.status().message())));
    }
    spec.members = *std::move(m);
  }
  spec.group_id = group_id;
  for (size_t i = 0; i < num_params; ++i) {
    spec.params.push_back({params[i].name ? params[i].name : "", params[i].dim0, params[i].numel});
  }
  accord::Policy policy;
  if (reduce_dtype != 0) {
    absl::StatusOr<accord::DType> d = accord::DTypeFromNumber(reduce_dtype);
    if (!d.ok()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "accord_register_group(\"", group_id, "\"): reduce_dtype: ", d.status().message())));
    }
    policy.reduce_dtype = *d;
  }
  policy.reduce_dtype_exact = reduce_dtype_exact != 0;
  absl::Status s = client->client->RegisterGroup(spec, policy, DeadlineIn(timeout_ms));
  return s.ok() ? Ok() : Fail(s);
}

int accord_submit(accord_client* client, const char* group_id, int64_t step,
                  const int32_t* grad_dtypes, size_t num_params, accord_future** out) {
  if (client == nullptr || group_id == nullptr || out == nullptr ||
      (grad_dtypes == nullptr && num_params > 0)) {
    return Fail(absl::InvalidArgumentError(
        "accord_submit: client, group_id, grad_dtypes and out must not be NULL"));
  }
  *out = nullptr;
  accord::GroupSubmission sub;
  sub.group_id = group_id;
  sub.step = step;
  sub.grad_dtypes.reserve(num_params);
  for (size_t i = 0; i < num_params; ++i) {
    if (grad_dtypes[i] == ACCORD_NO_GRAD) {
      sub.grad_dtypes.push_back(std::nullopt);
      continue;
    }
    absl::StatusOr<accord::DType> d = accord::DTypeFromNumber(grad_dtypes[i]);
    if (!d.ok()) {
      return Fail(
          absl::InvalidArgumentError(absl::StrCat("accord_submit(\"", group_id, "\", step ", step,
                                                  "): parameter ", i, ": ", d.status().message())));
    }
    sub.grad_dtypes.push_back(*d);
  }
  *out = new accord_future{client->client->Submit(sub)};
  return Ok();
}

int accord_wait(accord_client* client, accord_future* future, int64_t timeout_ms,
                accord_decision* out) {
  if (client == nullptr || future == nullptr || out == nullptr) {
    return Fail(absl::InvalidArgumentError("accord_wait: client, future and out must not be NULL"));
  }
  absl::StatusOr<accord::Decision> d = client->client->Wait(future->future, DeadlineIn(timeout_ms));
  if (!d.ok()) return Fail(d.status());
  out->step = d->step;
  out->wire_dtype = static_cast<int32_t>(d->wire_dtype);
  out->layout_fingerprint = d->layout_fingerprint;
  out->num_params = static_cast<int32_t>(d->included.size());
  int32_t n = 0;
  for (bool b : d->included) n += b ? 1 : 0;
  out->num_included = n;
  if (out->included != nullptr) {
    if (out->included_capacity < d->included.size()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("accord_wait: included buffer holds ", out->included_capacity,
                       " bytes but the group has ", d->included.size(), " parameters")));
    }
    for (size_t i = 0; i < d->included.size(); ++i) out->included[i] = d->included[i] ? 1 : 0;
  }
  return Ok();
}

int accord_wait_verdict(accord_client* client, int64_t timeout_ms) {
  if (client == nullptr) {
    return Fail(absl::InvalidArgumentError("accord_wait_verdict: client must not be NULL"));
  }
  std::optional<absl::Status> verdict = client->client->WaitVerdict(DeadlineIn(timeout_ms));
  if (!verdict.has_value()) return Ok();
  if (verdict->ok()) return Fail(absl::UnknownError("the session ended without an error"));
  return Fail(*verdict);
}

void accord_future_free(accord_future* future) { delete future; }

void accord_close(accord_client* client) { delete client; }

}  // extern "C"
