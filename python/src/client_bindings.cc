// Bindings of the client (client/client.h): connect, register, submit, wait,
// and the job's key-value store. Every blocking call releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "python/src/common.h"

namespace nb = nanobind;

namespace accord::python {
namespace {

absl::Time DeadlineIn(double seconds) { return absl::Now() + absl::Seconds(seconds); }

// (group_id, step, dtypes) as the Python side passes one submission.
using PySubmission = std::tuple<std::string, int64_t, std::vector<std::optional<std::string>>>;

GroupSubmission SubmissionFromPy(const PySubmission& s) {
  GroupSubmission out;
  out.group_id = std::get<0>(s);
  out.step = std::get<1>(s);
  out.grad_dtypes = GradDTypesFromPy(std::get<2>(s));
  return out;
}

std::unique_ptr<Client> ConnectOrThrow(const std::string& socket_path, const std::string& job_id,
                                       int rank, int world_size, int local_rank,
                                       const std::string& token, double connect_timeout_s,
                                       double reconnect_grace_s) {
  ClientOptions options;
  options.socket_path = socket_path;
  options.job_id = job_id;
  options.rank = rank;
  options.world_size = world_size;
  options.local_rank = local_rank;
  options.token = token;
  options.connect_timeout = absl::Seconds(connect_timeout_s);
  options.reconnect_grace = absl::Seconds(reconnect_grace_s);
  absl::StatusOr<std::unique_ptr<Client>> client;
  {
    GilReleased release;
    client = Client::Connect(options);
  }
  return ValueOrThrow(std::move(client));
}

using PyClient = nb::class_<Client>;

// Connecting and the session's identity.
void BindSession(PyClient& cls) {
  cls.def_static("connect", &ConnectOrThrow, nb::arg("socket_path"), nb::arg("job_id"),
                 nb::arg("rank"), nb::arg("world_size"), nb::arg("local_rank") = 0,
                 nb::arg("token") = "", nb::arg("connect_timeout_s") = 30.0,
                 nb::arg("reconnect_grace_s") = 10.0,
                 "Connects to the sidecar at socket_path and joins the job. When the stream "
                 "ends (the sidecar restarted), the client reconnects for reconnect_grace_s "
                 "(0: not at all) and resumes.")
      .def_prop_ro("rank", [](const Client& c) { return c.options().rank; })
      .def_prop_ro("world_size", [](const Client& c) { return c.options().world_size; })
      .def_prop_ro("job_id", [](const Client& c) { return c.options().job_id; });
}

// Group registrations, one or many in one round trip.
void BindRegistration(PyClient& cls) {
  cls.def(
         "register_group",
         [](Client& c, const std::string& group_id, const std::vector<PyParam>& params,
            const std::optional<std::string>& reduce_dtype, bool reduce_dtype_exact,
            double timeout_s, const std::optional<std::vector<int>>& members) {
           Policy policy;
           policy.reduce_dtype = OptionalDType(reduce_dtype);
           // "Exact" only means something with a configured dtype; the daemons reject it
           // otherwise.
           policy.reduce_dtype_exact = reduce_dtype_exact && policy.reduce_dtype.has_value();
           GroupSpec spec = SpecFromPy(group_id, params);
           spec.members = MembersFromPy(group_id, members, c.options().world_size);
           absl::Status status;
           {
             GilReleased release;
             status = c.RegisterGroup(spec, policy, DeadlineIn(timeout_s));
           }
           ThrowIfError(status);
         },
         nb::arg("group_id"), nb::arg("params"), nb::arg("reduce_dtype") = nb::none(),
         nb::arg("reduce_dtype_exact") = true, nb::arg("timeout_s") = 60.0,
         nb::arg("members") = nb::none(),
         "Registers a group: params are (name, dim0, numel) in group order; members are the "
         "ranks that reduce it (ascending; None: every rank).")
      .def(
          "register_groups",
          [](Client& c,
             const std::vector<std::tuple<std::string, std::vector<PyParam>,
                                          std::optional<std::string>, bool>>& groups,
             double timeout_s,
             const std::optional<std::vector<std::optional<std::vector<int>>>>& members) {
            if (members.has_value() && members->size() != groups.size()) {
              ThrowIfError(absl::InvalidArgumentError(
                  "register_groups: " + std::to_string(members->size()) + " member lists for " +
                  std::to_string(groups.size()) + " groups"));
            }
            std::vector<std::pair<GroupSpec, Policy>> specs;
            specs.reserve(groups.size());
            for (size_t i = 0; i < groups.size(); ++i) {
              const auto& [group_id, params, reduce_dtype, exact] = groups[i];
              Policy policy;
              policy.reduce_dtype = OptionalDType(reduce_dtype);
              policy.reduce_dtype_exact = exact && policy.reduce_dtype.has_value();
              GroupSpec spec = SpecFromPy(group_id, params);
              if (members.has_value()) {
                spec.members = MembersFromPy(group_id, (*members)[i], c.options().world_size);
              }
              specs.emplace_back(std::move(spec), policy);
            }
            absl::Status status;
            {
              GilReleased release;
              status = c.RegisterGroups(specs, DeadlineIn(timeout_s));
            }
            ThrowIfError(status);
          },
          nb::arg("groups"), nb::arg("timeout_s") = 60.0, nb::arg("members") = nb::none(),
          "Registers many (group_id, params, reduce_dtype, reduce_dtype_exact) with one round "
          "trip; members, when given, has one member list (or None) per group.")
      .def(
          "wait_verdict",
          [](Client& c, double timeout_s) {
            std::optional<absl::Status> verdict;
            {
              GilReleased release;
              verdict = c.WaitVerdict(DeadlineIn(timeout_s));
            }
            if (verdict.has_value()) {
              ThrowIfError(verdict->ok() ? absl::UnknownError("the session ended without an error")
                                         : *verdict);
            }
          },
          nb::arg("timeout_s"),
          "Waits up to timeout_s for the job's verdict: raises the error the job failed with "
          "(or the session ended with); returns None when the job has not failed by then.");
}

// Manifests, decisions and the adapter's counts.
void BindSubmission(PyClient& cls) {
  cls.def(
         "submit",
         [](Client& c, const std::string& group_id, int64_t step,
            const std::vector<std::optional<std::string>>& dtypes) {
           GroupSubmission s;
           s.group_id = group_id;
           s.step = step;
           s.grad_dtypes = GradDTypesFromPy(dtypes);
           GilReleased release;
           return c.Submit(s);
         },
         nb::arg("group_id"), nb::arg("step"), nb::arg("dtypes"),
         "Submits one manifest (a dtype name or None per parameter); never blocks.")
      .def(
          "submit_batch",
          [](Client& c, const std::vector<PySubmission>& batch, uint64_t sync_key) {
            std::vector<GroupSubmission> subs;
            subs.reserve(batch.size());
            for (const auto& s : batch) subs.push_back(SubmissionFromPy(s));
            GilReleased release;
            return c.SubmitBatch(subs, sync_key);
          },
          nb::arg("batch"), nb::arg("sync_key") = 0,
          "Submits many (group_id, step, dtypes) in one message. A non-zero sync_key "
          "marks it as one of this rank's releases (docs/MEMBERS.md 2.11): equal keys "
          "only for ranks that run the same action list.")
      .def(
          "wait",
          [](Client& c, const DecisionFuture& f, double timeout_s) {
            absl::StatusOr<Decision> d;
            {
              GilReleased release;
              d = c.Wait(f, DeadlineIn(timeout_s));
            }
            return ValueOrThrow(std::move(d));
          },
          nb::arg("future"), nb::arg("timeout_s") = 300.0,
          "Waits for the decision; Error (DEADLINE_EXCEEDED, ...) otherwise.")
      .def(
          "add_adapter_counts",
          [](Client& c, int64_t speculated, int64_t repaired, int64_t redone) {
            ThrowIfError(c.AddAdapterCounts(AdapterCounts{speculated, repaired, redone}));
          },
          nb::arg("speculated"), nb::arg("repaired"), nb::arg("redone"),
          "Adds to this process's adapter counts and sends the totals to the sidecar, for "
          "its metrics (accord_speculated_reduces_total, accord_repairs_total); never blocks.");
}

// The job's key-value store.
void BindKeyValue(PyClient& cls) {
  cls.def(
         "kv_set",
         [](Client& c, const std::string& key, nb::bytes value) {
           std::string v(value.c_str(), value.size());
           absl::Status status;
           {
             GilReleased release;
             status = c.kv().Set(key, v);
           }
           ThrowIfError(status);
         },
         nb::arg("key"), nb::arg("value"))
      .def(
          "kv_get",
          [](Client& c, const std::vector<std::string>& keys, double timeout_s,
             std::optional<std::vector<int>> expected) {
            absl::StatusOr<std::vector<std::string>> values;
            {
              GilReleased release;
              const std::chrono::milliseconds timeout(static_cast<int64_t>(timeout_s * 1000.0));
              values = expected.has_value() ? c.kv().GetAmong(keys, timeout, *expected)
                                            : c.kv().Get(keys, timeout);
            }
            std::vector<std::string> v = ValueOrThrow(std::move(values));
            nb::list out;
            for (const auto& s : v) out.append(nb::bytes(s.data(), s.size()));
            return out;
          },
          nb::arg("keys"), nb::arg("timeout_s") = 60.0, nb::arg("expected") = nb::none());
}

}  // namespace

void BindClient(nb::module_& m) {
  nb::class_<DecisionFuture>(m, "DecisionFuture", "A submitted manifest's eventual decision.")
      .def("ready", &DecisionFuture::Ready)
      .def_prop_ro("valid", &DecisionFuture::valid);
  PyClient cls(m, "Client",
               "One rank's connection to its node's sidecar. Thread-safe; blocking calls "
               "release the GIL.");
  BindSession(cls);
  BindRegistration(cls);
  BindSubmission(cls);
  BindKeyValue(cls);
}

}  // namespace accord::python
