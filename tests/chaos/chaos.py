#!/usr/bin/env python3
"""Chaos: random fault schedules against real daemons and real ranks, with an oracle.

Each schedule is drawn from one seed: a job (world, groups, gradient rules,
an optional key-value rendezvous), a topology (one sidecar with local
decisions, two sidecars, or two sidecars behind a relay) and 1-3 faults at
random times inside the job: SIGKILL, SIGSTOP/SIGCONT and restarts of the
coordinator, relay, sidecars and ranks; cuts, blackholes and delays of the
TCP links (a proxy on each); and an event-log disk that is full or slow.
docs/RELIABILITY.md ("Chaos") lists the faults, the oracle and the figures.

The oracle checks every run:
- no hang: every rank process ends within the bound (the last fault or heal
  + deadline + grace + node reconnect grace + backoff + slack);
- no divergent decision: every (group, step) decision any rank printed is
  the same on every rank;
- the ranks the faults did not touch all finish with the digest of the
  undisturbed job, or all end with one identical error (two exceptions,
  allowed and reported: ranks split into two runs of the job, each naming
  the other's ranks, and the ranks of a node cut off from the coordinator
  past its loss limit, which end with the loss words);
- no daemon crash other than the ones killed, and every daemon stops
  cleanly on SIGTERM at the end;
- nothing leaked: no run of the job at the coordinator, no metric series of
  the job at any daemon (after --metrics_series_grace), daemons' RSS under
  the stated bound.

    tests/chaos/chaos.py --schedules 50 --first-seed 1        # a campaign
    tests/chaos/chaos.py --seed 17 -v                          # one schedule
    tests/chaos/chaos.py --corpus tests/chaos/corpus.jsonl       # replay kept seeds

A failing seed prints the one-line command that reproduces it; with
--record it is appended to the corpus, which CTest replays.
"""

import argparse
import collections
import copy
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import Proc, Proxy, free_port, rss_kib  # noqa: E402

DEADLINE_S = 2.0
# The undisturbed reference job is not under test: a deadline and a bound
# that a loaded machine (CI runs this beside the Python tests) cannot reach.
BASELINE_DEADLINE_S = 30.0
BASELINE_BOUND_S = 120.0
GRACE_S = min(1.0, DEADLINE_S / 4)  # the coordinator's progress grace, docs/RELIABILITY.md
NODE_GRACE_S = 1.5  # --node_reconnect_grace
BACKOFF_MAX_S = 0.5  # --reconnect_max_backoff of sidecars and relays
# --upstream_loss_limit of sidecars and relays: above the longest link fault or stop
# (5 s) plus a reconnect, so only a node above killed for good reaches it.
LOSS_LIMIT_S = 7.0
KEEPALIVE_S = 1.0
SLACK_S = 3.0
RSS_BOUND_KIB = 256 * 1024
# How long what a job leaves may take to go: the coordinator's series grace
# (1 s here), a relay's and the coordinator's node grace, and slack.
LEAK_POLL_S = 1.0 + 2 * NODE_GRACE_S + 2.0
STEPS = 10
GROUPS = 2
PARAMS = 4
TORCH_SHARE = 0.1  # share of schedules that run the accord.torch job
TORCH_STEPS = 8
TORCH_READY_S = 60.0  # at most this long for a torch rank's start (import, Gloo, FSDP2, install)

# Gradient rules of the job (RANK:PARAM:STEP:DTYPE, rank_scenario_main.cc):
# one of these per schedule, so the undisturbed digests are few and cached.
RULES = (
    "",
    "1:2:*:none,0:3:4:bfloat16",
    "*:1:*:none,1:1:*:bfloat16,0:0:3:none,1:3:7:float16",
)

# Fault kinds and their weights.
FAULTS = {
    "kill_rank": 2, "restart_rank": 1, "stop_rank": 2,
    "kill_sidecar": 1, "restart_sidecar": 3, "stop_sidecar": 2,
    "restart_coordinator": 3, "stop_coordinator": 2, "kill_coordinator": 1,
    "restart_relay": 2, "stop_relay": 1, "kill_relay": 1,
    "cut_link": 3, "blackhole_link": 2, "delay_link": 2,
}


