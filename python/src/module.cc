// accord._accord: the compiled half of the `accord` Python package.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "absl/status/statusor.h"
#include "python/src/common.h"

namespace nb = nanobind;

namespace {

using accord::python::StatusError;

// The one place an accord._accord.Error object is built (raised from C++ or
// made by make_error): its text, then the attributes callers branch on.
nb::object NewError(nb::handle type, const StatusError& e) {
  const std::string text = e.what();
  nb::object error = type(nb::str(text.data(), text.size()));
  error.attr("code") = nb::str(e.code().data(), e.code().size());
  error.attr("message") = nb::str(e.message().data(), e.message().size());
  error.attr("local_timeout") = nb::bool_(e.local_timeout());
  return error;
}

absl::StatusOr<absl::StatusCode> CodeNamed(const std::string& name) {
  for (int c = 1; c <= static_cast<int>(absl::StatusCode::kUnauthenticated); ++c) {
    const auto code = static_cast<absl::StatusCode>(c);
    if (absl::StatusCodeToString(code) == name) return code;
  }
  return absl::InvalidArgumentError("make_error: \"" + name +
                                    "\" is not the name of a canonical error code");
}

}  // namespace

NB_MODULE(_accord, m) {
  m.doc() = "accord: agreement on reduce-scatter layout and dtype (compiled core)";
  nb::exception<StatusError> error(m, "Error", PyExc_RuntimeError);
  // Registered after nb::exception's own, so tried first: the raised Error
  // carries the canonical status code as `code` ("DEADLINE_EXCEEDED") and
  // `local_timeout`, for callers that branch on them (never on the text).
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void* type) {
        try {
          std::rethrow_exception(p);
        } catch (const StatusError& e) {
          nb::handle error_type(static_cast<PyObject*>(type));
          PyErr_SetObject(error_type.ptr(), NewError(error_type, e).ptr());
        }
      },
      error.ptr());
  nb::handle error_type = error;
  m.def(
      "make_error",
      [error_type](const std::string& code, const std::string& message, bool local_timeout) {
        return NewError(error_type, StatusError(accord::python::ValueOrThrow(CodeNamed(code)),
                                                message, local_timeout));
      },
      nb::arg("code"), nb::arg("message"), nb::arg("local_timeout") = false,
      "An Error as the bindings raise one: text \"CODE: message\", with `code`, `message` and "
      "`local_timeout` set.");
  // Decisions and futures legitimately outlive the interpreter's teardown
  // (held by a model's accord.torch installation, or by a daemon thread that
  // exits with the process); nanobind would report each as a leak at exit.
  nb::set_leak_warnings(false);
  // The exit gate (python/src/gil.h) closes in the atexit handler registered
  // first, so it runs last: after what importers of accord register.
  accord::python::ExitGate::Get().Loaded();
  nb::module_::import_("atexit").attr("register")(nb::cpp_function(
      [] { accord::python::ExitGate::Get().Close(); }, nb::name("_close_exit_gate")));
  accord::python::BindCore(m);
#ifdef ACCORD_PY_CLIENT
  accord::python::BindClient(m);
  m.attr("HAVE_CLIENT") = true;
#else
  m.attr("HAVE_CLIENT") = false;
#endif
#ifdef ACCORD_PY_KERNELS
  accord::python::BindKernels(m);
  m.attr("HAVE_KERNELS") = true;
#else
  m.attr("HAVE_KERNELS") = false;
#endif
#ifdef ACCORD_PY_CLUSTER
  accord::python::BindCluster(m);
  m.attr("HAVE_CLUSTER") = true;
#else
  m.attr("HAVE_CLUSTER") = false;
#endif
}
