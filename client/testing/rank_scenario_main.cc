// accord-rank-scenario: one rank of a scripted job, for integration tests and
// the demo. Connects to its sidecar, registers groups, submits a manifest per
// group and step as the rules say, waits for each decision and prints it:
//
//   rank 3 step 1 group g0: wire=float32 included=3/4 zero_fill_here=1 skipped=[p3] fp=1a2b...
//   rank 3 step 2 group g0: error FAILED_PRECONDITION: ...
//   rank 3 digest 5c1e...   (over every decision and error, identical on all ranks)
//
// Rules (--rules, separated by spaces or commas) say which gradients a rank
// holds: RANK:PARAM:STEP:DTYPE, each field a number or '*', DTYPE a dtype name
// or "none"; later rules win. Without a rule every parameter has a --dtype
// gradient. Exit status 0 when every expectation (--expect_*) held.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "core/hash.h"

ABSL_FLAG(std::string, socket, "", "the sidecar's Unix socket");
ABSL_FLAG(std::string, job, "job", "job id");
ABSL_FLAG(int, rank, 0, "this rank");
ABSL_FLAG(int, world, 1, "world size");
ABSL_FLAG(int, local_rank, 0, "local rank on the node");
ABSL_FLAG(int, groups, 1, "number of groups g0, g1, ...");
ABSL_FLAG(int, params, 4, "parameters per group p0, p1, ...");
ABSL_FLAG(int, steps, 3, "steps 0..steps-1");
ABSL_FLAG(std::string, dtype, "float32", "default gradient dtype");
ABSL_FLAG(std::string, rules, "", "RANK:PARAM:STEP:DTYPE rules (see the file comment)");
ABSL_FLAG(int, mismatch_rank, -1, "this rank registers p0 with a different size");
ABSL_FLAG(int, silent_rank, -1, "this rank registers but never submits");
ABSL_FLAG(std::string, expect_error, "",
          "expected canonical code name of the first error (e.g. DEADLINE_EXCEEDED)");
ABSL_FLAG(std::string, expect_error_contains, "", "expected substring of that error");
ABSL_FLAG(std::string, expect_wire, "", "expected wire dtype of every decision");
ABSL_FLAG(std::string, expect_skipped, "",
          "expected skipped parameter indices (comma separated; \"-\" for none)");
ABSL_FLAG(absl::Duration, wait, absl::Seconds(60), "how long to wait for each answer");
ABSL_FLAG(std::optional<absl::Duration>, connect_timeout, std::nullopt,
          "how long Connect waits for the sidecar to answer (default: --wait)");
ABSL_FLAG(int, proxied_rank, -1, "this rank connects to --proxy_socket instead of --socket");
ABSL_FLAG(std::string, proxy_socket, "", "see --proxied_rank (fault tests cut its stream)");
ABSL_FLAG(absl::Duration, reconnect_grace, absl::Seconds(10),
          "ClientOptions.reconnect_grace: how long to reconnect to a restarted sidecar (0: not)");
ABSL_FLAG(int, gate_rank, -1, "this rank stops before submitting --gate_step ...");
ABSL_FLAG(int, gate_step, -1, "... until the FIFO --gate_fifo is opened and closed by a writer");
ABSL_FLAG(std::string, gate_fifo, "", "FIFO the gated rank waits on (fault tests)");
ABSL_FLAG(std::string, gate_ranks, "",
          "more ranks gated like --gate_rank (comma separated; one FIFO opening releases all)");
ABSL_FLAG(bool, gate_register, false,
          "the gated ranks wait at the gate before registering their groups instead of before "
          "--gate_step");
ABSL_FLAG(std::string, kv_key, "",
          "before registering, --kv_setter sets this key and every other rank waits for it");
ABSL_FLAG(int, kv_setter, 0, "the rank that sets --kv_key");
ABSL_FLAG(std::string, kv_gather, "",
          "before registering, every rank sets PREFIX/<rank> and waits for PREFIX/0..world-1");
