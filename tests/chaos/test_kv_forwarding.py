"""A key-value call survives the coordinator restarting under it (a chaos
finding, docs/RELIABILITY.md "Chaos"): the sidecar holds a call while the
coordinator is unreachable and sends it again when the coordinator is back,
within the call's deadline, instead of failing it with UNAVAILABLE.

Real coordinator and sidecar processes of the build (ACCORD_BUILD_DIR), the
real client through the Python package staged in the build.
"""

import os
import sys
import tempfile
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from procs import Proc, free_port  # noqa: E402

BUILD = os.environ.get("ACCORD_BUILD_DIR", os.path.join(HERE, "..", "..", "build"))
sys.path.insert(0, os.path.join(BUILD, "python", "pkg"))
accord = pytest.importorskip("accord", reason="the Python package is not staged in the build")


def start_daemons(via_relay):
    """A coordinator and a sidecar, the sidecar behind a relay or not."""
    work = tempfile.mkdtemp(prefix="accord-kv-")
    port = free_port()
    coord = Proc("coordinator", [
        os.path.join(BUILD, "daemon/coordinator/accord-coordinator"),
        f"--listen=127.0.0.1:{port}", "--metrics_port=-1", "--deadline=30s"], work)
    coord.start()
    coord.wait_line("accord-coordinator listening on", 20)
    procs = [coord]
    upstream = port
    if via_relay:
        upstream = free_port()
        relay = Proc("relay", [
            os.path.join(BUILD, "daemon/relay/accord-relay"), f"--listen=127.0.0.1:{upstream}",
            "--metrics_port=-1", f"--coordinator=127.0.0.1:{port}", "--relay_id=relay0",
            "--reconnect_max_backoff=0.2s"], work)
        relay.start()
        relay.wait_line("accord-relay listening on", 20)
        procs.append(relay)
    sock = os.path.join(work, "sidecar.sock")
    sidecar = Proc("sidecar", [
        os.path.join(BUILD, "daemon/sidecar/accord-sidecar"),
        f"--coordinator=127.0.0.1:{upstream}", f"--socket={sock}", "--metrics_port=-1",
        "--reconnect_max_backoff=0.2s", "--deadline=20s"], work)
    sidecar.start()
    sidecar.wait_line("accord-sidecar serving", 20)
    procs.append(sidecar)
    return coord, sock, procs


@pytest.fixture
def daemons():
    coord, sock, procs = start_daemons(via_relay=False)
    yield coord, sock
    for p in reversed(procs):
        p.kill()


@pytest.fixture(params=[False, True], ids=["sidecar", "relay"])
def daemons_any_tier(request):
    coord, sock, procs = start_daemons(via_relay=request.param)
    yield coord, sock
    for p in reversed(procs):
        p.kill()


def restart_after(proc, down_s):
    def run():
        time.sleep(down_s)
        proc.start()
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_set_sent_while_the_coordinator_is_down_lands_once_it_is_back(daemons):
    coord, sock = daemons
    a = accord.connect(sock, "kv-job", 0, 2, local_rank=0)
    b = accord.connect(sock, "kv-job", 1, 2, local_rank=1)
    a.kv_set("before", b"1")
    coord.kill()
    t = restart_after(coord, 1.0)
    start = time.monotonic()
    a.kv_set("boot/0", b"id-0")  # held by the sidecar until the coordinator is back
    held = time.monotonic() - start
    t.join()
    assert held >= 0.5, f"the Set returned after {held:.2f}s, before the coordinator was back"
    b.kv_set("boot/1", b"id-1")
    assert b.kv_get(["boot/0", "boot/1"], timeout_s=10) == [b"id-0", b"id-1"]


def test_a_get_waiting_when_the_coordinator_restarts_is_sent_again_and_answered(daemons):
    coord, sock = daemons
    a = accord.connect(sock, "kv-job2", 0, 2, local_rank=0)
    b = accord.connect(sock, "kv-job2", 1, 2, local_rank=1)
    got = {}

    def wait_for_key():
        try:
            got["value"] = a.kv_get(["late"], timeout_s=15)
        except Exception as e:  # noqa: BLE001 - the assertion below names it
            got["error"] = e

    waiter = threading.Thread(target=wait_for_key)
    waiter.start()
    time.sleep(0.5)  # the Get is at the coordinator
    coord.kill()  # ... which dies under it
    restart_after(coord, 0.5).join()
    coord.wait_line("accord-coordinator listening on", 20)
    time.sleep(0.5)
    b.kv_set("late", b"v")
    waiter.join(timeout=20)
    assert not waiter.is_alive(), "the Get never returned"
    assert got.get("value") == [b"v"], f"the Get ended with {got}"


def test_keys_set_before_the_coordinator_restarts_are_there_after_it(daemons_any_tier):
    """Keys live in the coordinator's memory; the sidecar keeps the Sets it
    passed up and sends them again when the connection is back (docs/
    RELIABILITY.md, "Keys across a coordinator restart"). A rendezvous in
    progress across the restart completes: the reader gets the keys set
    before the restart, and one set after it. Behind a relay, the relay's
    forwarder is the one whose connection broke, and it sets them again."""
    coord, sock = daemons_any_tier
    a = accord.connect(sock, "kv-job3", 0, 2, local_rank=0)
    b = accord.connect(sock, "kv-job3", 1, 2, local_rank=1)
    for i in range(5):
        a.kv_set(f"boot/{i}", f"id-{i}".encode())
    a.kv_set("big", bytes(range(256)) * 1024)  # 256 KiB
    coord.kill()
    restart_after(coord, 0.5).join()
    coord.wait_line("accord-coordinator listening on", 20)
    b.kv_set("boot/5", b"id-5")
    wanted = [f"boot/{i}" for i in range(6)] + ["big"]
    got = b.kv_get(wanted, timeout_s=10)
    assert got == [f"id-{i}".encode() for i in range(6)] + [bytes(range(256)) * 1024]
    # Set again by the same sidecar: the same value is accepted, another is not.
    a.kv_set("boot/0", b"id-0")
    with pytest.raises(Exception, match="already set in this run with another value"):
        a.kv_set("boot/0", b"other")
