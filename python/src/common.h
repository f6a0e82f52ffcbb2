// Shared helpers for the nanobind bindings: absl::Status to Python
// exceptions, and the small conversions every binding file needs.
//
// Errors cross into Python as accord._accord.Error (a RuntimeError) whose
// text starts with the canonical code, e.g. "FAILED_PRECONDITION: ...";
// `code` carries the code name, `message` the text after it, and
// `local_timeout` whether the client's own wait ended at the caller's
// deadline (client/client.h, IsLocalTimeout). Nothing else is thrown from
// these bindings.
#ifndef ACCORD_PYTHON_SRC_COMMON_H_
#define ACCORD_PYTHON_SRC_COMMON_H_

#include <nanobind/nanobind.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/group.h"
#include "python/src/gil.h"
#ifdef ACCORD_PY_CLIENT
#include "client/client.h"
#endif

namespace accord::python {

// The C++ side of accord._accord.Error.
class StatusError : public std::runtime_error {
 public:
  explicit StatusError(const absl::Status& status)
      : StatusError(status.code(), std::string(status.message()), LocalTimeout(status)) {}
  StatusError(absl::StatusCode code, std::string message, bool local_timeout)
      : std::runtime_error(absl::StatusCodeToString(code) + ": " + message),
        code_(absl::StatusCodeToString(code)),
        message_(std::move(message)),
        local_timeout_(local_timeout) {}
  const std::string& code() const { return code_; }
  const std::string& message() const { return message_; }
  bool local_timeout() const { return local_timeout_; }

 private:
  static bool LocalTimeout(const absl::Status& status) {
#ifdef ACCORD_PY_CLIENT
    return IsLocalTimeout(status);
#else
    return false;  // only the client's waits end at the caller's deadline
#endif
  }
  std::string code_;
  std::string message_;
  bool local_timeout_;
};

inline void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> value) {
  if (!value.ok()) throw StatusError(value.status());
  return *std::move(value);
}

inline DType DTypeOrThrow(const std::string& name) { return ValueOrThrow(ParseDType(name)); }

inline std::optional<DType> OptionalDType(const std::optional<std::string>& name) {
  if (!name.has_value()) return std::nullopt;
  return DTypeOrThrow(*name);
}

// (name, dim0, numel) triples, as the Python side passes them.
using PyParam = std::tuple<std::string, int64_t, int64_t>;

inline GroupSpec SpecFromPy(const std::string& group_id, const std::vector<PyParam>& params) {
  GroupSpec spec;
  spec.group_id = group_id;
  spec.params.reserve(params.size());
  for (const auto& [name, dim0, numel] : params) spec.params.push_back({name, dim0, numel});
  return spec;
}

// A group's members as the Python side passes them (None: every rank);
// raises accord.Error INVALID_ARGUMENT for a list MembersOf refuses.
inline std::shared_ptr<const MemberSet> MembersFromPy(const std::string& group_id,
                                                      const std::optional<std::vector<int>>& ranks,
                                                      int world_size) {
  if (!ranks.has_value()) return nullptr;
  absl::StatusOr<std::shared_ptr<const MemberSet>> m = MembersOf(*ranks, world_size);
  if (!m.ok()) {
    ThrowIfError(absl::InvalidArgumentError("group \"" + group_id +
                                            "\": members: " + std::string(m.status().message())));
  }
  return *std::move(m);
}

inline std::vector<std::optional<DType>> GradDTypesFromPy(
    const std::vector<std::optional<std::string>>& names) {
  std::vector<std::optional<DType>> out;
  out.reserve(names.size());
  for (const auto& n : names) out.push_back(OptionalDType(n));
  return out;
}

// Binding entry points, one per file.
void BindCore(nanobind::module_& m);
void BindClient(nanobind::module_& m);
void BindKernels(nanobind::module_& m);
void BindCluster(nanobind::module_& m);

}  // namespace accord::python

#endif  // ACCORD_PYTHON_SRC_COMMON_H_
