// Bindings of the local cluster launcher (client/testing/local_cluster.h): a
// coordinator and sidecars on this machine, for tests, demos and benchmarks.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/testing/local_cluster.h"
#include "python/src/common.h"

namespace nb = nanobind;

namespace accord::python {
namespace {

// Owns the cluster so Python can stop it deterministically (close() or the
// context manager) rather than whenever the object is collected.
class PyLocalCluster {
 public:
  PyLocalCluster(const std::string& bin_dir, int num_sidecars,
                 const std::vector<std::string>& coordinator_flags,
                 const std::vector<std::string>& sidecar_flags, double ready_timeout_s, bool echo,
                 int sidecars_per_relay, const std::vector<std::string>& relay_flags) {
    testing::LocalClusterOptions options;
    options.sidecars_per_relay = sidecars_per_relay;
    options.relay_flags = relay_flags;
    options.bin_dir = bin_dir;
    options.num_sidecars = num_sidecars;
    options.coordinator_flags = coordinator_flags;
    options.sidecar_flags = sidecar_flags;
    options.ready_timeout = absl::Seconds(ready_timeout_s);
    options.echo = echo;
    absl::StatusOr<std::unique_ptr<testing::LocalCluster>> cluster;
    {
      GilReleased release;
      cluster = testing::LocalCluster::Start(options);
    }
    cluster_ = ValueOrThrow(std::move(cluster));
  }

  testing::LocalCluster& get() {
    if (cluster_ == nullptr) {
      ThrowIfError(absl::FailedPreconditionError("LocalCluster: already closed"));
    }
    return *cluster_;
  }

  void Close() {
    GilReleased release;
    cluster_.reset();
  }

 private:
  std::unique_ptr<testing::LocalCluster> cluster_;
};

}  // namespace

void BindCluster(nb::module_& m) {
  nb::class_<PyLocalCluster>(m, "LocalCluster",
                             "A coordinator and sidecars on this machine; stopped by close() or "
                             "on leaving a `with` block.")
      .def(nb::init<const std::string&, int, const std::vector<std::string>&,
                    const std::vector<std::string>&, double, bool, int,
                    const std::vector<std::string>&>(),
           nb::arg("bin_dir") = "", nb::arg("num_sidecars") = 1,
           nb::arg("coordinator_flags") = std::vector<std::string>{},
           nb::arg("sidecar_flags") = std::vector<std::string>{}, nb::arg("ready_timeout_s") = 30.0,
           nb::arg("echo") = false, nb::arg("sidecars_per_relay") = 0,
           nb::arg("relay_flags") = std::vector<std::string>{})
      .def_prop_ro("num_relays", [](PyLocalCluster& c) { return c.get().num_relays(); })
      .def(
          "relay_output", [](PyLocalCluster& c, int j) { return c.get().RelayOutput(j); },
          nb::arg("index"))
      .def_prop_ro("coordinator_address",
                   [](PyLocalCluster& c) { return c.get().coordinator_address(); })
      .def_prop_ro("sidecar_sockets", [](PyLocalCluster& c) { return c.get().sidecar_sockets(); })
      .def(
          "socket_for",
          [](PyLocalCluster& c, int rank, int world) {
            auto& cl = c.get();
            return std::make_tuple(cl.sidecar_sockets().at(cl.SidecarOf(rank, world)),
                                   cl.LocalRankOf(rank, world));
          },
          nb::arg("rank"), nb::arg("world_size"),
          "(sidecar socket, local rank) of a rank in a job of world_size ranks.")
      .def(
          "run_ranks",
          [](PyLocalCluster& c, const std::vector<std::string>& command, int world,
             const std::string& job, double timeout_s) {
            absl::StatusOr<std::vector<testing::RankResult>> results;
            {
              GilReleased release;
              results = c.get().RunRanks(command, world, job, absl::Seconds(timeout_s));
            }
            std::vector<std::tuple<int, int, std::string>> out;
            for (const auto& r : ValueOrThrow(std::move(results))) {
              out.emplace_back(r.rank, r.exit_code, r.output);
            }
            return out;
          },
          nb::arg("command"), nb::arg("world_size"), nb::arg("job_id"), nb::arg("timeout_s"),
          "Runs world_size processes ({rank} {world} {socket} {local_rank} {job} substituted); "
          "returns (rank, exit_code, output) each.")
      .def("coordinator_output", [](PyLocalCluster& c) { return c.get().CoordinatorOutput(); })
      .def(
          "sidecar_output", [](PyLocalCluster& c, int i) { return c.get().SidecarOutput(i); },
          nb::arg("index"))
      .def("close", &PyLocalCluster::Close)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyLocalCluster& c, nb::args) { c.Close(); });
}

}  // namespace accord::python
