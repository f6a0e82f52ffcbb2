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
#include <memory>
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

// What the flags ask of this rank.
struct Config {
  int rank = 0;
  int world = 1;
  int groups = 1;
  int params = 4;
  int steps = 3;
  absl::Duration wait;
  DType default_dtype = DType::kFloat32;
  std::vector<Rule> rules;
  bool gated = false;  // --gate_rank or one of --gate_ranks
  bool silent = false;
  bool print_times = false;
};

// What the rank checks (--expect_*).
struct Expectations {
  std::optional<DType> wire;
  std::optional<std::vector<bool>> skipped;  // per parameter
  std::string error;                         // the first error's code name
  std::string error_contains;
};

absl::StatusOr<Config> ConfigFromFlags() {
  Config c;
  c.rank = absl::GetFlag(FLAGS_rank);
  c.world = absl::GetFlag(FLAGS_world);
  c.groups = absl::GetFlag(FLAGS_groups);
  c.params = absl::GetFlag(FLAGS_params);
  c.steps = absl::GetFlag(FLAGS_steps);
  c.wait = absl::GetFlag(FLAGS_wait);
  absl::StatusOr<DType> default_dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!default_dtype.ok()) return default_dtype.status();
  c.default_dtype = *default_dtype;
  absl::StatusOr<std::vector<Rule>> rules = ParseRules(absl::GetFlag(FLAGS_rules));
  if (!rules.ok()) return rules.status();
  c.rules = *std::move(rules);
  c.gated = c.rank == absl::GetFlag(FLAGS_gate_rank);
  for (absl::string_view r :
       absl::StrSplit(absl::GetFlag(FLAGS_gate_ranks), ',', absl::SkipEmpty())) {
    int x = -1;
    if (absl::SimpleAtoi(r, &x) && x == c.rank) c.gated = true;
  }
  c.silent = c.rank == absl::GetFlag(FLAGS_silent_rank);
  c.print_times = absl::GetFlag(FLAGS_print_times);
  return c;
}

// nullopt when --expect_wire names no dtype.
std::optional<Expectations> ExpectationsFromFlags(int num_params) {
  Expectations e;
  if (!absl::GetFlag(FLAGS_expect_wire).empty()) {
    absl::StatusOr<DType> d = ParseDType(absl::GetFlag(FLAGS_expect_wire));
    if (!d.ok()) return std::nullopt;
    e.wire = *d;
  }
  if (!absl::GetFlag(FLAGS_expect_skipped).empty()) {
    e.skipped = std::vector<bool>(num_params, false);
    for (absl::string_view s :
         absl::StrSplit(absl::GetFlag(FLAGS_expect_skipped), ',', absl::SkipEmpty())) {
      int i = 0;
      if (s != "-" && absl::SimpleAtoi(s, &i) && i >= 0 && i < num_params) (*e.skipped)[i] = true;
    }
  }
  e.error = absl::GetFlag(FLAGS_expect_error);
  e.error_contains = absl::GetFlag(FLAGS_expect_error_contains);
  return e;
}

absl::StatusOr<std::unique_ptr<Client>> Connect(const Config& cfg) {
  ClientOptions opts;
  opts.socket_path = cfg.rank == absl::GetFlag(FLAGS_proxied_rank)
                         ? absl::GetFlag(FLAGS_proxy_socket)
                         : absl::GetFlag(FLAGS_socket);
  opts.job_id = absl::GetFlag(FLAGS_job);
  opts.rank = cfg.rank;
  opts.world_size = cfg.world;
  opts.local_rank = absl::GetFlag(FLAGS_local_rank);
  opts.connect_timeout = absl::GetFlag(FLAGS_connect_timeout).value_or(cfg.wait);
  opts.reconnect_grace = absl::GetFlag(FLAGS_reconnect_grace);
  return Client::Connect(opts);
}

// One rank's scripted run over a connected client: what it printed so far
// goes into a digest identical on every rank.
class Scenario {
 public:
  Scenario(Config cfg, Expectations expect, Client& client)
      : cfg_(std::move(cfg)), expect_(std::move(expect)), c_(client) {}