class Schedule:
    """Everything one seed decides, before anything runs."""

    def __init__(self, seed, kinds=None, relay_kinds=None):
        rng = random.Random(seed)
        self.seed = seed
        self.world = rng.choice((2, 4))
        self.rules = rng.randrange(len(RULES))
        self.kv = rng.random() < 0.3
        self.step_delay_ms = rng.choice((60, 100, 150))
        self.torch = rng.random() < TORCH_SHARE
        if self.torch:  # the accord.torch job: 2 ranks, its own data and model
            self.world, self.rules, self.kv, self.step_delay_ms = 2, 0, False, 150
        topo = rng.random()
        self.sidecars = 1 if topo < 0.2 else 2
        self.relay = self.sidecars == 2 and topo > 0.65
        self.disk = rng.choices(("file", "full", "slow"), (6, 1, 1))[0]
        job_s = self.job_s()
        if self.relay and relay_kinds:
            kinds = relay_kinds
        kinds = [k for k in (kinds or FAULTS) if self.relay or "relay" not in k]
        if self.torch:
            # A restarted torch rank cannot rejoin its peers' process group
            # (restarting a rank is restarting the job: the launcher's part).
            kinds = [k for k in kinds if k != "restart_rank"]
        weights = [FAULTS[k] for k in kinds]
        self.faults = []
        for _ in range(rng.choice((1, 1, 2, 2, 3))):
            kind = rng.choices(kinds, weights)[0]
            at = round(rng.uniform(0.0, job_s), 3)
            f = {"kind": kind, "at": at}
            if kind.endswith("_rank"):
                f["target"] = rng.randrange(self.world)
            elif kind.endswith("_sidecar"):
                f["target"] = rng.randrange(self.sidecars)
            elif kind.endswith("_link"):
                # link i: sidecar i's upstream; link "relay": the relay's upstream
                links = list(range(self.sidecars)) + (["relay"] if self.relay else [])
                f["target"] = rng.choice(links)
            if kind.startswith(("stop_", "cut_", "blackhole_", "delay_")):
                f["for"] = round(rng.uniform(0.1, 2.5 * DEADLINE_S), 3)
            if kind.startswith("restart_"):
                f["down"] = round(rng.uniform(0.0, 1.5 * NODE_GRACE_S), 3)
            if kind == "delay_link":
                f["delay"] = round(rng.uniform(0.01, 0.3), 3)
            self.faults.append(f)
        self.faults.sort(key=lambda f: f["at"])
        # Faults on one target never overlap: each starts after the previous
        # one on it has healed (a process restarted twice at once is not a
        # fault a cluster sees).
        busy = {}
        for f in self.faults:
            who = (f["kind"].split("_", 1)[1], f.get("target"))
            f["at"] = round(max(f["at"], busy.get(who, 0.0)), 3)
            busy[who] = f["at"] + f.get("for", 0.0) + f.get("down", 0.0) + 0.05

    FIELDS = ("world", "rules", "kv", "step_delay_ms", "torch", "sidecars", "relay", "disk",
              "faults")

    def fields(self):
        """The whole schedule, as kept in the corpus (replayed exactly, even
        after the way seeds draw schedules changes)."""
        return {k: getattr(self, k) for k in self.FIELDS}

    def job_s(self):
        return (TORCH_STEPS if self.torch else STEPS) * self.step_delay_ms / 1000

    def job_key(self):
        return (self.torch, self.world, self.rules)

    def describe(self):
        topo = f"{self.sidecars} sidecar(s)" + (" behind a relay" if self.relay else "")
        what = "accord.torch job" if self.torch else f"rules {self.rules}"
        return (f"seed {self.seed}: world {self.world}, {topo}, {what}, "
                f"kv {self.kv}, disk {self.disk}, faults {json.dumps(self.faults)}")


class Cluster:
    """The daemons of one run, each upstream link through a Proxy."""

    def __init__(self, bins, work, sched, job, deadline_s=DEADLINE_S):
        self.bins, self.work, self.sched, self.job = bins, work, sched, job
        self.procs = {}
        self.proxies = {}
        self.coord_port = free_port()
        self.event_log = os.path.join(work, "events.jsonl")
        self.slow_reader = None
        if sched.disk == "full":
            os.symlink("/dev/full", self.event_log)
        elif sched.disk == "slow":
            os.mkfifo(self.event_log)
            self.slow_reader = SlowReader(self.event_log)
        coord = Proc("coordinator", [
            bins["coordinator"], f"--listen=127.0.0.1:{self.coord_port}", "--metrics_port=0",
            f"--deadline={deadline_s}s", f"--node_reconnect_grace={NODE_GRACE_S}s",
            f"--keepalive_time={KEEPALIVE_S}s", f"--keepalive_timeout={KEEPALIVE_S}s",
            "--metrics_series_grace=1s", f"--event_log={self.event_log}",
        ], work)
        self.procs["coordinator"] = coord
        coord.start()
        coord.wait_line("accord-coordinator listening on", 20)
        self.coord_metrics = coord.wait_line("accord-coordinator metrics on", 5)
        upstream = self.coord_port
        if sched.relay:
            self.proxies["relay"] = Proxy(self.coord_port)
            self.relay_port = free_port()
            relay = Proc("relay", [
                bins["relay"], f"--listen=127.0.0.1:{self.relay_port}", "--metrics_port=0",
                f"--coordinator=127.0.0.1:{self.proxies['relay'].port}", "--relay_id=relay0",
                f"--node_reconnect_grace={NODE_GRACE_S}s",
                f"--upstream_loss_limit={LOSS_LIMIT_S}s",
                f"--reconnect_max_backoff={BACKOFF_MAX_S}s",
                f"--keepalive_time={KEEPALIVE_S}s", f"--keepalive_timeout={KEEPALIVE_S}s",
            ], work)
            self.procs["relay"] = relay
            relay.start()
            relay.wait_line("accord-relay listening on", 20)
            upstream = self.relay_port
        self.sockets = []
        for i in range(sched.sidecars):
            self.proxies[i] = Proxy(upstream)
            sock = os.path.join(work, f"sidecar{i}.sock")
            self.sockets.append(sock)
            sc = Proc(f"sidecar{i}", [
                bins["sidecar"], f"--coordinator=127.0.0.1:{self.proxies[i].port}",
                f"--socket={sock}", f"--node_id=node{i}", "--metrics_port=0",
                f"--reconnect_max_backoff={BACKOFF_MAX_S}s", "--job_handover_timeout=2s",
                f"--keepalive_time={KEEPALIVE_S}s", f"--keepalive_timeout={KEEPALIVE_S}s",
                f"--upstream_loss_limit={LOSS_LIMIT_S}s",
            ], work)
            self.procs[f"sidecar{i}"] = sc
            sc.start()
            sc.wait_line("accord-sidecar serving", 20)

    def daemons(self):
        return [p for n, p in self.procs.items() if not n.startswith("rank")]

    def metrics_urls(self):
        urls = []
        for p in self.daemons():
            if not p.alive():
                continue
            for _, line in p.output(p.incarnation):
                m = re.search(r"metrics on (http://\S+)", line)
                if m:
                    urls.append((p.name, m.group(1)))
        return urls

    def close(self):
        for p in self.procs.values():
            p.kill()
        for x in self.proxies.values():
            x.close()
        if self.slow_reader:
            self.slow_reader.stop()


