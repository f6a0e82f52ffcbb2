// accord_gloo_rs_bench: the Gloo reduce-scatter algorithms compared in one
// run (ring over Gloo pairs vs gloo::allreduce + keep own row), W processes
// on this host over loopback, bf16 and fp32 wires.
// Usage: accord_gloo_rs_bench [world=4] [row_mib=4] [iterations=10]
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/collective/collective.h"
#include "tests/collective/dir_kv_store.h"

namespace accord {
namespace {

int RunRank(const std::string& dir, int rank, int world, size_t row_bytes, int iters) {
  testing::DirKeyValueStore kv(dir);
  for (GlooAlgorithm algo : {GlooAlgorithm::kRing, GlooAlgorithm::kAllreduce}) {
    CollectiveOptions o;
    o.gloo_algorithm = algo;
    auto c = CreateCollective(Backend::kGloo, rank, world, kv, absl::StrCat("b", int(algo)), o);
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
      return 1;
    }
    for (DType wire : {DType::kBFloat16, DType::kFloat32}) {
      const int64_t n = static_cast<int64_t>(row_bytes / DTypeSize(wire));
      std::vector<char> in(row_bytes * world, 0), out(row_bytes);
      std::vector<double> t;
      for (int i = 0; i <= iters; ++i) {
        const auto a = std::chrono::steady_clock::now();
        if (!(*c)->ReduceScatterSum(in.data(), out.data(), n, wire).ok()) return 1;
        if (i > 0) {
          t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
        }
      }
      std::sort(t.begin(), t.end());
      if (rank == 0) {
        std::printf("%-10s %-9s W=%d row %.1f MiB: median %.2f ms  (%.2f GB/s of input per rank)\n",
                    algo == GlooAlgorithm::kRing ? "ring" : "allreduce",
                    std::string(DTypeName(wire)).c_str(), world, row_bytes / 1048576.0,
                    t[t.size() / 2] * 1e3, row_bytes * world / t[t.size() / 2] / 1e9);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace accord

int main(int argc, char** argv) {
  const int world = argc > 1 ? std::atoi(argv[1]) : 4;
  const size_t row_bytes = (argc > 2 ? std::atoi(argv[2]) : 4) * size_t{1} << 20;
  const int iters = argc > 3 ? std::atoi(argv[3]) : 10;
  char tmpl[] = "/tmp/accord_gloo_bench.XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(300);
      const int code = accord::RunRank(tmpl, r, world, row_bytes, iters);
      std::fflush(stdout);
      _exit(code);
    }
    pids.push_back(pid);
  }
  int rc = 0;
  for (pid_t p : pids) {
    int status = 0;
    waitpid(p, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  std::filesystem::remove_all(tmpl);
  return rc;
}