  // The key-value rendezvous (before registering): one key one rank
  // publishes, or every rank's key under a prefix. False when this rank
  // withholds its key (it then exits at once).
  bool KeyValueRendezvous();
  // Registers every group, p_i with dim0 = 2*world+1 (padding) and 3 columns.
  void RegisterGroups();
  void RunSteps();
  // Tells the others this rank is done.
  void SayDone();
  // The silent rank stays connected until every other rank is done (so its
  // absence is a missing submission, not a departure); returns its exit code.
  int AwaitOthers();
  // The exit code by the expectations; prints the digest.
  int Verdict();

 private:
  void NoteError(const std::string& where, const absl::Status& s);
  void PrintTime(const char* what, int step) const;
  void PrintTimeOf(const std::string& what) const;
  std::vector<GroupSubmission> StepBatch(int step) const;
  void CheckDecision(const std::string& where, const GroupSubmission& sub, const Decision& d);

  const Config cfg_;
  const Expectations expect_;
  Client& c_;
  StableHasher digest_;
  std::optional<absl::Status> first_error_;
  bool ok_ = true;
};

void Scenario::NoteError(const std::string& where, const absl::Status& s) {
  printf("rank %d %s: error %s: %s\n", cfg_.rank, where.c_str(), CodeName(s.code()).c_str(),
         std::string(s.message()).c_str());
  digest_.AddU64(static_cast<uint64_t>(s.code()));
  digest_.AddBytes(s.message());
  if (!first_error_) first_error_ = s;
}

void Scenario::PrintTime(const char* what, int step) const {
  if (!cfg_.print_times) return;
  printf("rank %d time %s step %d at_ms %lld\n", cfg_.rank, what, step,
         static_cast<long long>(absl::ToUnixMillis(absl::Now())));
}

void Scenario::PrintTimeOf(const std::string& what) const {
  if (!cfg_.print_times) return;
  printf("rank %d time %s at_ms %lld\n", cfg_.rank, what.c_str(),
         static_cast<long long>(absl::ToUnixMillis(absl::Now())));
}

bool Scenario::KeyValueRendezvous() {
  const int rank = cfg_.rank;
  const std::string kv_key = absl::GetFlag(FLAGS_kv_key);
  const std::string kv_gather = absl::GetFlag(FLAGS_kv_gather);
  if (kv_key.empty() && kv_gather.empty()) return true;
  if (rank == absl::GetFlag(FLAGS_kv_withhold_rank)) {
    WaitAtGate(rank, "kv");
    return false;
  }
  if (rank == absl::GetFlag(FLAGS_kv_late_rank)) WaitAtGate(rank, "kv");
  std::vector<std::string> wanted;
  absl::Status s;
  if (!kv_key.empty()) {
    if (rank == absl::GetFlag(FLAGS_kv_setter)) {
      s = c_.kv().Set(kv_key, absl::StrCat("value of ", kv_key));
    } else {
      wanted.push_back(kv_key);
    }
  } else {
    s = c_.kv().Set(absl::StrCat(kv_gather, "/", rank), absl::StrCat("rank ", rank));
    for (int r = 0; r < cfg_.world; ++r) wanted.push_back(absl::StrCat(kv_gather, "/", r));
  }
  if (s.ok() && !wanted.empty()) {
    PrintTimeOf("kv_wait");
    printf("rank %d kv waiting\n", rank);
    fflush(stdout);
    absl::StatusOr<std::vector<std::string>> got =
        c_.kv().Get(wanted, std::chrono::milliseconds(absl::ToInt64Milliseconds(cfg_.wait)));
    if (!got.ok()) PrintTimeOf("kv_error");
    s = got.status();
  }
  if (!s.ok()) NoteError("kv", s);
  fflush(stdout);
  return true;
}

void Scenario::RegisterGroups() {
  if (cfg_.gated && absl::GetFlag(FLAGS_gate_register) && !first_error_) {
    WaitAtGate(cfg_.rank, "register");
  }
  for (int g = 0; g < cfg_.groups && !first_error_; ++g) {
    GroupSpec spec;
    spec.group_id = absl::StrCat("g", g);
    for (int i = 0; i < cfg_.params; ++i) {
      const int64_t dim0 = 2 * cfg_.world + 1 + i;
      spec.params.push_back({absl::StrCat("p", i), dim0, dim0 * 3});
    }
    if (cfg_.rank == absl::GetFlag(FLAGS_mismatch_rank)) {
      spec.params[0].numel += spec.params[0].dim0;
    }
    PrintTimeOf(absl::StrCat("register group ", spec.group_id));
    fflush(stdout);  // tests act once every rank sent its registration
    absl::Status s = c_.RegisterGroup(spec, Policy(), absl::Now() + cfg_.wait);
    if (!s.ok()) {
      PrintTimeOf(absl::StrCat("register_error group ", spec.group_id));
      NoteError(absl::StrCat("register ", spec.group_id), s);
    }
  }
}