class SlowReader:
    """The coordinator's event log on a disk that is slow: a FIFO with a
    4 KiB buffer, read 512 bytes a second, so the writer blocks on a full
    pipe for most of the run."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            import fcntl
            fcntl.fcntl(self.fd, 1031, 4096)  # F_SETPIPE_SZ
        except OSError:
            pass
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopping:
            try:
                os.read(self.fd, 512)
            except (BlockingIOError, OSError):
                pass
            time.sleep(1.0)

    def stop(self):
        self.stopping = True
        self.thread.join(timeout=3)
        # drain so the coordinator can finish, then close
        end = time.monotonic() + 2
        while time.monotonic() < end:
            try:
                if not os.read(self.fd, 65536):
                    break
            except BlockingIOError:
                time.sleep(0.05)
            except OSError:
                break
        os.close(self.fd)


def rank_args(bins, sched, cluster, rank, job):
    per = sched.world // sched.sidecars
    side = sidecar_of(sched, rank)
    if sched.torch:
        return [
            sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "torch_rank.py"),
            f"--socket={cluster.sockets[side]}", f"--job={job}", f"--rank={rank}",
            f"--world={sched.world}", f"--local_rank={rank - side * per}",
            f"--store={os.path.join(cluster.work, 'store')}", f"--steps={TORCH_STEPS}",
            f"--step_delay={sched.step_delay_ms / 1000}",
            f"--reconnect_grace={NODE_GRACE_S}",
        ], side
    args = [
        bins["rank"], f"--socket={cluster.sockets[side]}", f"--job={job}", f"--rank={rank}",
        f"--world={sched.world}", f"--local_rank={rank - side * per}", f"--groups={GROUPS}",
        f"--params={PARAMS}", f"--steps={STEPS}", f"--rules={RULES[sched.rules]}",
        f"--step_delay={sched.step_delay_ms}ms", "--wait=120s",
        f"--reconnect_grace={NODE_GRACE_S}s",
        # A sidecar not answering at the start (killed, restarting, or
        # stopped for up to 5 s) is waited for as long as a node above that
        # does not answer: a sidecar killed for good ends its ranks within
        # the bound, a stopped one does not end them.
        f"--connect_timeout={LOSS_LIMIT_S}s",
    ]
    if sched.kv:
        args.append("--kv_gather=boot")
    return args, side


DECISION = re.compile(r"^rank (\d+) step (\d+) group (g\d+): wire=(\S+) included=(\d+)/\d+ "
                      r"zero_fill_here=\d+ skipped=\[([^\]]*)\] fp=(\S+)$")
ERROR = re.compile(r"^rank (\d+) (.+?):? error ([A-Za-z_]+): (.*)$")
DIGEST = re.compile(r"^rank (\d+) digest (\S+)$")


def watch_error(p):
    """The step watch's message: it ends the process (exit 3) with the
    coordinator's message as the last line on stderr (accord.torch.watchdog)."""
    path = os.path.join(p.log_dir, f"{p.name}.{p.incarnation}.log")
    lines = [line.strip() for line in open(path, errors="replace") if line.strip()]
    if not lines:
        return None
    at = time.monotonic() - (time.time() - os.path.getmtime(path))
    # The job's verdict ends as a traceback would: `AccordJobError: <words>`
    # (accord.torch.errors), the same line the rank raising it prints.
    m = re.match(r"^(Accord[A-Za-z]*Error): (.*)$", lines[-1])
    if m:
        return (at, m.group(1), m.group(2))
    return (at, "StepWatch", lines[-1])


def rank_list(text):
    out = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def run_starts(work, job):
    """How many times a run of `job` started at one coordinator process (the
    most over its incarnations): a run that ended and started again (a new
    run, or one that took the id of a run whose last node had just left)
    begins without the first one's keys and registrations."""
    most = 0
    for name in os.listdir(work):
        if name.startswith("coordinator.") and name.endswith(".log"):
            with open(os.path.join(work, name), errors="replace") as f:
                most = max(most, sum(1 for line in f if f"job {job}: run " in line and
                                     line.rstrip().endswith(" started")))
    return most


def split_runs(outcomes, starts):
    """Whether differing errors are those of ranks that ended up in different
    runs of the job: a node that reaches the coordinator only after the run
    its ranks belonged to failed and ended starts a new run (its hello is
    NEW, which the coordinator cannot tell from a restart: docs/ARCHITECTURE.md,
    "Runs"); each run then fails at its registration or key-value deadline
    naming exactly the ranks that are not in it (or, a key-value wait in a
    run no node had joined yet, naming nobody). Allowed when a run of the
    job started again at a coordinator (`starts` > 1), every error is such a
    deadline and no error names one of the ranks that got it."""
    if starts < 2:
        return False
    receivers = collections.defaultdict(set)
    for r, (kind, text) in outcomes.items():
        if kind == "error":
            receivers[text].add(r)
    for text, ranks in receivers.items():
        deadline = ("not every rank registered the group" in text or
                    "keys still not set after" in text)
        if not deadline:
            return False
        if "who should set them is not named: no sidecar of job" in text:
            continue  # a run of which no node was there yet: it names nobody
        m = re.search(r"missing ranks ([0-9,\-]+)[: ]", text)
        if not m:
            return False
        if rank_list(m.group(1)) & ranks:
            return False
    return True


def parse_rank(lines):
    """Decisions {(step, group): value}, first error (t, code, message), digest."""
    decisions, error, digest = {}, None, None
    for t, line in lines:
        m = DECISION.match(line)
        if m:
            decisions[(int(m.group(2)), m.group(3))] = m.group(4, 5, 6, 7)
            continue
        m = ERROR.match(line)
        if m and error is None:
            error = (t, m.group(3), m.group(4))
            continue
        m = DIGEST.match(line)
        if m:
            digest = m.group(2)
    return decisions, error, digest


