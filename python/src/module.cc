// accord._accord: the compiled half of the `accord` Python package.
#include <nanobind/nanobind.h>

#include "python/src/common.h"

namespace nb = nanobind;

NB_MODULE(_accord, m) {
  m.doc() = "accord: agreement on reduce-scatter layout and dtype (compiled core)";
  nb::exception<accord::python::StatusError> error(m, "Error", PyExc_RuntimeError);
  // Registered after nb::exception's own, so tried first: the raised Error
  // carries the canonical status code as `code` ("DEADLINE_EXCEEDED"), for
  // callers that branch on it (never on the message's text).
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void* type) {
        try {
          std::rethrow_exception(p);
        } catch (const accord::python::StatusError& e) {
          nb::handle error_type(static_cast<PyObject*>(type));
          nb::object raised = error_type(nb::str(e.what()));
          raised.attr("code") = nb::str(e.code().c_str());
          PyErr_SetObject(error_type.ptr(), raised.ptr());
        }
      },
      error.ptr());
  // Decisions and futures legitimately outlive the interpreter's teardown
  // (held by a model's accord.torch installation, or by a daemon thread that
  // exits with the process); nanobind would report each as a leak at exit.
  nb::set_leak_warnings(false);
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