// Every group's manifest at `step`: --dtype, as the rules say.
std::vector<GroupSubmission> Scenario::StepBatch(int step) const {
  std::vector<GroupSubmission> batch;
  for (int g = 0; g < cfg_.groups; ++g) {
    GroupSubmission sub{absl::StrCat("g", g), step, {}};
    for (int i = 0; i < cfg_.params; ++i) {
      std::optional<DType> d = cfg_.default_dtype;
      for (const Rule& r : cfg_.rules) {
        if ((r.rank < 0 || r.rank == cfg_.rank) && (r.param < 0 || r.param == i) &&
            (r.step < 0 || r.step == step)) {
          d = r.dtype;
        }
      }
      sub.grad_dtypes.push_back(d);
    }
    batch.push_back(std::move(sub));
  }
  return batch;
}

void Scenario::RunSteps() {
  const int rank = cfg_.rank;
  const absl::Duration step_delay = absl::GetFlag(FLAGS_step_delay);
  for (int step = 0; step < cfg_.steps && !first_error_ && !cfg_.silent; ++step) {
    if (step > 0 && step_delay > absl::ZeroDuration()) absl::SleepFor(step_delay);
    if (cfg_.gated && !absl::GetFlag(FLAGS_gate_register) &&
        step == absl::GetFlag(FLAGS_gate_step)) {
      WaitAtGate(rank, absl::StrCat("step ", step));
    }
    if (rank == absl::GetFlag(FLAGS_skip_rank) && step == absl::GetFlag(FLAGS_skip_step)) {
      printf("rank %d skips step %d\n", rank, step);
      continue;
    }
    const std::vector<GroupSubmission> batch = StepBatch(step);
    std::vector<DecisionFuture> futures = c_.SubmitBatch(batch);
    PrintTime("submitted", step);
    printf("rank %d step %d submitted\n", rank, step);
    fflush(stdout);
    for (int g = 0; g < cfg_.groups; ++g) {
      const std::string where = absl::StrCat("step ", step, " group g", g);
      absl::StatusOr<Decision> d = c_.Wait(futures[g], absl::Now() + cfg_.wait);
      if (!d.ok()) {
        PrintTime("error", step);
        NoteError(where, d.status());
        continue;
      }
      CheckDecision(where, batch[g], *d);
    }
    fflush(stdout);
  }
}

// Prints the decision, adds it to the digest and checks --expect_wire and
// --expect_skipped.
void Scenario::CheckDecision(const std::string& where, const GroupSubmission& sub,
                             const Decision& d) {
  const int rank = cfg_.rank;
  int included = 0, zero_fill_here = 0;
  std::vector<std::string> skipped;
  for (int i = 0; i < cfg_.params; ++i) {
    if (d.included[i]) {
      ++included;
      if (!sub.grad_dtypes[i].has_value()) ++zero_fill_here;
    } else {
      skipped.push_back(absl::StrCat("p", i));
    }
  }
  printf("rank %d %s: wire=%s included=%d/%d zero_fill_here=%d skipped=[%s] fp=%016llx\n", rank,
         where.c_str(), std::string(DTypeName(d.wire_dtype)).c_str(), included, cfg_.params,
         zero_fill_here, absl::StrJoin(skipped, ",").c_str(),
         static_cast<unsigned long long>(d.layout_fingerprint));
  digest_.AddU64(static_cast<uint64_t>(d.step));
  digest_.AddU64(static_cast<uint64_t>(d.wire_dtype));
  for (bool b : d.included) digest_.AddU64(b ? 1 : 0);
  digest_.AddU64(d.layout_fingerprint);
  if (expect_.wire && d.wire_dtype != *expect_.wire) {
    printf("rank %d %s: EXPECTATION FAILED: wire %s, expected %s\n", rank, where.c_str(),
           std::string(DTypeName(d.wire_dtype)).c_str(),
           std::string(DTypeName(*expect_.wire)).c_str());
    ok_ = false;
  }
  if (expect_.skipped) {
    for (int i = 0; i < cfg_.params; ++i) {
      if (d.included[i] == (*expect_.skipped)[i]) {
        printf("rank %d %s: EXPECTATION FAILED: p%d %s\n", rank, where.c_str(), i,
               d.included[i] ? "included, expected skipped" : "skipped, expected included");
        ok_ = false;
      }
    }
  }
}