def print_log_tails(work, lines=25, width=400):
    """The end of every process's log and output in a finding's work folder:
    where CI keeps nothing else, this is what shows which wait never ended."""
    try:
        names = sorted(n for n in os.listdir(work) if n.endswith((".log", ".out", ".stacks")))
    except OSError as e:
        print(f"    (no logs: {e})")
        return
    for name in names:
        try:
            with open(os.path.join(work, name), errors="replace") as f:
                text = f.read().splitlines()
            # A hung process's stacks (save_stacks) from the top: its threads.
            tail = text[:4 * lines] if name.endswith(".stacks") else text[-lines:]
        except OSError as e:
            text = tail = [f"(unreadable: {e})"]
        print(f"    --- {name} ({len(tail)} of {len(text)} lines)")
        for line in tail:
            print(f"      {line[:width]}")


def run_job(bins, sched, work, job, faults, verbose=False, deadline_s=DEADLINE_S):
    """Runs the job under `faults`; returns (cluster, ranks, fault log, bound)."""
    cluster = Cluster(bins, work, sched, job, deadline_s)
    ranks = []
    for r in range(sched.world):
        args, _ = rank_args(bins, sched, cluster, r, job)
        p = Proc(f"rank{r}", args, work, env=bins["env"] if sched.torch else None,
                 launch_env=True)
        cluster.procs[p.name] = p
        ranks.append(p)
    for p in ranks:
        p.start()
    if sched.torch:
        # Fault times count from the moment every torch rank is installed
        # (its start takes seconds, and varies): a fault is drawn inside the
        # job's steps, not inside torch's own start, whose rendezvous accord
        # does not serve.
        for r, p in enumerate(ranks):
            try:
                p.wait_line(f"rank {r} ready", TORCH_READY_S)
            except RuntimeError as e:  # the oracle reports the rank's own end
                print(f"  {e}", flush=True)
                break
    t0 = time.monotonic()
    log = []
    events = []
    restarted = []  # (fault index, process, its incarnation that the restart started)
    for i, f in enumerate(faults):
        events.extend(fault_events(f, cluster, ranks, lambda p, i=i: restarted.append(
            (i, p, p.incarnation))))
    events.sort(key=lambda e: e[0])
    last = t0
    for at, what, action in events:
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        now = time.monotonic()
        try:
            action()
            log.append((round(now - t0, 3), what))
        except Exception as e:  # a restart that could not start is a finding
            log.append((round(now - t0, 3), f"{what} FAILED: {e}"))
        last = time.monotonic()
        if verbose:
            print(f"  t={now - t0:6.3f}s {what}", flush=True)
    # What the ranks saw: a restarted daemon is back when it serves, which
    # under load comes seconds after its start (chaos seeds 34 and 35 in CI,
    # next to the Python tests: a sidecar started 5 s late).
    seen = [dict(f) for f in faults]
    for i, p, inc in restarted:
        up = p.ready_time(inc, READY_WAIT_S)
        seen[i]["up"] = round((up if up is not None else time.monotonic() + READY_WAIT_S) - t0, 3)
        last = max(last, t0 + seen[i]["up"])
        if verbose:
            print(f"  t={seen[i]['up']:6.3f}s {p.name} serves again", flush=True)
    job_s = sched.job_s()
    bound_at = max(last, t0 + job_s) + DEADLINE_S + GRACE_S + NODE_GRACE_S + \
        2 * BACKOFF_MAX_S + 2 * KEEPALIVE_S + SLACK_S
    if any(f["kind"] == "kill_coordinator" for f in faults):
        # The sidecars give up on it at their loss limit.
        bound_at = max(bound_at, last + LOSS_LIMIT_S + BACKOFF_MAX_S + SLACK_S)
    return cluster, ranks, log, t0, last, bound_at, seen


# How long the harness waits for a restarted daemon to serve before it counts
# the daemon as away past any grace.
READY_WAIT_S = 30.0


def fault_events(f, cluster, ranks, on_restart=lambda proc: None):
    """(time, description, action) of one fault, its heal included;
    `on_restart(proc)` follows each restart's start."""
    kind, at = f["kind"], f["at"]
    target = f.get("target")
    if kind.endswith("_rank"):
        proc = ranks[target]
    elif kind.endswith("_sidecar"):
        proc = cluster.procs[f"sidecar{target}"]
    elif kind.endswith("_coordinator"):
        proc = cluster.procs["coordinator"]
    elif kind.endswith("_relay"):
        proc = cluster.procs["relay"]
    else:
        proc = None
    name = proc.name if proc else f"link {target}"
    if kind.startswith("kill_"):
        return [(at, f"SIGKILL {name}", proc.kill)]
    if kind.startswith("stop_"):
        return [(at, f"SIGSTOP {name}", lambda: proc.signal(signal.SIGSTOP)),
                (at + f["for"], f"SIGCONT {name}", lambda: proc.signal(signal.SIGCONT))]
    if kind.startswith("restart_"):
        def start_again():
            proc.start()
            if not kind.endswith("_rank"):  # a daemon: when it serves again is measured
                on_restart(proc)
        return [(at, f"SIGKILL {name} (restart)", proc.kill),
                (at + f["down"], f"start {name} again", start_again)]
    proxy = cluster.proxies[target]
    if kind == "cut_link":
        return [(at, f"cut {name}", proxy.cut), (at + f["for"], f"heal {name}", proxy.heal)]
    if kind == "blackhole_link":
        return [(at, f"blackhole {name}", proxy.blackhole),
                (at + f["for"], f"heal {name}", proxy.heal)]
    if kind == "delay_link":
        return [(at, f"delay {name} by {f['delay']}s", lambda: proxy.delay(f["delay"])),
                (at + f["for"], f"heal {name}", proxy.heal)]
    raise ValueError(kind)


# Whether the oracle holds the ranks of a restarted sidecar to the job's one
# outcome (docs/RELIABILITY.md, "Sidecar restart": they resume). Their
# clients reconnect for the node grace (--reconnect_grace /
# reconnect_grace_s), and before their first welcome they try again until the
# connect timeout (a sidecar restarted before its ranks connected: seed 8 of
# a --kinds=restart_sidecar,kill_sidecar campaign, once a finding), so a
# sidecar killed for good ends its ranks within the same bound.
SIDECAR_RESTART_SURVIVED = True


