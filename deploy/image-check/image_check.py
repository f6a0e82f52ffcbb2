#!/usr/bin/env python3
"""The run-and-check half of scripts/image-check: runs the built image the way
the Helm chart says to run it, and checks it.

    image_check.py plan --work DIR --image REPO:TAG --demo-image REPO:TAG
        Renders deploy/helm/accord with Helm's engine (deploy/render.py; needs the
        deploy virtual environment of deploy/tools-env.sh), extracts every
        container of the coordinator Deployment and the trainer Job (command,
        args, env, ports, volume mounts, probes, security context, resources),
        translates each into a `podman run` command line, materialises the
        pods' volumes (emptyDirs, the secrets made by scripts/image-check) under
        DIR/pods, and writes DIR/plan.json. Anything in the chart that this
        translation does not model is an error, not a silent omission.

    image_check.py run --work DIR
        Runs DIR/plan.json with podman (needs python3-grpcio for the kubelet's
        gRPC probe): the coordinator pod, then per node the native sidecar
        (waiting for its startup probe, as the kubelet does) and the trainer,
        probes, declared ports, /metrics via the ServiceMonitor and PodMonitor
        port names, the demo job across the containers, the event log, a
        graceful stop. Prints one line per check: `image-check: PASS|FAIL name: detail`.

What differs from a cluster, deliberately (deploy/README.md, section 10):
the Service is its pod's IP under the Service's DNS name (--add-host); the
demo's trainer containers share one network namespace of their own instead
of their sidecar's, because the demo rank (demo/demo_rank.cc) binds Gloo to
127.0.0.1; emptyDir size limits are not enforced.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

DEPLOY = Path(__file__).resolve().parent.parent
PODMAN = os.environ.get(
    "ACCORD_PODMAN",
    "podman --storage-driver vfs --runtime runc --cgroup-manager cgroupfs").split()
# Explicit limits: without them runc fails here with "setrlimit ... Operation
# not permitted" (see scripts/image-check).
ULIMITS = ["--ulimit", "nofile=16384:16384", "--ulimit", "nproc=16384:16384"]
LABEL = "accord-image-check=1"
PREFIX = "accord-check-"
NETWORK = "accord-check"
SUBNET = os.environ.get("ACCORD_IMAGE_CHECK_SUBNET", "10.89.71")
JOB_ID = "example-job"
NODES = 2
PROCS_PER_NODE = 4
DEMO_STEPS = 20

# What the trainer runs: the demo image's launcher (deploy/image-check/accord-demo-node).
DEMO_COMMAND = ["/usr/local/bin/accord-demo-node", f"--steps={DEMO_STEPS}"]


class PlanError(Exception):
    pass


# ---------------------------------------------------------------------------
# Kubernetes semantics the translation needs.

def expand(text: str, env: dict[str, str]) -> tuple[str, list[str]]:
    """Kubelet's $(VAR) expansion: $$ is a literal $, an undefined $(VAR) stays
    as it is. Returns the text and the undefined names."""
    out, undefined, i = [], [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            if text[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if text[i + 1] == "(":
                j = text.find(")", i + 2)
                if j != -1:
                    name = text[i + 2:j]
                    if name in env:
                        out.append(env[name])
                    else:
                        out.append(text[i:j + 1])
                        undefined.append(name)
                    i = j + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out), undefined


def quantity_bytes(q: str | int) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    s = str(q)
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[:-len(u)]) * m)
    return int(float(s))


def quantity_cpus(q: str | int | float) -> float:
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


POD_KEYS = {"serviceAccountName", "automountServiceAccountToken", "enableServiceLinks",
            "imagePullSecrets", "securityContext", "terminationGracePeriodSeconds",
            "containers", "initContainers", "volumes", "restartPolicy", "nodeSelector",
            "tolerations", "affinity"}
CONTAINER_KEYS = {"name", "image", "imagePullPolicy", "command", "args", "env", "ports",
                  "startupProbe", "readinessProbe", "livenessProbe", "resources",
                  "securityContext", "volumeMounts", "restartPolicy"}
POD_SC_KEYS = {"runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "seccompProfile",
               "supplementalGroups"}
CONTAINER_SC_KEYS = {"runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile",
                     "readOnlyRootFilesystem", "allowPrivilegeEscalation", "capabilities",
                     "privileged"}


def check_keys(obj: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise PlanError(f"{where}: image-check does not model {', '.join(unknown)}; "
                        "extend deploy/image-check/image_check.py")


def field_ref(path: str, pod: dict[str, Any]) -> str:
    m = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path)
    if m:
        if m.group(1) not in pod["annotations"]:
            raise PlanError(f"fieldRef {path}: pod {pod['name']} has no such annotation")
        return pod["annotations"][m.group(1)]
    known = {"metadata.name": pod["name"], "metadata.namespace": pod["namespace"],
             "spec.nodeName": pod["node"], "status.podIP": pod.get("ip", "")}
    if path not in known:
        raise PlanError(f"fieldRef {path} is not modelled by image-check")
    return known[path]


def translate_container(c: dict, pod_spec: dict, pod: dict, volumes: dict[str, dict],
                        kind: str) -> dict[str, Any]:
    """One container of a rendered pod -> its `podman run` plan."""
    where = f"{pod['name']}/{c['name']}"
    check_keys(c, CONTAINER_KEYS, where)
    # Environment, in order: a value may refer to the variables before it.
    env: dict[str, str] = {}
    problems: list[str] = []
    for e in c.get("env", []):
        if "value" in e:
            v, undef = expand(str(e["value"]), env)
            problems += [f"env {e['name']} refers to undefined $({u})" for u in undef]
        elif "valueFrom" in e and "fieldRef" in e["valueFrom"]:
            v = field_ref(e["valueFrom"]["fieldRef"]["fieldPath"], pod)
        else:
            raise PlanError(f"{where}: env {e['name']}: only value and fieldRef are modelled")
        env[e["name"]] = v
    command, args = [], []
    for src, dst in ((c.get("command", []), command), (c.get("args", []), args)):
        for a in src:
            v, undef = expand(str(a), env)
            problems += [f"argument {a!r} refers to undefined $({u})" for u in undef]
            dst.append(v)
    if not command:
        raise PlanError(f"{where}: no command; the chart must name the program to run")
    # Security context: the pod's, overridden per field by the container's.
    psc = pod_spec.get("securityContext", {})
    csc = c.get("securityContext", {})
    check_keys(psc, POD_SC_KEYS, f"{pod['name']} securityContext")
    check_keys(csc, CONTAINER_SC_KEYS, f"{where} securityContext")
    sc = {**{k: v for k, v in psc.items() if k != "fsGroup"}, **csc}
    run: list[str] = []
    user = None
    if "runAsUser" in sc:
        user = f"{sc['runAsUser']}" + (f":{sc['runAsGroup']}" if "runAsGroup" in sc else "")
        run += ["--user", user]
    groups = [str(g) for g in ([psc["fsGroup"]] if "fsGroup" in psc else [])
              + list(psc.get("supplementalGroups", []))]
    for g in groups:
        run += ["--group-add", g]
    if sc.get("readOnlyRootFilesystem"):
        # Like Kubernetes: nothing writable but the volumes (podman would add
        # tmpfs on /tmp, /run and /var/tmp without --read-only-tmpfs=false).
        run += ["--read-only", "--read-only-tmpfs=false"]
    if sc.get("allowPrivilegeEscalation") is False:
        run += ["--security-opt", "no-new-privileges"]
    caps = sc.get("capabilities", {})
    for cap in caps.get("drop", []):
        run += ["--cap-drop", cap]
    for cap in caps.get("add", []):
        run += ["--cap-add", cap]
    if sc.get("privileged"):
        run += ["--privileged"]
    seccomp = sc.get("seccompProfile", {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        run += ["--security-opt", "seccomp=unconfined"]
    elif seccomp != "RuntimeDefault":
        raise PlanError(f"{where}: seccompProfile {seccomp} is not modelled")
    # Volumes.
    mounts = []
    for m in c.get("volumeMounts", []):
        vol = volumes.get(m["name"])
        if vol is None:
            raise PlanError(f"{where}: volumeMount {m['name']} names no volume of the pod")
        ro = bool(m.get("readOnly"))
        run += ["-v", f"{vol['host']}:{m['mountPath']}:{'ro' if ro else 'rw'}"]
        mounts.append({"volume": m["name"], "path": m["mountPath"], "readOnly": ro,
                       "kind": vol["kind"]})
    # Resources: the limits, as the kubelet sets them on the cgroup.
    limits = c.get("resources", {}).get("limits", {})
    if "memory" in limits:
        run += ["--memory", str(quantity_bytes(limits["memory"]))]
    if "cpu" in limits:
        run += ["--cpus", f"{quantity_cpus(limits['cpu']):g}"]
    for k, v in env.items():
        run += ["-e", f"{k}={v}"]
    ports = [{"name": p.get("name", ""), "port": int(p["containerPort"]),
              "protocol": p.get("protocol", "TCP")} for p in c.get("ports", [])]
    for p in c.get("ports", []):
        if "hostPort" in p:
            raise PlanError(f"{where}: hostPort is not modelled")
    probes = {}
    for k in ("startupProbe", "readinessProbe", "livenessProbe"):
        if k in c:
            probes[k] = resolve_probe(c[k], ports, f"{where} {k}")
    return {
        "pod": pod["name"], "name": c["name"], "kind": kind,
        "container": f"{PREFIX}{pod['short']}-{c['name']}",
        "image": c["image"], "command": command, "args": args, "env": env,
        "user": user, "runAsNonRoot": sc.get("runAsNonRoot", False),
        "mounts": mounts, "ports": ports, "probes": probes, "problems": problems,
        "run_flags": run,
    }


def resolve_probe(p: dict, ports: list[dict], where: str) -> dict:
    out = {"period": p.get("periodSeconds", 10), "failures": p.get("failureThreshold", 3),
           "timeout": p.get("timeoutSeconds", 1), "delay": p.get("initialDelaySeconds", 0)}

    def port_of(v):
        if isinstance(v, int):
            return v
        for q in ports:
            if q["name"] == v:
                return q["port"]
        raise PlanError(f"{where}: port {v!r} is not a named port of the container")

    if "grpc" in p:
        out.update(type="grpc", port=port_of(p["grpc"]["port"]),
                   service=p["grpc"].get("service", ""))
    elif "exec" in p:
        out.update(type="exec", command=p["exec"]["command"])
    elif "httpGet" in p:
        out.update(type="http", port=port_of(p["httpGet"]["port"]),
                   path=p["httpGet"].get("path", "/"))
    elif "tcpSocket" in p:
        out.update(type="tcp", port=port_of(p["tcpSocket"]["port"]))
    else:
        raise PlanError(f"{where}: probe handler not modelled: {sorted(p)}")
    return out


def make_volumes(pod_spec: dict, pod: dict, work: Path, secrets: Path) -> dict[str, dict]:
    """Host folders standing in for the pod's volumes, with the kubelet's
    ownership rules: an emptyDir is mode 0777; fsGroup makes volumes
    group-owned by it (setgid on folders); secret files get defaultMode."""
    fs_group = pod_spec.get("securityContext", {}).get("fsGroup")
    root = work / "pods" / pod["short"]
    out = {}
    for v in pod_spec.get("volumes", []):
        host = root / v["name"]
        if host.exists():
            shutil.rmtree(host)
        host.mkdir(parents=True)
        gid = fs_group if fs_group is not None else 0
        if "emptyDir" in v:
            os.chown(host, 0, gid)
            os.chmod(host, 0o2777 if fs_group is not None else 0o777)
            out[v["name"]] = {"kind": "emptyDir", "host": str(host)}
        elif "secret" in v:
            s = v["secret"]
            src = secrets / s["secretName"]
            if not src.is_dir():
                raise PlanError(f"volume {v['name']}: secret {s['secretName']} was not made by "
                                "scripts/image-check")
            mode = s.get("defaultMode", 0o644)
            items = s.get("items") or [{"key": k.name, "path": k.name} for k in sorted(src.iterdir())]
            for it in items:
                f = host / it["path"]
                f.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / it["key"], f)
                os.chown(f, 0, gid)
                os.chmod(f, it.get("mode", mode))
            os.chown(host, 0, gid)
            os.chmod(host, 0o2755 if fs_group is not None else 0o755)
            out[v["name"]] = {"kind": "secret", "host": str(host)}
        else:
            raise PlanError(f"volume {v['name']}: only emptyDir and secret are modelled")
    return out


def plan(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(DEPLOY))
    import render  # deploy/render.py: Helm's engine through helm-python-sdk

    work = Path(args.work)
    repo, _, tag = args.image.rpartition(":")
    values = {
        "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
        "monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
        "trainerExample": {"enabled": True, "jobId": JOB_ID, "nodes": NODES,
                           "procsPerNode": PROCS_PER_NODE, "image": args.demo_image,
                           "command": DEMO_COMMAND},
    }
    def merge(dst: dict, src: dict) -> None:
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                merge(dst[k], v)
            else:
                dst[k] = v

    if args.values:
        merge(values, json.loads(args.values))
    rendered = render.render(values)
    objs = render.objects(rendered)
    by_kind: dict[str, list[dict]] = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    for kind in ("Deployment", "Service", "Job", "ServiceMonitor", "PodMonitor"):
        if len(by_kind.get(kind, [])) != 1:
            raise PlanError(f"expected one {kind} in the rendered chart, got "
                            f"{len(by_kind.get(kind, []))}")
    deploy, svc, job = by_kind["Deployment"][0], by_kind["Service"][0], by_kind["Job"][0]
    ns = deploy["metadata"]["namespace"]
    coord_ip = f"{SUBNET}.10"
    # The Service: its DNS name resolves to the coordinator pod in the sidecars.
    svc_host = f"{svc['metadata']['name']}.{ns}.svc"
    pods = []
    # Coordinator pod.
    cspec = deploy["spec"]["template"]["spec"]
    check_keys(cspec, POD_KEYS, "coordinator pod")
    cpod = {"name": f"{deploy['metadata']['name']}-5d8c7b9f4-ic001", "short": "coordinator",
            "namespace": ns, "node": "image-check-node-c", "annotations": {}, "ip": coord_ip,
            "labels": deploy["spec"]["template"]["metadata"].get("labels", {})}
    vols = make_volumes(cspec, cpod, work, Path(args.secrets))
    cpod["containers"] = [translate_container(c, cspec, cpod, vols, "container")
                          for c in cspec["containers"]]
    cpod["init"] = []
    pods.append(cpod)
    # Trainer pods: one per Job completion index.
    tspec = job["spec"]["template"]["spec"]
    check_keys(tspec, POD_KEYS, "trainer pod")
    nodes = int(job["spec"]["completions"])
    for i in range(nodes):
        tpod = {"name": f"{job['metadata']['name']}-{i}-ic00{i}", "short": f"node{i}",
                "namespace": ns, "node": f"image-check-node-{i}", "ip": f"{SUBNET}.{20 + i}",
                "annotations": {"batch.kubernetes.io/job-completion-index": str(i)},
                "labels": job["spec"]["template"]["metadata"].get("labels", {}), "index": i}
        vols = make_volumes(tspec, tpod, work, Path(args.secrets))
        tpod["init"] = []
        for c in tspec.get("initContainers", []):
            kind = "sidecar" if c.get("restartPolicy") == "Always" else "init"
            tpod["init"].append(translate_container(c, tspec, tpod, vols, kind))
        tpod["containers"] = [translate_container(c, tspec, tpod, vols, "container")
                              for c in tspec["containers"]]
        pods.append(tpod)
    # Where Prometheus would scrape: ServiceMonitor port name -> Service port ->
    # targetPort -> the coordinator container's port; PodMonitor port name ->
    # a named port of a container in the trainer pods.
    scrapes = []
    for ep in by_kind["ServiceMonitor"][0]["spec"]["endpoints"]:
        sport = next((p for p in svc["spec"]["ports"] if p.get("name") == ep["port"]), None)
        if sport is None:
            raise PlanError(f"ServiceMonitor port {ep['port']!r} is not a port of the Service")
        target = sport.get("targetPort", sport["port"])
        c = cpod["containers"][0]
        port = target if isinstance(target, int) else next(
            (p["port"] for p in c["ports"] if p["name"] == target), None)
        if port is None:
            raise PlanError(f"Service port {sport['name']}: targetPort {target!r} is not a "
                            "named port of the coordinator container")
        scrapes.append({"what": "coordinator (ServiceMonitor)", "ip": coord_ip, "port": port,
                        "path": ep.get("path", "/metrics")})
    for ep in by_kind["PodMonitor"][0]["spec"]["podMetricsEndpoints"]:
        for tpod in pods[1:]:
            port = next((p["port"] for c in tpod["init"] + tpod["containers"]
                         for p in c["ports"] if p["name"] == ep["port"]), None)
            if port is None:
                raise PlanError(f"PodMonitor port {ep['port']!r} is no named port of the "
                                "trainer pod")
            scrapes.append({"what": f"sidecar {tpod['short']} (PodMonitor)", "ip": tpod["ip"],
                            "port": port, "path": ep.get("path", "/metrics")})
    # The Service's port for gRPC must be the port the sidecars dial, and its
    # targetPort a port the coordinator declares (the Service is modelled as
    # the pod IP, so the numbers must agree).
    grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    c = cpod["containers"][0]
    tp = grpc_port["targetPort"]
    tp_num = tp if isinstance(tp, int) else next(
        (p["port"] for p in c["ports"] if p["name"] == tp), None)
    if tp_num != grpc_port["port"]:
        raise PlanError(f"Service grpc port {grpc_port['port']} -> targetPort {tp!r} "
                        f"({tp_num}): image-check models the Service as the pod IP and needs "
                        "them equal")
    out = {"network": NETWORK, "subnet": f"{SUBNET}.0/24", "gateway": f"{SUBNET}.1",
           "service_host": svc_host, "coordinator_ip": coord_ip, "job": JOB_ID,
           "nodes": nodes, "procs_per_node": PROCS_PER_NODE, "steps": DEMO_STEPS,
           "pods": pods, "scrapes": scrapes, "work": str(work)}
    (work / "plan.json").write_text(json.dumps(out, indent=1))
    for p in pods:
        for c in p["init"] + p["containers"]:
            print(f"image-check: plan {p['short']}/{c['name']} ({c['kind']}): "
                  f"{' '.join(c['command'] + c['args'])}")
    return 0


# ---------------------------------------------------------------------------
# Running it.

RESULTS: list[tuple[bool, str, str]] = []


def check(ok: bool, name: str, detail: str) -> bool:
    RESULTS.append((ok, name, detail))
    print(f"image-check: {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


def podman(*a: str, check_rc: bool = True, timeout: float | None = None,
           capture: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(PODMAN + list(a), capture_output=capture, text=True, timeout=timeout)
    if check_rc and r.returncode != 0:
        raise RuntimeError(f"podman {' '.join(a[:3])}...: exit {r.returncode}: "
                           f"{(r.stderr or '').strip()[-800:]}")
    return r


def grpc_health(ip: str, port: int, service: str, timeout: float) -> tuple[bool, str]:
    import grpc  # python3-grpcio (Debian)
    try:
        with grpc.insecure_channel(f"{ip}:{port}") as ch:
            # grpc.health.v1.Health/Check; HealthCheckRequest{service} by hand:
            # field 1, length-delimited. SERVING is HealthCheckResponse{status: 1} = 08 01.
            req = (b"\x0a" + bytes([len(service)]) + service.encode()) if service else b""
            call = ch.unary_unary("/grpc.health.v1.Health/Check",
                                  request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
            resp = call(req, timeout=timeout)
            return resp == b"\x08\x01", "SERVING" if resp == b"\x08\x01" else f"status bytes {resp!r}"
    except grpc.RpcError as e:
        return False, f"{e.code().name}: {e.details()}"


def probe_once(c: dict, p: dict, ip: str) -> tuple[bool, str]:
    if p["type"] == "grpc":
        return grpc_health(ip, p["port"], p.get("service", ""), p["timeout"])
    if p["type"] == "exec":
        r = podman("exec", c["container"], *p["command"], check_rc=False, timeout=p["timeout"] + 10)
        return r.returncode == 0, f"exit {r.returncode} {(r.stdout + r.stderr).strip()[:200]}"
    if p["type"] == "http":
        try:
            with urllib.request.urlopen(f"http://{ip}:{p['port']}{p['path']}",
                                        timeout=p["timeout"]) as resp:
                return 200 <= resp.status < 400, f"HTTP {resp.status}"
        except Exception as e:  # noqa: BLE001 - any failure is a probe failure
            return False, str(e)
    if p["type"] == "tcp":
        import socket
        try:
            socket.create_connection((ip, p["port"]), timeout=p["timeout"]).close()
            return True, "connected"
        except OSError as e:
            return False, str(e)
    return False, "unknown probe"


def describe_probe(p: dict) -> str:
    if p["type"] == "exec":
        return "exec " + " ".join(p["command"])
    return f"{p['type']} :{p['port']}{p.get('path', '')}"


def run_probe(c: dict, kind: str, ip: str, retries: bool) -> bool:
    p = c["probes"].get(kind)
    if p is None:
        return True
    start = time.monotonic()
    time.sleep(p["delay"])
    attempts = p["failures"] if retries else 1
    detail = ""
    for n in range(attempts):
        ok, detail = probe_once(c, p, ip)
        if ok:
            return check(True, f"{kind} {c['pod_short']}/{c['name']}",
                         f"{describe_probe(p)} -> {detail} after {time.monotonic() - start:.1f} s "
                         f"(attempt {n + 1} of {p['failures']})")
        if not running(c["container"]):
            break
        if n + 1 < attempts:
            time.sleep(p["period"])
    return check(False, f"{kind} {c['pod_short']}/{c['name']}",
                 f"{describe_probe(p)} -> {detail} after {time.monotonic() - start:.1f} s; "
                 f"logs:\n{logs(c['container'], 30)}")


def running(name: str) -> bool:
    r = podman("inspect", "--format", "{{.State.Running}}", name, check_rc=False)
    return r.stdout.strip() == "true"


def logs(name: str, lines: int = 40) -> str:
    r = podman("logs", "--tail", str(lines), name, check_rc=False)
    return (r.stdout + r.stderr).rstrip()


def start(c: dict, network: list[str]) -> None:
    argv = ["run", "-d", "--name", c["container"], "--label", LABEL, "--hostname",
            c["pod"][:63], *ULIMITS, *network, *c["run_flags"],
            "--entrypoint", json.dumps(c["command"]), c["image"], *c["args"]]
    podman(*argv)


def listening_ports(container: str) -> set[int]:
    r = podman("exec", container, "cat", "/proc/net/tcp", "/proc/net/tcp6", check_rc=False)
    ports = set()
    for line in r.stdout.splitlines()[1:]:
        f = line.split()
        if len(f) > 3 and f[3] == "0A" and ":" in f[1]:
            ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def check_container(c: dict, image_users: dict[str, str]) -> None:
    """Declared ports listen; the process runs as the user the chart asks for."""
    declared = {p["port"] for p in c["ports"] if p["protocol"] == "TCP"}
    listening = listening_ports(c["container"])
    missing = declared - listening
    check(not missing, f"ports {c['pod_short']}/{c['name']}",
          f"declared {sorted(declared)}, listening {sorted(listening)}"
          + (f"; NOT listening: {sorted(missing)}" if missing else ""))
    r = podman("exec", c["container"], "cat", "/proc/1/status", check_rc=False)
    ids = {ln.split(":")[0]: ln.split(":")[1].split() for ln in r.stdout.splitlines()
           if ln.startswith(("Uid:", "Gid:", "Groups:", "CapEff:", "NoNewPrivs:"))}
    uid = ids.get("Uid", ["?"])[0]
    want = (c["user"] or image_users.get(c["image"], "")).split(":")[0]
    ok = uid == want and uid != "0" and ids.get("CapEff", ["?"])[0] == "0000000000000000"
    check(ok, f"identity {c['pod_short']}/{c['name']}",
          f"uid {uid} gid {ids.get('Gid', ['?'])[0]} groups {' '.join(ids.get('Groups', []))} "
          f"capabilities {ids.get('CapEff', ['?'])[0]} no_new_privs "
          f"{ids.get('NoNewPrivs', ['?'])[0]} (chart: user {c['user']})")


def scrape(s: dict) -> tuple[bool, str, str]:
    url = f"http://{s['ip']}:{s['port']}{s['path']}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = resp.read().decode()
            return resp.status == 200 and "accord_" in body, url, body
    except Exception as e:  # noqa: BLE001
        return False, url, str(e)


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return total


def cleanup() -> None:
    # Several passes: podman refuses to remove the trainers' network holder
    # while a trainer that joined its namespace still exists.
    for _ in range(3):
        ids = podman("ps", "-aq", "--filter", f"label={LABEL}", check_rc=False).stdout.split()
        if not ids:
            break
        podman("rm", "-f", "-t", "2", *ids, check_rc=False)
    else:
        left = podman("ps", "-a", "--format", "{{.Names}}", "--filter", f"label={LABEL}",
                      check_rc=False).stdout.split()
        if left:
            print(f"image-check: warning: could not remove {' '.join(left)}", flush=True)
    podman("network", "rm", "-f", NETWORK, check_rc=False)


def run(args: argparse.Namespace) -> int:
    work = Path(args.work)
    plan_ = json.loads((work / "plan.json").read_text())
    for pod in plan_["pods"]:
        for c in pod["init"] + pod["containers"]:
            c["pod_short"] = pod["short"]
            if c["problems"]:
                check(False, f"chart {pod['short']}/{c['name']}", "; ".join(c["problems"]))
    cleanup()
    podman("network", "create", "--subnet", plan_["subnet"], "--gateway", plan_["gateway"],
           "--label", LABEL, plan_["network"])
    image_users = {}
    for img in {c["image"] for p in plan_["pods"] for c in p["init"] + p["containers"]}:
        r = podman("image", "inspect", "--format", "{{.Config.User}}", img, check_rc=False)
        if r.returncode != 0:
            check(False, f"image {img}", "not in podman's storage (build it first)")
            return summary()
        image_users[img] = r.stdout.strip()
    try:
        return run_pods(plan_, image_users, work)
    finally:
        if args.keep:
            print(f"image-check: --keep: containers left running; remove with "
                  f"{' '.join(PODMAN)} rm -f $({' '.join(PODMAN)} ps -aq --filter label={LABEL})")
        else:
            cleanup()


def run_pods(plan_: dict, image_users: dict[str, str], work: Path) -> int:
    pods = plan_["pods"]
    cpod, tpods = pods[0], pods[1:]
    coord = cpod["containers"][0]
    # 1. The coordinator pod, like the Deployment's pod.
    t0 = time.monotonic()
    start(coord, ["--network", plan_["network"], "--ip", cpod["ip"]])
    if not run_probe(coord, "startupProbe", cpod["ip"], retries=True):
        return summary()
    check(True, "coordinator start", f"serving {time.monotonic() - t0:.1f} s after `podman run`")
    run_probe(coord, "readinessProbe", cpod["ip"], retries=False)
    run_probe(coord, "livenessProbe", cpod["ip"], retries=False)
    check_container(coord, image_users)
    # With TLS on, the gRPC port itself must refuse a plaintext client.
    grpc_port = next((p["port"] for p in coord["ports"] if p["name"] == "grpc"), None)
    if grpc_port and "--plaintext" not in coord["args"]:
        ok, detail = grpc_health(cpod["ip"], grpc_port, "", 3)
        check(not ok, "coordinator TLS", f"plaintext health check on :{grpc_port} -> {detail}")
    # 2. Per node: the native sidecar first (the trainer starts after its
    # startup probe), like the kubelet. The trainers share one network
    # namespace (see the module docstring), held by a container that sleeps.
    holder = f"{PREFIX}trainers-netns"
    podman("run", "-d", "--name", holder, "--label", LABEL, *ULIMITS, "--network", "none",
           "--entrypoint", '["/bin/sleep"]', tpods[0]["containers"][0]["image"], "infinity")
    svc = [f"--add-host", f"{plan_['service_host']}:{plan_['coordinator_ip']}"]
    for pod in tpods:
        for c in pod["init"]:
            if c["kind"] != "sidecar":
                check(False, f"init {pod['short']}/{c['name']}", "plain init containers are not modelled")
                return summary()
            t0 = time.monotonic()
            start(c, ["--network", plan_["network"], "--ip", pod["ip"], *svc])
            if not run_probe(c, "startupProbe", pod["ip"], retries=True):
                return summary()
            run_probe(c, "livenessProbe", pod["ip"], retries=False)
            check_container(c, image_users)
    # Sidecars are connected to the coordinator before any rank arrives?
    # (Not required: ranks wait.) Start the trainers.
    t_demo = time.monotonic()
    for pod in tpods:
        for c in pod["containers"]:
            start(c, ["--network", f"container:{holder}"])
    trainers = [c for pod in tpods for c in pod["containers"]]
    deadline = time.monotonic() + 600
    codes = {}
    for c in trainers:
        left = max(1, deadline - time.monotonic())
        try:
            r = podman("wait", c["container"], check_rc=False, timeout=left)
            codes[c["container"]] = r.stdout.strip()
        except subprocess.TimeoutExpired:
            codes[c["container"]] = "timeout"
            podman("kill", c["container"], check_rc=False)
    demo_s = time.monotonic() - t_demo
    # 3. The demo's verdict from the ranks' reports.
    reports = {}
    for pod, c in zip(tpods, trainers):
        dst = work / "reports" / pod["short"]
        if dst.exists():
            shutil.rmtree(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        podman("cp", f"{c['container']}:/tmp/accord-demo", str(dst), check_rc=False)
        for f in sorted(dst.glob("rank-*.json")) if dst.exists() else []:
            reports[int(f.stem.split("-")[1])] = json.loads(f.read_text())
    world = plan_["nodes"] * plan_["procs_per_node"]
    exits_ok = all(v == "0" for v in codes.values())
    checked = sum(int(r.get("elementsChecked", 0)) for r in reports.values())
    mism = sum(int(r.get("mismatches", 0)) for r in reports.values())
    digests = {r.get("decisionDigest", "") for r in reports.values()}
    mib = sum(int(r.get("bytesReduced", 0)) for r in reports.values()) / 1048576
    lat = sorted(v for r in reports.values() for v in r.get("latenciesUs", []))
    p50 = lat[len(lat) // 2] if lat else 0
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0
    r0 = reports.get(0, {})
    passed = (exits_ok and len(reports) == world and checked > 0 and mism == 0
              and len(digests) == 1 and "" not in digests)
    detail = (f"{'PASSED' if passed else 'FAILED'} - {world} ranks x {plan_['steps']} steps in "
              f"{len(trainers)} trainer containers on {len(tpods)} sidecars; exit codes "
              f"{' '.join(codes.values())}; {len(reports)} reports; {checked} reduced elements "
              f"({mib:.1f} MiB) checked against float64 references, {mism} mismatches; "
              f"identical decisions on every rank: {'yes' if len(digests) == 1 else 'NO'}; "
              f"negotiation p50 {p50:.0f} us p99 {p99:.0f} us; loss "
              f"{r0.get('initialLoss', 0):.4f} -> {r0.get('finalLoss', 0):.4f}; {demo_s:.1f} s")
    if not passed:
        for c in trainers:
            detail += f"\n--- {c['container']}:\n{logs(c['container'], 30)}"
        for pod in tpods:
            for c in pod["init"]:
                detail += f"\n--- {c['container']}:\n{logs(c['container'], 20)}"
        detail += f"\n--- {coord['container']}:\n{logs(coord['container'], 20)}"
    check(passed, "demo across containers", detail)
    tail = logs(trainers[0]["container"], 3)
    if tail:
        print("image-check:   trainer node0 said: " + tail.replace("\n", "\n    "), flush=True)
    # 4. Metrics where the ServiceMonitor and PodMonitor would scrape.
    for s in plan_["scrapes"]:
        ok, url, body = scrape(s)
        if ok and s["what"].startswith("coordinator"):
            dec = metric_sum(body, "accord_decisions_total")
            ok = dec > 0
            extra = (f"accord_decisions_total {dec:.0f}, accord_cache_hits_total "
                     f"{metric_sum(body, 'accord_cache_hits_total'):.0f}, accord_errors_total "
                     f"{metric_sum(body, 'accord_errors_total'):.0f}")
        elif ok:
            extra = (f"accord_sidecar_decisions_total "
                     f"{metric_sum(body, 'accord_sidecar_decisions_total'):.0f}")
        else:
            extra = body[:300]
        check(ok, f"metrics {s['what']}", f"GET {url} -> {extra}")
    # 5. Still healthy after the job; the event log landed on its volume.
    run_probe(coord, "livenessProbe", cpod["ip"], retries=False)
    for pod in tpods:
        for c in pod["init"]:
            run_probe(c, "livenessProbe", pod["ip"], retries=False)
    ev = next((a.split("=", 1)[1] for a in coord["args"] if a.startswith("--event_log=")), "")
    if ev:
        mount = max((m for m in coord["mounts"] if ev.startswith(m["path"].rstrip("/") + "/")),
                    key=lambda m: len(m["path"]), default=None)
        n = 0
        if mount:
            f = work / "pods" / cpod["short"] / mount["volume"] / ev[len(mount["path"]):].lstrip("/")
            n = len(f.read_text().splitlines()) if f.exists() else 0
        check(n > 0, "event log", f"{ev} on volume "
              f"{mount['volume'] if mount else '(none: the root file system)'}: {n} events")
    # 6. Graceful stop: SIGTERM, like a pod deletion.
    t0 = time.monotonic()
    podman("stop", "-t", "30", coord["container"], check_rc=False)
    code = podman("inspect", "--format", "{{.State.ExitCode}}", coord["container"]).stdout.strip()
    out = logs(coord["container"], 5)
    stats = next((ln for ln in out.splitlines() if "accord-coordinator stats:" in ln), "")
    check(code == "0" and bool(stats), "coordinator SIGTERM",
          f"exit {code} in {time.monotonic() - t0:.1f} s; {stats.strip() or out[-300:]}")
    return summary()


def summary() -> int:
    failed = [n for ok, n, _ in RESULTS if not ok]
    print(f"image-check: run: {len(RESULTS) - len(failed)} passed, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else ""), flush=True)
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--work", required=True)
    p.add_argument("--image", required=True)
    p.add_argument("--demo-image", required=True)
    p.add_argument("--secrets", required=True)
    p.add_argument("--values", default="",
                   help="JSON merged over image-check's chart values (scripts/image-check: "
                        "ACCORD_IMAGE_CHECK_VALUES)")
    r = sub.add_parser("run")
    r.add_argument("--work", required=True)
    r.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    try:
        return plan(args) if args.cmd == "plan" else run(args)
    except PlanError as e:
        print(f"image-check: FAIL chart: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
