"""accord.connect() with nothing set: embedded mode under real torchrun, real
daemons, real processes (docs/EMBEDDED.md).

Each job runs with no ACCORD_* variable, its own TMPDIR and a tag in its
environment, which the daemons inherit: after the job, no process carrying the
tag may be left and TMPDIR must be empty (no socket, no temp dir).
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

import accord
import accord.embedded as embedded

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "embedded_scenarios.py")
JOB_TIMEOUT_S = 240
CLEANUP_BOUND_S = 15

pytestmark = pytest.mark.skipif(not accord.HAVE_CLIENT, reason="built without the client")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One job's environment: no ACCORD_* variable (the daemons are found in
    the package's accord/bin), a private TMPDIR, a tag."""

    def __init__(self, tmp_path, name):
        self.tag = uuid.uuid4().hex
        # Short: the sidecar's socket goes there (sun_path holds 107 bytes).
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="acc-emb-", dir="/tmp"))
        self.out = tmp_path / f"{name}-out"
        self.out.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ACCORD_")}
        # The staged package must be importable without ACCORD_BIN_DIR.
        pkg = os.path.dirname(os.path.dirname(os.path.abspath(accord.__file__)))
        env["PYTHONPATH"] = os.pathsep.join([pkg, HERE])
        env.update(TMPDIR=str(self.tmp), EMBEDDED_TEST_TAG=self.tag, OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(k, None)
        self.env = env

    def torchrun(self, scenario, *args):
        cmd = [sys.executable, "-m", "torch.distributed.run", *args, SCRIPT, scenario,
               str(self.out)]
        return subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def rank(self, scenario, rank, world, local_rank, local_world, group_rank, port):
        env = dict(self.env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                   LOCAL_WORLD_SIZE=str(local_world), GROUP_RANK=str(group_rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return subprocess.Popen([sys.executable, SCRIPT, scenario, str(self.out)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def results(self, world):
        out = {}
        for r in range(world):
            path = self.out / f"rank{r}.json"
            assert path.exists(), f"rank {r} wrote no result"
            out[r] = json.loads(path.read_text())
        return out

    def leftovers(self):
        """(live processes carrying this job's tag, accord entries left in TMPDIR)."""
        needle = f"EMBEDDED_TEST_TAG={self.tag}".encode()
        procs = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            state = stat[stat.rindex(")") + 2]
            if state != "Z":  # a zombie runs nothing; its parent may not reap it
                procs.append(f"{pid} {cmd}")
        # torchrun keeps its own torchelastic_* log dirs there.
        return procs, sorted(f for f in os.listdir(self.tmp) if f.startswith("accord"))

    def assert_clean(self):
        # A killed rank's daemons die by their death signal and its temp dir
        # goes by its reaper, both asynchronously: wait, bounded, for that.
        deadline = time.monotonic() + CLEANUP_BOUND_S
        while True:
            procs, files = self.leftovers()
            if not procs and not files:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return
            if time.monotonic() > deadline:
                pytest.fail(f"left behind after the job: processes {procs}, TMPDIR {files}")
            time.sleep(0.1)


def finish(proc, what):
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{what} still running after {JOB_TIMEOUT_S} s; output:\n{out}")
    return proc.returncode, out


def check_decide(job, world, out):
    res = job.results(world)
    assert {r["mode"] for r in res.values()} == {embedded.EMBEDDED}, out
    assert len({r["job_id"] for r in res.values()}) == 1, out
    assert len({r["coordinator"] for r in res.values()}) == 1, out
    first = res[0]["decisions"]
    for r in range(world):
        assert res[r]["decisions"] == first, f"rank {r} decided otherwise:\n{out}"
    # Only rank 0 had gradients: w (fp32) and b (bf16) are zero-filled
    # elsewhere and reduced in fp32; `unused` is skipped everywhere.
    assert first[0]["wire"] == "float32"
    assert first[0]["included"] == [True, True, False]
    assert first[0]["skip"] == [2]
    assert [d["step"] for d in first] == [0, 1]
    assert res[0]["metrics"]["coordinator"].startswith("http://127.0.0.1:")
    # accordctl reaches the embedded coordinator as it would a deployed one.
    status = res[0]["accordctl_status"]
    assert status["rc"] == 0, status["out"]
    assert f"job {res[0]['job_id']}: world size {world}, {world} ranks connected" in \
        status["out"], status["out"]
    announced = [ln for ln in out.splitlines() if "accord: embedded mode" in ln]
    assert len(announced) == 1, f"expected one mode line from rank 0:\n{out}"
    assert "metrics: coordinator http://" in announced[0]
    return res


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_single_node_connects_with_nothing_set(tmp_path, nproc):
    job = Job(tmp_path, "single")
    code, out = finish(job.torchrun("decide", "--standalone", f"--nproc-per-node={nproc}"),
                       "torchrun")
    assert code == 0, out
    res = check_decide(job, nproc, out)
    assert len({r["socket"] for r in res.values()}) == 1, "one node, one sidecar"
    job.assert_clean()


def test_two_torchrun_agents_on_loopback_start_two_sidecars(tmp_path):
    job = Job(tmp_path, "twoagents")
    port = free_port()
    common = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}"]
    agents = [job.torchrun("decide", *common, f"--node-rank={n}") for n in (0, 1)]
    outs = [finish(a, f"torchrun agent {n}") for n, a in enumerate(agents)]
    out = "\n".join(o for _, o in outs)
    assert [c for c, _ in outs] == [0, 0], out
    res = check_decide(job, 4, out)
    # No --rdzv-id: torchrun's run id is "none", so rank 0 drew the job id.
    assert res[0]["job_id"].startswith("accord-")
    sockets = {r["socket"] for r in res.values()}
    assert len(sockets) == 2, f"expected one sidecar per agent, got {sockets}"
    assert len([k for k in res[0]["metrics"] if k.startswith("sidecar")]) == 1
    job.assert_clean()


def test_two_jobs_at_once_on_one_host(tmp_path):
    jobs = [Job(tmp_path, f"job{i}") for i in (0, 1)]
    procs = [j.torchrun("decide", "--standalone", "--nproc-per-node=2") for j in jobs]
    outs = [finish(p, f"job {i}") for i, p in enumerate(procs)]
    for (code, out) in outs:
        assert code == 0, out
    res = [check_decide(j, 2, o) for j, (_, o) in zip(jobs, outs)]
    assert res[0][0]["job_id"] != res[1][0]["job_id"]
    assert res[0][0]["coordinator"] != res[1][0]["coordinator"]
    assert res[0][0]["socket"] != res[1][0]["socket"]
    for j in jobs:
        j.assert_clean()


@pytest.mark.parametrize("nodes", [1, 2], ids=["one_node", "two_nodes"])
def test_rank0_killed_others_fail_and_nothing_is_left(tmp_path, nodes):
    """Rank 0 started the coordinator (and, on one node, the sidecar). Ranks
    started directly, not by torchrun, whose agent would kill them first."""
    job = Job(tmp_path, "kill")
    port = free_port()
    world = 2
    local_world = world // nodes
    procs = [job.rank("kill_rank0", r, world, r % local_world, local_world, r // local_world,
                      port) for r in range(world)]
    rc0, out0 = finish(procs[0], "rank 0")
    rc1, out1 = finish(procs[1], "rank 1")
    assert rc0 == -signal.SIGKILL, out0
    assert rc1 == 0, out1
    res1 = job.results(world)[1]
    assert res1["error"] is not None, f"rank 1 got a decision without rank 0:\n{out1}"
    # Either rank 1's sidecar went first (it dies with rank 0 on one node, or
    # its lifeline stops it), or the coordinator heard of rank 0 leaving
    # before that and named it; both end rank 1 at once.
    err = res1["error"]
    assert (err.startswith("UNAVAILABLE") and "sidecar at " in err
            and "closed the connection" in err) or (
        "rank 0 left" in err and "missing ranks 0: rank 0 " in err), err
    if nodes == 2:
        # Rank 1's own sidecar outlived rank 0; its lifeline stopped it.
        assert "which ran this job's accord-coordinator" in out1, out1
    job.assert_clean()


def test_world_size_disagreeing_with_the_process_group_is_refused(tmp_path):
    job = Job(tmp_path, "mismatch")
    p = job.rank("world_mismatch", 0, 1, 0, 1, 0, free_port())
    code, out = finish(p, "rank")
    assert code == 0, out
    err = job.results(1)[0]["error"]
    assert err == (
        "accord.connect: WORLD_SIZE=2 (environment) disagrees with torch.distributed: "
        "dist.get_world_size() is 1; the environment does not describe this process group. "
        "Unset WORLD_SIZE or pass world_size= explicitly")
    job.assert_clean()


def stale_socket(path):
    """A socket file nobody listens on, as a killed sidecar leaves it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    return str(path)


def test_stale_accord_socket_gets_an_error_naming_the_path(tmp_path):
    path = stale_socket(tmp_path / "stale.sock")
    code = (
        "import accord\n"
        "try:\n"
        "    accord.connect(connect_timeout_s=2)\n"
        "except accord.Error as e:\n"
        "    import pickle\n"
        "    back = pickle.loads(pickle.dumps(e))\n"
        "    print('ERROR', e)\n"
        "    print('CODE', accord.error_code(e), accord.error_code(back), e.local_timeout)\n"
    )
    env = dict(Job(tmp_path, "stale").env, ACCORD_SOCKET=path, ACCORD_JOB_ID="stale-job",
               RANK="0", WORLD_SIZE="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ERROR UNAVAILABLE: cannot reach the sidecar at " + path), p.stdout
    assert (f"[ACCORD_SOCKET={path}: {path} exists but nothing listens on it (connection "
            f"refused): a stale socket left by a sidecar that is gone; start accord-sidecar "
            f"--socket={path}, or unset ACCORD_SOCKET") in p.stdout, p.stdout
    # The hinted error is built with its code (and keeps it through pickling).
    assert p.stdout.endswith("\nCODE UNAVAILABLE UNAVAILABLE False\n"), p.stdout


@pytest.mark.skipif(not accord.HAVE_CLUSTER, reason="built without the local cluster")
def test_a_deployed_sidecar_on_the_default_socket_is_chosen(tmp_path):
    stale = stale_socket(tmp_path / "stale.sock")
    with accord.LocalCluster(num_sidecars=1) as cluster:
        sock, _ = cluster.socket_for(0, 1)
        choice = embedded.choose_mode(environ={}, default_socket=sock)
        assert choice.mode == embedded.DEPLOYED and choice.socket_path == sock
        # ACCORD_SOCKET wins over a deployed sidecar.
        choice = embedded.choose_mode(environ={"ACCORD_SOCKET": stale}, default_socket=sock)
        assert choice.mode == embedded.ENV and choice.socket_path == stale
    # A stale default socket is no deployment: embedded, and the reason says why.
    choice = embedded.choose_mode(environ={}, default_socket=stale)
    assert choice.mode == embedded.EMBEDDED
    assert "nothing listens on it" in choice.reason


def test_connect_without_a_process_group_says_what_to_set(tmp_path):
    code = (
        "import accord\n"
        "try:\n"
        "    accord.connect()\n"
        "except ValueError as e:\n"
        "    print('ERROR', e)\n"
    )
    env = dict(Job(tmp_path, "nodist").env, RANK="0", WORLD_SIZE="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    if "ERROR" not in p.stdout:
        pytest.skip("a deployed sidecar answers on /run/accord/sidecar.sock here")
    assert "embedded mode needs torch.distributed initialized" in p.stdout, p.stdout
    assert "set ACCORD_SOCKET" in p.stdout


def test_console_script_shims_exec_the_bundled_programs(tmp_path):
    for fn, name in (("coordinator", "accord-coordinator"), ("sidecar", "accord-sidecar"),
                     ("relay", "accord-relay"), ("accordctl", "accordctl")):
        code = f"import sys; sys.argv[0] = {name!r}; from accord import _entry; _entry.{fn}()"
        p = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True,
                           text=True, timeout=60, env=Job(tmp_path, f"shim-{fn}").env)
        text = p.stdout + p.stderr
        assert name in text, f"{name} --help through the shim:\n{text}"


def test_doctor_reports_programs_and_the_mode(tmp_path):
    env = Job(tmp_path, "doctor").env
    p = subprocess.run([sys.executable, "-m", "accord", "doctor", "--json"], env=env,
                       capture_output=True, text=True, timeout=120)
    report = json.loads(p.stdout)
    for name in ("accord-coordinator", "accord-sidecar", "accord-relay", "accordctl"):
        assert report["programs"][name]["bundled"], report["programs"]
    assert report["accord"]["HAVE_CLIENT"] is True
    assert report["connect()"]["mode"] in (embedded.EMBEDDED, embedded.DEPLOYED)
    assert report["deployed sidecar"]["socket"] == embedded.DEFAULT_SOCKET
    stale = stale_socket(tmp_path / "stale.sock")
    p = subprocess.run([sys.executable, "-m", "accord", "doctor"],
                       env=dict(env, ACCORD_SOCKET=stale), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stdout
    assert f"would use: {embedded.ENV}" in p.stdout
    assert f"{stale} exists but nothing listens on it" in p.stdout