def sidecar_of(sched, rank):
    per = sched.world // sched.sidecars
    return min(rank // per, sched.sidecars - 1)


def touched_ranks(sched, faults):
    """Ranks a fault hit directly, whose own outcome is theirs alone: a rank
    killed or restarted, and the ranks of a sidecar killed for good (they
    cannot hear the job's error: their error is their client's own)."""
    out = set()
    for f in faults:
        if f["kind"] in ("kill_rank", "restart_rank"):
            out.add(f["target"])
        if f["kind"] == "kill_sidecar" or (f["kind"] == "restart_sidecar" and
                                           not SIDECAR_RESTART_SURVIVED):
            out.update(r for r in range(sched.world) if sidecar_of(sched, r) == f["target"])
    # A sidecar away longer than its ranks' reconnect grace (its time down
    # plus its own start) is one killed for good to them.
    for target, away in sidecar_outages(faults).items():
        if any(end - start >= NODE_GRACE_S - GRACE_MARGIN_S for start, end in away):
            out.update(r for r in range(sched.world) if sidecar_of(sched, r) == target)
    return out


# The client's longest wait between reconnect attempts (ClientConnection::kMaxBackoff in
# client/connection.h): a sidecar back for less than this may be missed.
CLIENT_BACKOFF_MAX_S = 1.0


def sidecar_outages(faults):
    """{sidecar: [(start, end)]}: when its ranks find it away. Restarts closer
    together than the client's longest backoff are one outage: a rank waiting
    out its backoff never sees the sidecar in between, and its grace runs from
    the first loss (seed 20071 of a --kinds=restart_sidecar campaign: killed
    again 0.05 s after its restart, away 1.55 s in all)."""
    out = {}
    for f in sorted(faults, key=lambda f: f["at"]):
        if f["kind"] != "restart_sidecar":
            continue
        start, end = f["at"], back_at(f)
        away = out.setdefault(f["target"], [])
        if away and start - away[-1][1] < CLIENT_BACKOFF_MAX_S:
            away[-1] = (away[-1][0], max(away[-1][1], end))
        else:
            away.append((start, end))
    return out


# A node whose path to the coordinator is out (its link or the relay's cut or
# blackholed, the relay or the coordinator stopped or down for a restart,
# the sidecar itself stopped) for longer than its sidecar's loss limit cannot
# hear the job's verdict while it lasts: its ranks end with their sidecar's
# loss words at the limit, while the others may get the coordinator's words
# naming that node (docs/RELIABILITY.md, "Node above lost"). Outages closer
# than a reconnect (backoff + keepalive) count as one: the sidecar has no time
# to get an answer between them. The last answer may come up to a keepalive
# before an outage starts, so one of LOSS_LIMIT_S - KEEPALIVE_S counts.
LOSS_WORDS = "--upstream_loss_limit"
RESTART_S = 0.5  # a restarted daemon's own start, where it was not measured
# A sidecar back this close to its ranks' grace may be found by some of its
# ranks and not by others (each tries at its own jittered times).
GRACE_MARGIN_S = 0.25


def back_at(f):
    """When a restarted daemon served again: measured ("up", run_job), else
    its time down plus a start."""
    return f.get("up", f["at"] + f["down"] + RESTART_S)


def outages_of(faults, node):
    """(start, end) of each fault that leaves `node` with no answer from above;
    faults that end for good (kill_*) are not counted: every node loses the
    coordinator then, and all ranks end with the same loss words."""
    out = []
    for f in faults:
        kind, target, at = f["kind"], f.get("target"), f["at"]
        if kind in ("cut_link", "blackhole_link") and target in (node, "relay"):
            out.append((at, at + f["for"]))
        elif kind == "stop_sidecar" and target == node:
            out.append((at, at + f["for"]))
        elif kind in ("stop_coordinator", "stop_relay"):
            out.append((at, at + f["for"]))
        elif kind in ("restart_coordinator", "restart_relay"):
            out.append((at, back_at(f)))
    return sorted(out)


def cut_off_ranks(sched, faults):
    """Ranks whose node was cut off from the coordinator past its loss limit."""
    out = set()
    for node in range(sched.sidecars):
        merged = []
        for start, end in outages_of(faults, node):
            if merged and start - merged[-1][1] < BACKOFF_MAX_S + KEEPALIVE_S:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        if any(end - start >= LOSS_LIMIT_S - KEEPALIVE_S for start, end in merged):
            out.update(r for r in range(sched.world) if sidecar_of(sched, r) == node)
    return out


def save_stacks(p):
    """Every thread's stack of a hung process, beside its logs (needs gdb)."""
    gdb = shutil.which("gdb")
    if gdb is None or not p.alive():
        return
    path = os.path.join(p.log_dir, f"{p.name}.{p.incarnation}.stacks")
    try:
        with open(path, "w") as f:
            subprocess.run([gdb, "-p", str(p.popen.pid), "-batch", "-ex", "thread apply all bt 40"],
                           stdout=f, stderr=subprocess.STDOUT, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pass


def wait_ranks(ranks, bound_at):
    """Return codes; None for a rank still running at the bound. Every hung
    rank's stacks are saved before any is killed (killing one may free
    another)."""
    while time.monotonic() < bound_at and any(p.alive() for p in ranks):
        time.sleep(0.05)
    hung = [p for p in ranks if p.alive()]
    for p in hung:
        save_stacks(p)
    for p in hung:
        p.kill()
    return {r: (None if p in hung else p.wait_exit(5)) for r, p in enumerate(ranks)}


def series_leaks(name, body, job):
    """Metric series the job must not leave behind. The coordinator removes a
    job's series --metrics_series_grace after its run ended; a sidecar keeps
    the last few ended jobs' counters by design (metrics_sidecar.h), but no
    connected rank or open rank stream; a relay no job it serves."""
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    label = f'job="{job}"'
    if name == "coordinator":
        left = [k for k in samples if label in k]
        return [f"coordinator keeps {len(left)} series of the job, e.g. {left[0]}"] if left else []
    bad = [k for k, v in samples.items() if v != 0 and (
        (label in k and k.startswith(("accord_connected_ranks", "accord_relay_job"))) or
        k.startswith("accord_sidecar_rank_streams"))]
    return [f"{name} still reports {k} = {samples[k]:g}" for k in bad]


class _Skip(Exception):
    pass


def leaks(cluster, job, bins):
    """What the job left behind, polled for a few seconds (series grace 1 s)."""
    found = []
    end = time.monotonic() + LEAK_POLL_S
    coordinator = cluster.procs["coordinator"]
    while True:
        found = []
        try:
            if not coordinator.alive():
                raise _Skip()
            out = subprocess.run(
                [bins["accordctl"], f"--coordinator=127.0.0.1:{cluster.coord_port}",
                 "--json", "status"],
                capture_output=True, text=True, timeout=10)
            if out.returncode == 0:
                status = json.loads(out.stdout or "{}")
                # An ended job stays listed (the observe API's retention) with
                # nothing connected; a node or rank still connected is a leak.
                for j in status.get("jobs", []):
                    if j.get("job_id") != job:
                        continue
                    conn = [n["node_id"] for n in j.get("nodes", []) if n.get("connected")] + \
                        [f"rank {r['rank']}" for r in j.get("ranks", []) if r.get("connected")]
                    if conn:
                        found.append(f"coordinator still has the job's streams: {conn}")
            else:
                found.append(f"accordctl status failed: {out.stderr.strip()[:300]}")
        except _Skip:
            pass  # killed for good by the schedule: nothing to ask
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as e:
            found.append(f"accordctl status: {e}")
        for name, url in cluster.metrics_urls():
            try:
                body = urllib.request.urlopen(url, timeout=5).read().decode()
            except OSError as e:
                found.append(f"{name} metrics unreachable: {e}")
                continue
            found += series_leaks(name, body, job)
        for p in cluster.daemons():
            if p.alive():
                kib = rss_kib(p.popen.pid)
                if kib > RSS_BOUND_KIB:
                    found.append(f"{p.name} RSS {kib} KiB > {RSS_BOUND_KIB} KiB")
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.25)


def stop_daemons(cluster):
    """SIGTERM every live daemon at once; a crash or an unclean stop is a finding."""
    found = []
    stopping = []
    for p in cluster.daemons():
        if not p.alive():
            if not p.killed_by_us:
                code = p.popen.returncode if p.popen else None
                found.append(f"{p.name} died by itself (exit {code}): {p.stderr_tail(600)}")
            continue
        p.signal(signal.SIGCONT)
        p.signal(signal.SIGTERM)
        stopping.append(p)
    end = time.monotonic() + 10
    for p in stopping:
        code = p.wait_exit(max(0.0, end - time.monotonic()))
        if code is None:
            found.append(f"{p.name} did not stop within 10 s of SIGTERM")
            p.kill()
        elif code == -signal.SIGTERM and not p.printed():
            # Signalled while the program was still being loaded, before it
            # could block the signal (daemon/common/signals.cc blocks it
            # before main) and before it printed where it serves: it made
            # nothing, so nothing needed stopping.
            pass
        elif code != 0:
            found.append(f"{p.name} exited {code} on SIGTERM: {p.stderr_tail(600)}")
    for p in cluster.daemons():
        for inc in range(1, p.incarnation + 1):
            path = os.path.join(cluster.work, f"{p.name}.{inc}.log")
            try:
                text = open(path, errors="replace").read()
            except OSError:
                continue
            for marker in ("Check failed", "terminate called", "AddressSanitizer",
                           "ThreadSanitizer", "runtime error:", "Segmentation fault"):
                if marker in text:
                    found.append(f"{p.name} (incarnation {inc}) log has {marker!r}")
    return found


def oracle(sched, ranks, codes, baseline, t0, last, bound_at, starts=1, faults_seen=None):
    """Findings (empty when the run is clean) and a summary of the outcome.
    `faults_seen`: the faults as the ranks saw them (run_job), else as
    scheduled."""
    findings = []
    faults_seen = sched.faults if faults_seen is None else faults_seen
    touched = touched_ranks(sched, faults_seen)
    parsed = {}
    for r, p in enumerate(ranks):
        if codes[r] is None:
            findings.append(f"hang: rank {r} still running {bound_at - t0:.1f}s after the start "
                            f"(bound); last line: {p.output()[-1:]}")
        # decisions of every incarnation count for agreement
        for inc in range(1, p.incarnation + 1):
            parsed[(r, inc)] = parse_rank(p.output(inc))
    # 1. no divergent decision
    seen = {}
    for (r, inc), (decisions, _, _) in parsed.items():
        for key, value in decisions.items():
            if key in seen and seen[key][1] != value and not (inc > 1 or seen[key][0][1] > 1):
                findings.append(f"divergent decision for step {key[0]} group {key[1]}: rank "
                                f"{seen[key][0][0]} got {seen[key][1]}, rank {r} got {value}")
            seen.setdefault(key, ((r, inc), value))
    # 2. outcomes of the ranks no fault hit directly
    outcomes = {}
    worst_error_s = 0.0
    for r, p in enumerate(ranks):
        if r in touched or codes[r] is None:
            continue
        _, error, digest = parsed[(r, p.incarnation)]
        if error is None and digest is None and codes[r] == 3:
            error = watch_error(p)
        if error is not None:
            outcomes[r] = ("error", f"{error[1]}: {error[2]}")
            worst_error_s = max(worst_error_s, error[0] - last)
            if error[0] > bound_at:
                findings.append(f"rank {r} got its error {error[0] - t0:.1f}s after the start, "
                                f"past the bound {bound_at - t0:.1f}s")
        elif digest is not None:
            outcomes[r] = ("ok", digest)
            if digest != baseline:
                findings.append(f"rank {r} finished with digest {digest}, the undisturbed job's "
                                f"is {baseline}")
            if codes[r] != 0:
                findings.append(f"rank {r} printed its digest, then exited {codes[r]}: "
                                f"{p.stderr_tail(300)!r}")
        else:
            tail = [line for _, line in p.output(p.incarnation)[-2:]]
            outcomes[r] = ("exit", codes[r])
            findings.append(f"rank {r} exited {codes[r]} without a digest or an error: {tail}")
    # Ranks cut off past their loss limit that ended with its words: their
    # own outcome (they could not hear the job's); any other outcome of
    # theirs is held to the job's one.
    cut_off = {r for r in cut_off_ranks(sched, faults_seen) & set(outcomes)
               if outcomes[r][0] == "error" and LOSS_WORDS in outcomes[r][1]}
    for r in cut_off:
        del outcomes[r]
    kinds = collections.Counter(o[0] for o in outcomes.values())
    errors = {o[1] for o in outcomes.values() if o[0] == "error"}
    if len(errors) > 1 and split_runs(outcomes, starts):
        errors = {"(split runs) " + e for e in errors}
    elif len(errors) > 1:
        findings.append("ranks ended with different errors: " +
                        " | ".join(f"rank {r}: {o[1][:240]}" for r, o in sorted(outcomes.items())
                                   if o[0] == "error"))
    if kinds["ok"] and kinds["error"]:
        findings.append("some ranks finished while others failed: " +
                        ", ".join(f"rank {r} {o[0]}" for r, o in sorted(outcomes.items())))
    if cut_off:
        result = "cut off"
    elif kinds["error"]:
        result = "error"
    elif kinds["ok"] == len(outcomes):
        result = "finished"
    else:
        result = "other"
    return findings, result, (sorted(errors)[0] if errors else ""), worst_error_s


BASELINES = {}


def baseline_digest(bins, sched, root):
    key = sched.job_key()
    if key in BASELINES:
        return BASELINES[key]
    plain = copy.copy(sched)  # the same job (world, rules, workload), undisturbed
    plain.faults, plain.disk, plain.relay, plain.sidecars, plain.kv = [], "file", False, 2, False
    plain.step_delay_ms = 0 if not sched.torch else 1
    work = tempfile.mkdtemp(prefix="base-", dir=root)
    job = f"base-{sched.seed}"
    cluster, ranks, _, t0, last, bound_at, _ = run_job(bins, plain, work, job, [],
                                                    deadline_s=BASELINE_DEADLINE_S)
    codes = wait_ranks(ranks, max(bound_at, t0 + BASELINE_BOUND_S))
    digests = {parse_rank(p.output())[2] for p in ranks}
    cluster.close()
    if len(digests) != 1 or None in digests:
        said = "; ".join(f"rank {r}: {err[1]}: {err[2]}" if err else f"rank {r}: no error line"
                         for r, err in ((r, parse_rank(p.output())[1])
                                        for r, p in enumerate(ranks)))
        raise RuntimeError(f"the undisturbed job failed (codes {codes}; {said}); see {work}")
    if any(c != 0 for c in codes.values()):
        # Every rank finished with the same digest; an exit status after it
        # is reported by the oracle of the runs that see it, not here.
        print(f"chaos: the undisturbed job's ranks finished but exited {codes}; see {work}",
              flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    BASELINES[key] = digests.pop()
    return BASELINES[key]


def run_schedule(bins, seed, root, verbose=False, overrides=(), kinds=None, relay_kinds=None,
                 keep=False):
    sched = Schedule(seed, kinds, relay_kinds)
    for key, value in overrides:  # --set: one schedule by hand (debugging a finding)
        setattr(sched, key, value)
    baseline = baseline_digest(bins, sched, root)
    work = tempfile.mkdtemp(prefix=f"seed{seed}-", dir=root)
    job = f"chaos-{seed}"
    if verbose:
        print(sched.describe(), flush=True)
    cluster = None
    try:
        cluster, ranks, log, t0, last, bound_at, seen = run_job(bins, sched, work, job,
                                                               sched.faults, verbose)
        codes = wait_ranks(ranks, bound_at)
        findings, result, error, worst = oracle(sched, ranks, codes, baseline, t0, last, bound_at,
                                                run_starts(work, job), seen)
        end_s = time.monotonic() - t0
        if not any(f.startswith("hang") for f in findings):
            findings += leaks(cluster, job, bins)
        findings += stop_daemons(cluster)
    finally:
        if cluster:
            cluster.close()
    report = {
        "seed": seed, "result": result, "error": error[:300], "findings": findings,
        "faults": [f["kind"] for f in sched.faults], "fault_log": log,
        "worst_error_after_last_fault_s": round(worst, 3),
        "bound_after_last_fault_s": round(bound_at - last, 3), "run_s": round(end_s, 2),
        # a restarted daemon's own start: from its start to serving
        "slowest_restart_s": max((f["up"] - f["at"] - f["down"] for f in seen if "up" in f),
                                 default=0.0),
        "work": work,
    }
    if not findings and not keep:
        shutil.rmtree(work, ignore_errors=True)
    return sched, report


def find_bins(args):
    here = os.path.dirname(os.path.abspath(__file__))
    build = args.build or os.environ.get("ACCORD_BUILD_DIR") or \
        os.path.join(here, "..", "..", "build")
    bins = {
        "coordinator": os.path.join(build, "daemon/coordinator/accord-coordinator"),
        "sidecar": os.path.join(build, "daemon/sidecar/accord-sidecar"),
        "relay": os.path.join(build, "daemon/relay/accord-relay"),
        "rank": os.path.join(build, "client/accord-rank-scenario"),
        "accordctl": os.path.join(build, "cli/accordctl"),
    }
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(build, "python/pkg") + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    for name, path in bins.items():
        if not os.access(path, os.X_OK):
            sys.exit(f"chaos: {name} binary not found at {path} (build it, or pass --build)")
    bins["env"] = env
    return bins


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", help="build folder (default: ../../build, or $ACCORD_BUILD_DIR)")
    ap.add_argument("--seed", type=int, action="append", help="run this seed (repeatable)")
    ap.add_argument("--schedules", type=int, default=0, help="run this many seeds ...")
    ap.add_argument("--first-seed", type=int, default=1, help="... starting at this one")
    ap.add_argument("--corpus", help="also replay every seed listed in this file")
    ap.add_argument("--record", help="append failing seeds to this corpus file")
    ap.add_argument("--json", help="write every run's report to this file (JSON lines)")
    ap.add_argument("--keep", action="store_true", help="keep the work folders of clean runs")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                    help="override a field of each schedule, e.g. "
                         "'faults=[{\"kind\": \"kill_coordinator\", \"at\": 0.5}]' or sidecars=1")
    ap.add_argument("--kinds", help="draw faults only from these kinds (comma separated; "
                                    "default: all of " + ", ".join(FAULTS) + ")")
    ap.add_argument("--relay-kinds", help="in schedules with a relay, draw faults only from "
                                          "these kinds instead (comma separated)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    bins = find_bins(args)
    kinds = None
    relay_kinds = None
    if args.relay_kinds:
        relay_kinds = [k for k in args.relay_kinds.split(",") if k]
        unknown = [k for k in relay_kinds if k not in FAULTS]
        if unknown:
            ap.error(f"unknown fault kinds {unknown}; known: {', '.join(FAULTS)}")
    if args.kinds:
        kinds = [k for k in args.kinds.split(",") if k]
        unknown = [k for k in kinds if k not in FAULTS]
        if unknown:
            ap.error(f"unknown fault kinds {unknown}; known: {', '.join(FAULTS)}")
    set_overrides = [(k, json.loads(v)) for k, v in (x.split("=", 1) for x in args.set)]
    runs = [(seed, set_overrides) for seed in args.seed or []]
    runs += [(seed, set_overrides) for seed in
             range(args.first_seed, args.first_seed + args.schedules)]
    if args.corpus:
        # One JSON object per line: {"seed", "found", "schedule": {field: value}}.
        with open(args.corpus) as f:
            for line in f:
                if line.strip() and not line.lstrip().startswith("#"):
                    entry = json.loads(line)
                    runs.append((entry["seed"], sorted(entry["schedule"].items())))
    if not runs:
        ap.error("nothing to run: give --seed, --schedules or --corpus")
    root = tempfile.mkdtemp(prefix="accord-chaos-")
    out = open(args.json, "a") if args.json else None
    by_fault = collections.Counter()
    by_result = collections.Counter()
    failed = []
    worst = (0.0, None)
    slowest_restart = (0.0, None)
    started = time.monotonic()
    for i, (seed, overrides) in enumerate(runs):
        sched, rep = run_schedule(bins, seed, root, args.verbose, overrides, kinds, relay_kinds,
                                   args.keep)
        by_fault.update(rep["faults"])
        by_result[rep["result"]] += 1
        if rep["slowest_restart_s"] > slowest_restart[0]:
            slowest_restart = (rep["slowest_restart_s"], seed)
        if rep["result"] in ("error", "cut off") and rep["worst_error_after_last_fault_s"] > worst[0]:
            worst = (rep["worst_error_after_last_fault_s"], seed)
        status = "CLEAN" if not rep["findings"] else "FAILED"
        print(f"[{i + 1}/{len(runs)}] seed {seed}: {status} {rep['result']} "
              f"({', '.join(rep['faults'])}; {rep['run_s']}s)", flush=True)
        if args.verbose or rep["findings"]:
            if rep["error"]:
                print(f"    error: {rep['error'][:200]}")
        if rep["findings"]:
            failed.append(seed)
            print("    " + sched.describe())
            for f in rep["findings"]:
                print(f"    finding: {f}")
            for t, what in rep["fault_log"]:
                print(f"    t={t}s {what}")
            print(f"    logs: {rep['work']}")
            print_log_tails(rep["work"])
            print(f"    reproduce: tests/chaos/chaos.py --seed {seed} -v" +
                  "".join(f" --set '{k}={json.dumps(v)}'" for k, v in overrides))
            if args.record:
                with open(args.record, "a") as f:
                    f.write(json.dumps({"seed": seed, "found": rep["findings"][0][:300],
                                        "schedule": sched.fields()}) + "\n")
        if out:
            out.write(json.dumps(rep) + "\n")
            out.flush()
    total = time.monotonic() - started
    print(f"chaos: {len(runs)} schedules in {total:.0f}s: "
          f"{by_result['finished']} finished, {by_result['error']} failed with a named error, "
          f"{by_result['cut off']} failed with a node cut off past its loss limit, "
          f"{by_result['other']} other; {len(failed)} with findings")
    print("chaos: faults injected: " + ", ".join(f"{k} {v}" for k, v in sorted(by_fault.items())))
    if worst[1] is not None:
        print(f"chaos: worst time from the last fault to an error: {worst[0]:.2f}s (seed {worst[1]}); "
              f"bound: deadline + grace + node grace + 2 backoff + 2 keepalive + slack = "
              f"{DEADLINE_S + GRACE_S + NODE_GRACE_S + 2 * BACKOFF_MAX_S + 2 * KEEPALIVE_S + SLACK_S:.1f}s")
    if slowest_restart[1] is not None:
        print(f"chaos: slowest restarted daemon, from its start to serving: "
              f"{slowest_restart[0]:.2f}s (seed {slowest_restart[1]}); bounds count from serving")
    if failed:
        print("chaos: failing seeds: " + " ".join(map(str, failed)))
    if not args.keep and not failed:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