void Scenario::SayDone() {
  // Not an error of the run (the chaos oracle reads "error" lines): said in
  // its own words, which fault tests compare across ranks.
  if (absl::Status done = c_.kv().Set(absl::StrCat("scenario/done/", cfg_.rank), "1"); !done.ok()) {
    printf("rank %d done key refused %s: %s\n", cfg_.rank, CodeName(done.code()).c_str(),
           std::string(done.message()).c_str());
  }
}

int Scenario::AwaitOthers() {
  std::vector<std::string> keys;
  for (int r = 0; r < cfg_.world; ++r) {
    if (r != cfg_.rank) keys.push_back(absl::StrCat("scenario/done/", r));
  }
  // The coordinator ends each Get at its --deadline (naming who has not set
  // the keys); the others may take longer, so ask again until --wait.
  const absl::Time give_up = absl::Now() + cfg_.wait;
  absl::StatusOr<std::vector<std::string>> all;
  do {
    all = c_.kv().Get(keys, std::chrono::milliseconds(std::max<int64_t>(
                                1, absl::ToInt64Milliseconds(give_up - absl::Now()))));
  } while (!all.ok() && all.status().code() == absl::StatusCode::kDeadlineExceeded &&
           absl::Now() < give_up);
  printf("rank %d silent: others done: %s\n", cfg_.rank, all.ok() ? "yes" : "no");
  return all.ok() ? 0 : 1;
}

int Scenario::Verdict() {
  const int rank = cfg_.rank;
  if (!expect_.error.empty()) {
    if (!first_error_) {
      printf("rank %d EXPECTATION FAILED: no error, expected %s\n", rank, expect_.error.c_str());
      ok_ = false;
    } else if (CodeName(first_error_->code()) != expect_.error) {
      printf("rank %d EXPECTATION FAILED: error %s, expected %s\n", rank,
             CodeName(first_error_->code()).c_str(), expect_.error.c_str());
      ok_ = false;
    }
  } else if (first_error_) {
    ok_ = false;
  }
  if (!expect_.error_contains.empty() &&
      (!first_error_ ||
       first_error_->message().find(expect_.error_contains) == absl::string_view::npos)) {
    printf("rank %d EXPECTATION FAILED: error does not contain \"%s\"\n", rank,
           expect_.error_contains.c_str());
    ok_ = false;
  }
  printf("rank %d digest %016llx\n", rank, static_cast<unsigned long long>(digest_.Finish()));
  fflush(stdout);
  return ok_ ? 0 : 1;
}

int Run() {
  absl::StatusOr<Config> cfg = ConfigFromFlags();
  if (!cfg.ok()) {
    fprintf(stderr, "rank %d: %s\n", absl::GetFlag(FLAGS_rank),
            std::string(cfg.status().message()).c_str());
    return 2;
  }
  std::optional<Expectations> expect = ExpectationsFromFlags(cfg->params);
  if (!expect.has_value()) return 2;
  absl::StatusOr<std::unique_ptr<Client>> client = Connect(*cfg);
  if (!client.ok()) {
    printf("rank %d connect error %s: %s\n", cfg->rank, CodeName(client.status().code()).c_str(),
           std::string(client.status().message()).c_str());
    return 1;
  }
  const bool silent = cfg->silent;
  Scenario scenario(*std::move(cfg), *std::move(expect), **client);
  if (!scenario.KeyValueRendezvous()) return 0;
  scenario.RegisterGroups();
  scenario.RunSteps();
  scenario.SayDone();
  if (silent) return scenario.AwaitOthers();
  return scenario.Verdict();
}

}  // namespace
}  // namespace accord

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return accord::Run();
}