ABSL_FLAG(int, kv_withhold_rank, -1,
          "in the --kv_key/--kv_gather phase this rank sets nothing: it waits at the gate "
          "(--gate_fifo) instead, then exits");
ABSL_FLAG(int, kv_late_rank, -1,
          "this rank waits at the gate (--gate_fifo) before the --kv_key/--kv_gather phase, then "
          "takes part in it");
ABSL_FLAG(int, skip_rank, -1, "this rank does not submit --skip_step (goes on with the next)");
ABSL_FLAG(int, skip_step, -1, "the step --skip_rank skips");
ABSL_FLAG(absl::Duration, step_delay, absl::ZeroDuration(),
          "sleep this long before submitting each step after the first (chaos tests: a job "
          "that lasts long enough for faults to land inside it)");
ABSL_FLAG(bool, print_times, false,
          "also print \"rank R time submitted|error step S at_ms T\", \"rank R time "
          "register|register_error group G at_ms T\" and \"rank R time kv_wait|kv_error at_ms "
          "T\" (Unix ms) lines");

namespace accord {
namespace {

struct Rule {
  int rank = -1, param = -1, step = -1;  // -1: any
  std::optional<DType> dtype;
};

absl::StatusOr<std::vector<Rule>> ParseRules(const std::string& text) {
  std::vector<Rule> out;
  for (absl::string_view item : absl::StrSplit(text, absl::ByAnyChar(" ,"), absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(item, ':');
    if (f.size() != 4) return absl::InvalidArgumentError(absl::StrCat("bad rule \"", item, "\""));
    Rule r;
    int* fields[3] = {&r.rank, &r.param, &r.step};
    for (int i = 0; i < 3; ++i) {
      if (f[i] == "*") continue;
      if (!absl::SimpleAtoi(f[i], fields[i])) {
        return absl::InvalidArgumentError(absl::StrCat("bad number in rule \"", item, "\""));
      }
    }
    if (f[3] != "none") {
      absl::StatusOr<DType> d = ParseDType(f[3]);
      if (!d.ok()) return d.status();
      r.dtype = *d;
    }
    out.push_back(r);
  }
  return out;
}

std::string CodeName(absl::StatusCode c) { return absl::StatusCodeToString(c); }

// Blocks in open(2) until the test opens the FIFO for writing, then until it
// closes it (EOF): an event, not a timed wait.
void WaitAtGate(int rank, const std::string& where) {
  printf("rank %d waiting at gate %s\n", rank, where.c_str());
  fflush(stdout);
  const int fd = open(absl::GetFlag(FLAGS_gate_fifo).c_str(), O_RDONLY);
  if (fd >= 0) {
    char b;
    while (read(fd, &b, 1) > 0) {
    }
    close(fd);
  }
  printf("rank %d passed gate\n", rank);
  fflush(stdout);
}

int Run() {
  const int rank = absl::GetFlag(FLAGS_rank);
  const int world = absl::GetFlag(FLAGS_world);
  const int num_groups = absl::GetFlag(FLAGS_groups);
  const int num_params = absl::GetFlag(FLAGS_params);
  const int steps = absl::GetFlag(FLAGS_steps);
  const absl::Duration wait = absl::GetFlag(FLAGS_wait);
  absl::StatusOr<DType> default_dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  absl::StatusOr<std::vector<Rule>> rules = ParseRules(absl::GetFlag(FLAGS_rules));
  if (!default_dtype.ok() || !rules.ok()) {
    fprintf(stderr, "rank %d: %s\n", rank,
            std::string((default_dtype.ok() ? rules.status() : default_dtype.status()).message())
                .c_str());
    return 2;
  }
  std::optional<DType> expect_wire;
  if (!absl::GetFlag(FLAGS_expect_wire).empty()) {
    absl::StatusOr<DType> d = ParseDType(absl::GetFlag(FLAGS_expect_wire));
    if (!d.ok()) return 2;
    expect_wire = *d;
  }
  std::optional<std::vector<bool>> expect_skipped;
  if (!absl::GetFlag(FLAGS_expect_skipped).empty()) {
    expect_skipped = std::vector<bool>(num_params, false);
    for (absl::string_view s :
         absl::StrSplit(absl::GetFlag(FLAGS_expect_skipped), ',', absl::SkipEmpty())) {
      int i = 0;
      if (s != "-" && absl::SimpleAtoi(s, &i) && i >= 0 && i < num_params)
        (*expect_skipped)[i] = true;
    }
  }
  const std::string expect_error = absl::GetFlag(FLAGS_expect_error);
  const std::string expect_contains = absl::GetFlag(FLAGS_expect_error_contains);

  ClientOptions opts;
  opts.socket_path = rank == absl::GetFlag(FLAGS_proxied_rank) ? absl::GetFlag(FLAGS_proxy_socket)
                                                               : absl::GetFlag(FLAGS_socket);
  opts.job_id = absl::GetFlag(FLAGS_job);
  opts.rank = rank;
  opts.world_size = world;
  opts.local_rank = absl::GetFlag(FLAGS_local_rank);
  opts.connect_timeout = absl::GetFlag(FLAGS_connect_timeout).value_or(wait);
  opts.reconnect_grace = absl::GetFlag(FLAGS_reconnect_grace);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(opts);
  if (!client.ok()) {
    printf("rank %d connect error %s: %s\n", rank, CodeName(client.status().code()).c_str(),
           std::string(client.status().message()).c_str());
    return 1;
  }
  Client& c = **client;

  StableHasher digest;
  std::optional<absl::Status> first_error;
  bool ok = true;
  auto note_error = [&](const std::string& where, const absl::Status& s) {
    printf("rank %d %s: error %s: %s\n", rank, where.c_str(), CodeName(s.code()).c_str(),
           std::string(s.message()).c_str());
    digest.AddU64(static_cast<uint64_t>(s.code()));
    digest.AddBytes(s.message());
    if (!first_error) first_error = s;
  };

  const bool print_times = absl::GetFlag(FLAGS_print_times);
  auto print_time = [&](const char* what, int step) {
    if (!print_times) return;
    printf("rank %d time %s step %d at_ms %lld\n", rank, what, step,
           static_cast<long long>(absl::ToUnixMillis(absl::Now())));
  };
  auto print_time_of = [&](const std::string& what) {
    if (!print_times) return;
    printf("rank %d time %s at_ms %lld\n", rank, what.c_str(),
           static_cast<long long>(absl::ToUnixMillis(absl::Now())));
  };
  bool gated = rank == absl::GetFlag(FLAGS_gate_rank);
  for (absl::string_view r :
       absl::StrSplit(absl::GetFlag(FLAGS_gate_ranks), ',', absl::SkipEmpty())) {
    int x = -1;
    if (absl::SimpleAtoi(r, &x) && x == rank) gated = true;
  }

  // Key-value rendezvous (before registering): one key one rank publishes,
  // or every rank's key under a prefix.
  const std::string kv_key = absl::GetFlag(FLAGS_kv_key);
  const std::string kv_gather = absl::GetFlag(FLAGS_kv_gather);
  if (!kv_key.empty() || !kv_gather.empty()) {
    if (rank == absl::GetFlag(FLAGS_kv_withhold_rank)) {
      WaitAtGate(rank, "kv");
      return 0;
    }
    if (rank == absl::GetFlag(FLAGS_kv_late_rank)) WaitAtGate(rank, "kv");
    std::vector<std::string> wanted;
    absl::Status s;
    if (!kv_key.empty()) {
      if (rank == absl::GetFlag(FLAGS_kv_setter)) {
        s = c.kv().Set(kv_key, absl::StrCat("value of ", kv_key));
      } else {
        wanted.push_back(kv_key);
      }
    } else {
      s = c.kv().Set(absl::StrCat(kv_gather, "/", rank), absl::StrCat("rank ", rank));
      for (int r = 0; r < world; ++r) wanted.push_back(absl::StrCat(kv_gather, "/", r));
    }
    if (s.ok() && !wanted.empty()) {
      print_time_of("kv_wait");
      printf("rank %d kv waiting\n", rank);
      fflush(stdout);
      absl::StatusOr<std::vector<std::string>> got =
          c.kv().Get(wanted, std::chrono::milliseconds(absl::ToInt64Milliseconds(wait)));
      if (!got.ok()) print_time_of("kv_error");
      s = got.status();
    }
    if (!s.ok()) note_error("kv", s);
    fflush(stdout);
  }

  // Registration (all groups), p_i with dim0 = 2*world+1 (padding) and 3 columns.
  if (gated && absl::GetFlag(FLAGS_gate_register) && !first_error) WaitAtGate(rank, "register");
  for (int g = 0; g < num_groups && !first_error; ++g) {
    GroupSpec spec;
    spec.group_id = absl::StrCat("g", g);
    for (int i = 0; i < num_params; ++i) {
      const int64_t dim0 = 2 * world + 1 + i;
      spec.params.push_back({absl::StrCat("p", i), dim0, dim0 * 3});
    }
    if (rank == absl::GetFlag(FLAGS_mismatch_rank)) spec.params[0].numel += spec.params[0].dim0;
    print_time_of(absl::StrCat("register group ", spec.group_id));
    fflush(stdout);  // tests act once every rank sent its registration
    absl::Status s = c.RegisterGroup(spec, Policy(), absl::Now() + wait);
    if (!s.ok()) {
      print_time_of(absl::StrCat("register_error group ", spec.group_id));
      note_error(absl::StrCat("register ", spec.group_id), s);
    }
  }

  const bool silent = rank == absl::GetFlag(FLAGS_silent_rank);
  const absl::Duration step_delay = absl::GetFlag(FLAGS_step_delay);
  for (int step = 0; step < steps && !first_error && !silent; ++step) {
    if (step > 0 && step_delay > absl::ZeroDuration()) absl::SleepFor(step_delay);
    if (gated && !absl::GetFlag(FLAGS_gate_register) && step == absl::GetFlag(FLAGS_gate_step)) {
      WaitAtGate(rank, absl::StrCat("step ", step));
    }
    if (rank == absl::GetFlag(FLAGS_skip_rank) && step == absl::GetFlag(FLAGS_skip_step)) {
      printf("rank %d skips step %d\n", rank, step);
      continue;
    }
    std::vector<GroupSubmission> batch;
    for (int g = 0; g < num_groups; ++g) {
      GroupSubmission sub{absl::StrCat("g", g), step, {}};
      for (int i = 0; i < num_params; ++i) {
        std::optional<DType> d = *default_dtype;
        for (const Rule& r : *rules) {
          if ((r.rank < 0 || r.rank == rank) && (r.param < 0 || r.param == i) &&
              (r.step < 0 || r.step == step)) {
            d = r.dtype;
          }
        }
        sub.grad_dtypes.push_back(d);
      }
      batch.push_back(std::move(sub));
    }
    std::vector<DecisionFuture> futures = c.SubmitBatch(batch);
    print_time("submitted", step);
    printf("rank %d step %d submitted\n", rank, step);
    fflush(stdout);
    for (int g = 0; g < num_groups; ++g) {
      const std::string where = absl::StrCat("step ", step, " group g", g);
      absl::StatusOr<Decision> d = c.Wait(futures[g], absl::Now() + wait);
      if (!d.ok()) {
        print_time("error", step);
        note_error(where, d.status());
        continue;
      }
      int included = 0, zero_fill_here = 0;
      std::vector<std::string> skipped;
      for (int i = 0; i < num_params; ++i) {
        if (d->included[i]) {
          ++included;
          if (!batch[g].grad_dtypes[i].has_value()) ++zero_fill_here;
        } else {
          skipped.push_back(absl::StrCat("p", i));
        }
      }
      printf("rank %d %s: wire=%s included=%d/%d zero_fill_here=%d skipped=[%s] fp=%016llx\n", rank,
             where.c_str(), std::string(DTypeName(d->wire_dtype)).c_str(), included, num_params,
             zero_fill_here, absl::StrJoin(skipped, ",").c_str(),
             static_cast<unsigned long long>(d->layout_fingerprint));
      digest.AddU64(static_cast<uint64_t>(d->step));
      digest.AddU64(static_cast<uint64_t>(d->wire_dtype));
      for (bool b : d->included) digest.AddU64(b ? 1 : 0);
      digest.AddU64(d->layout_fingerprint);
      if (expect_wire && d->wire_dtype != *expect_wire) {
        printf("rank %d %s: EXPECTATION FAILED: wire %s, expected %s\n", rank, where.c_str(),
               std::string(DTypeName(d->wire_dtype)).c_str(),
               std::string(DTypeName(*expect_wire)).c_str());
        ok = false;
      }
      if (expect_skipped) {
        for (int i = 0; i < num_params; ++i) {
          if (d->included[i] == (*expect_skipped)[i]) {
            printf("rank %d %s: EXPECTATION FAILED: p%d %s\n", rank, where.c_str(), i,
                   d->included[i] ? "included, expected skipped" : "skipped, expected included");
            ok = false;
          }
        }
      }
    }
    fflush(stdout);
  }

  // Tell the others this rank is done; the silent rank stays connected until
  // every other rank is done (so its absence is a missing submission, not a
  // departure).
  // Not an error of the run (the chaos oracle reads "error" lines): said in
  // its own words, which fault tests compare across ranks.
  if (absl::Status done = c.kv().Set(absl::StrCat("scenario/done/", rank), "1"); !done.ok()) {
    printf("rank %d done key refused %s: %s\n", rank, CodeName(done.code()).c_str(),
           std::string(done.message()).c_str());
  }
  if (silent) {
    std::vector<std::string> keys;
    for (int r = 0; r < world; ++r) {
      if (r != rank) keys.push_back(absl::StrCat("scenario/done/", r));
    }
    // The coordinator ends each Get at its --deadline (naming who has not
    // set the keys); the others may take longer, so ask again until --wait.
    const absl::Time give_up = absl::Now() + wait;
    absl::StatusOr<std::vector<std::string>> all;
    do {
      all = c.kv().Get(keys, std::chrono::milliseconds(std::max<int64_t>(
                                 1, absl::ToInt64Milliseconds(give_up - absl::Now()))));
    } while (!all.ok() && all.status().code() == absl::StatusCode::kDeadlineExceeded &&
             absl::Now() < give_up);
    printf("rank %d silent: others done: %s\n", rank, all.ok() ? "yes" : "no");
    return all.ok() ? 0 : 1;
  }

  if (!expect_error.empty()) {
    if (!first_error) {
      printf("rank %d EXPECTATION FAILED: no error, expected %s\n", rank, expect_error.c_str());
      ok = false;
    } else if (CodeName(first_error->code()) != expect_error) {
      printf("rank %d EXPECTATION FAILED: error %s, expected %s\n", rank,
             CodeName(first_error->code()).c_str(), expect_error.c_str());
      ok = false;
    }
  } else if (first_error) {
    ok = false;
  }
  if (!expect_contains.empty() &&
      (!first_error || first_error->message().find(expect_contains) == absl::string_view::npos)) {
    printf("rank %d EXPECTATION FAILED: error does not contain \"%s\"\n", rank,
           expect_contains.c_str());
    ok = false;
  }
  printf("rank %d digest %016llx\n", rank, static_cast<unsigned long long>(digest.Finish()));
  fflush(stdout);
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace accord

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return accord::Run();
}
