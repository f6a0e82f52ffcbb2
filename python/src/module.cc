// accord._accord: the compiled half of the `accord` Python package.
#include <nanobind/nanobind.h>

#include "python/src/common.h"

namespace nb = nanobind;

NB_MODULE(_accord, m) {
  m.doc() = "accord: agreement on reduce-scatter layout and dtype (compiled core)";
  nb::exception<accord::python::StatusError>(m, "Error", PyExc_RuntimeError);
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
