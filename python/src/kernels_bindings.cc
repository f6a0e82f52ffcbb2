// Bindings of the CPU pack/unpack kernels (kernels/pack.h). Buffers cross as
// raw addresses (tensor.data_ptr()) plus dtype names; accord/kernels.py checks
// sizes and contiguity on the Python side before calling these.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/group.h"
#include "kernels/pack.h"
#include "python/src/common.h"

namespace nb = nanobind;

namespace accord::python {
namespace {

using PyBuffer = std::optional<std::tuple<uintptr_t, std::string>>;

Layout LayoutOrThrow(const GroupSpec& spec, int world_size, const std::vector<bool>& included,
                     const std::string& wire_dtype) {
  return ValueOrThrow(ComputeLayout(spec, world_size, included, DTypeOrThrow(wire_dtype)));
}

void PackCpuPy(const std::string& group_id, const std::vector<PyParam>& params, int world_size,
               const std::vector<bool>& included, const std::string& wire_dtype,
               const std::vector<PyBuffer>& sources, uintptr_t out, int64_t out_nbytes,
               int num_threads, bool allow_narrowing) {
  GroupSpec spec = SpecFromPy(group_id, params);
  Layout layout = LayoutOrThrow(spec, world_size, included, wire_dtype);
  if (out_nbytes != layout.total_bytes()) {
    ThrowIfError(absl::InvalidArgumentError("pack_cpu: group " + group_id + " needs an output of " +
                                            std::to_string(layout.total_bytes()) + " bytes, got " +
                                            std::to_string(out_nbytes)));
  }
  std::vector<GradSource> src(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    if (!sources[i].has_value()) continue;
    src[i].data = reinterpret_cast<const void*>(std::get<0>(*sources[i]));
    src[i].dtype = DTypeOrThrow(std::get<1>(*sources[i]));
  }
  PackOptions options;
  options.num_threads = num_threads;
  options.allow_narrowing = allow_narrowing;
  absl::Status status;
  {
    GilReleased release;
    status = PackCpu(spec, layout, src, reinterpret_cast<void*>(out), options);
  }
  ThrowIfError(status);
}

void UnpackCpuPy(const std::string& group_id, const std::vector<PyParam>& params, int world_size,
                 const std::vector<bool>& included, const std::string& wire_dtype, int rank,
                 uintptr_t shard, const std::vector<PyBuffer>& targets, bool drop_padding) {
  GroupSpec spec = SpecFromPy(group_id, params);
  Layout layout = LayoutOrThrow(spec, world_size, included, wire_dtype);
  std::vector<UnpackTarget> dst(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    if (!targets[i].has_value()) continue;
    dst[i].data = reinterpret_cast<void*>(std::get<0>(*targets[i]));
    dst[i].dtype = DTypeOrThrow(std::get<1>(*targets[i]));
  }
  UnpackOptions options;
  options.drop_padding = drop_padding;
  absl::Status status;
  {
    GilReleased release;
    status = UnpackCpu(spec, layout, rank, reinterpret_cast<const void*>(shard), dst, options);
  }
  ThrowIfError(status);
}

}  // namespace

void BindKernels(nb::module_& m) {
  m.def("pack_cpu", &PackCpuPy, nb::arg("group_id"), nb::arg("params"), nb::arg("world_size"),
        nb::arg("included"), nb::arg("wire_dtype"), nb::arg("sources"), nb::arg("out"),
        nb::arg("out_nbytes"), nb::arg("num_threads") = 1, nb::arg("allow_narrowing") = false,
        "Packs gradients (address, dtype) or None per parameter into FSDP2's buffer at `out`.");
  m.def("unpack_cpu", &UnpackCpuPy, nb::arg("group_id"), nb::arg("params"), nb::arg("world_size"),
        nb::arg("included"), nb::arg("wire_dtype"), nb::arg("rank"), nb::arg("shard"),
        nb::arg("targets"), nb::arg("drop_padding") = false,
        "Converts this rank's reduced shard into per-parameter targets.");
  m.def(
      "unpacked_numel",
      [](const std::string& group_id, const std::vector<PyParam>& params, int world_size,
         const std::vector<bool>& included, const std::string& wire_dtype, size_t i, int rank,
         bool drop_padding) {
        GroupSpec spec = SpecFromPy(group_id, params);
        Layout layout = LayoutOrThrow(spec, world_size, included, wire_dtype);
        if (i >= spec.params.size()) ThrowIfError(absl::OutOfRangeError("unpacked_numel: index"));
        return UnpackedNumel(spec, layout, i, rank, drop_padding);
      },
      nb::arg("group_id"), nb::arg("params"), nb::arg("world_size"), nb::arg("included"),
      nb::arg("wire_dtype"), nb::arg("index"), nb::arg("rank"), nb::arg("drop_padding") = false);
}

}  // namespace accord::python
