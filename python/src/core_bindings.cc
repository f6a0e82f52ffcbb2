// Bindings of core/: dtypes, the lattice join, layouts and Decide.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/decide.h"
#include "core/dtype.h"
#include "core/group.h"
#include "core/lattice.h"
#include "core/manifest.h"
#include "python/src/common.h"

namespace nb = nanobind;

namespace accord::python {
namespace {

Policy MakePolicy(const std::optional<std::string>& reduce_dtype, bool exact) {
  Policy policy;
  policy.reduce_dtype = OptionalDType(reduce_dtype);
  policy.reduce_dtype_exact = exact && policy.reduce_dtype.has_value();
  return policy;
}

// Decides for one group and step from every rank's gradient dtypes (outer
// list indexed by rank). Used by tests and by agreements that gather
// manifests themselves.
Decision DecideFromRanks(const std::string& group_id, const std::vector<PyParam>& params,
                         int64_t step,
                         const std::vector<std::vector<std::optional<std::string>>>& ranks,
                         const std::optional<std::string>& reduce_dtype, bool exact) {
  GroupSpec spec = SpecFromPy(group_id, params);
  ThrowIfError(ValidateGroupSpec(spec));
  const int world_size = static_cast<int>(ranks.size());
  if (world_size < 1) ThrowIfError(absl::InvalidArgumentError("decide: no ranks given"));
  Manifest merged;
  for (int r = 0; r < world_size; ++r) {
    if (ranks[r].size() != spec.params.size()) {
      ThrowIfError(absl::InvalidArgumentError("decide: group " + group_id + " rank " +
                                              std::to_string(r) + " gave " +
                                              std::to_string(ranks[r].size()) + " dtypes for " +
                                              std::to_string(spec.params.size()) + " parameters"));
    }
    Manifest m = RankManifest(step, r, world_size, GradDTypesFromPy(ranks[r]));
    if (r == 0) {
      merged = std::move(m);
    } else {
      ThrowIfError(Merge(merged, m));
    }
  }
  return ValueOrThrow(Decide(spec, world_size, merged, MakePolicy(reduce_dtype, exact)));
}

}  // namespace

void BindCore(nb::module_& m) {
  nb::class_<Decision>(m, "Decision",
                       "What every rank packs for one group and step (see docs/ARCHITECTURE.md).")
      .def(nb::init<>())
      .def_rw("step", &Decision::step)
      .def_prop_rw(
          "wire_dtype", [](const Decision& d) { return std::string(DTypeName(d.wire_dtype)); },
          [](Decision& d, const std::string& name) { d.wire_dtype = DTypeOrThrow(name); },
          "The dtype on the wire, as PyTorch names it without 'torch.' (e.g. 'float32').")
      .def_rw("included", &Decision::included,
              "Per parameter: True when used on some rank (zero-filled where absent).")
      .def_rw("layout_fingerprint", &Decision::layout_fingerprint)
      .def("zero_fill_indices", &Decision::ZeroFillIndices)
      .def("skip_indices", &Decision::SkipIndices)
      .def("__eq__", [](const Decision& a, const Decision& b) { return a == b; })
      .def("__repr__", [](const Decision& d) {
        std::string inc;
        for (bool b : d.included) inc += b ? '1' : '0';
        return "Decision(step=" + std::to_string(d.step) +
               ", wire_dtype=" + std::string(DTypeName(d.wire_dtype)) + ", included=" + inc + ")";
      });

  m.def(
      "parse_dtype",
      [](const std::string& name) { return std::string(DTypeName(DTypeOrThrow(name))); },
      nb::arg("name"), "Canonical name of a float dtype ('bf16' -> 'bfloat16'); Error otherwise.");
  m.def(
      "dtype_size", [](const std::string& name) { return DTypeSize(DTypeOrThrow(name)); },
      nb::arg("name"));
  m.def(
      "is_lossless",
      [](const std::string& from, const std::string& to) {
        return IsLossless(DTypeOrThrow(from), DTypeOrThrow(to));
      },
      nb::arg("src"), nb::arg("dst"), "True when every value of src is exact in dst.");
  m.def(
      "join",
      [](const std::vector<std::string>& names) {
        DTypeMask mask = 0;
        for (const auto& n : names) mask |= MaskOf(DTypeOrThrow(n));
        return std::string(DTypeName(ValueOrThrow(Join(mask))));
      },
      nb::arg("dtypes"), "Least upper bound in the lossless lattice (fp16 | bf16 -> float32).");
  m.def("decide", &DecideFromRanks, nb::arg("group_id"), nb::arg("params"), nb::arg("step"),
        nb::arg("rank_dtypes"), nb::arg("reduce_dtype") = nb::none(),
        nb::arg("reduce_dtype_exact") = true,
        "Runs core Decide on every rank's gradient dtypes (None: no gradient).");
  m.def(
      "layout_fingerprint",
      [](const std::string& group_id, const std::vector<PyParam>& params, int world_size,
         const std::vector<bool>& included, const std::string& wire_dtype) {
        return LayoutFingerprint(SpecFromPy(group_id, params), world_size, included,
                                 DTypeOrThrow(wire_dtype));
      },
      nb::arg("group_id"), nb::arg("params"), nb::arg("world_size"), nb::arg("included"),
      nb::arg("wire_dtype"));
  m.def(
      "layout_row_numel",
      [](const std::string& group_id, const std::vector<PyParam>& params, int world_size,
         const std::vector<bool>& included, const std::string& wire_dtype) {
        return ValueOrThrow(ComputeLayout(SpecFromPy(group_id, params), world_size, included,
                                          DTypeOrThrow(wire_dtype)))
            .row_numel;
      },
      nb::arg("group_id"), nb::arg("params"), nb::arg("world_size"), nb::arg("included"),
      nb::arg("wire_dtype"), "Elements each rank receives for this layout.");
}

}  // namespace accord::python
