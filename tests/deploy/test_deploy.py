#!/usr/bin/env python3
"""Offline checks of accord's deployment files.

What is validated, exactly:
  * every object in the committed plain manifests (deploy/manifests/*.yaml and
    deploy/examples/*.yaml) against the Kubernetes JSON schemas bundled by
    kubernetes-validate (strict: unknown fields fail), for Kubernetes 1.29 (the
    chart's floor: native sidecars) and the newest bundled version;
    ServiceMonitor/PodMonitor against the minimal strict schemas vendored in
    tests/deploy/schemas/;
  * the Helm chart rendered with Helm's own engine (helm-python-sdk: Helm v4's
    Go SDK) for several value combinations, every object validated the same
    way; the committed plain manifests equal the chart's rendering; bad values
    fail with a message naming the value (values.schema.json and the
    templates' fail/required checks); `helm lint --strict` is clean;
    wiring the schemas cannot see (probes, ports, selectors, native sidecar,
    downward API, flags);
  * negative cases: broken objects must be rejected by the same validators;
  * the Grafana dashboard parses and its queries use only accord's metric
    names and labels; deploy/README.md documents every flag, env var and
    metric; the Dockerfile's shape (stages, packages, cmake flags, USER).

Run through tests/deploy/run (which prepares the Python environment).
"""

from __future__ import annotations

import copy
import json
import re
import sys
import unittest
from pathlib import Path
from typing import Any, Iterable

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
sys.path.insert(0, str(DEPLOY))
import render  # noqa: E402  deploy/render.py

try:
    import helm_python  # noqa: F401

    HELM = True
    HELM_WHY = ""
except ImportError as e:  # pragma: no cover - depends on the platform's wheel
    HELM = False
    HELM_WHY = f"helm-python-sdk is not importable ({e}); chart rendering not checked"

K8S_VERSIONS = ["1.29.0", kv_utils.latest_version()]

CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring-v1.json",
}

# The metric names the daemons export (issue 7); histograms add _bucket,
# _sum and _count series.
METRICS = {
    "accord_decisions_total": {"job", "group"},
    "accord_zero_fills_total": {"job", "group"},
    "accord_skips_total": {"job", "group"},
    "accord_param_skips_total": {"job", "group", "param", "rank"},
    "accord_negotiation_wait_seconds": {"job"},
    "accord_cache_hits_total": {"job"},
    "accord_cache_misses_total": {"job"},
    "accord_missing_rank_events_total": {"job"},
    "accord_errors_total": {"job", "kind"},
    "accord_connected_ranks": {"job"},
    "accord_connected_sidecars": {"job"},
    "accord_stalled_groups": {"job"},
}
HISTOGRAMS = {"accord_negotiation_wait_seconds"}


# --------------------------------------------------------------------------
# Validation helpers


def load_crd_schema(api_version: str, kind: str) -> dict[str, Any] | None:
    name = CRD_SCHEMAS.get((api_version, kind))
    return json.loads((SCHEMAS / name).read_text()) if name else None


def validate_object(obj: dict[str, Any]) -> list[str]:
    """Errors for one object (empty when valid), for every checked version."""
    ident = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
    crd = load_crd_schema(obj.get("apiVersion", ""), obj.get("kind", ""))
    if crd is not None:
        validator = jsonschema.Draft7Validator(crd)
        return [f"{ident}: {'.'.join(map(str, e.path))}: {e.message}"
                for e in validator.iter_errors(obj)]
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{ident} (k8s {version}): {'.'.join(map(str, e.path))}: {e.message}")
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
            # An object we cannot check is a failure, never a silent pass.
            errors.append(f"{ident} (k8s {version}): no schema: {e.message}")
    return errors


def validate_all(objs: Iterable[dict[str, Any]]) -> list[str]:
    return [err for o in objs for err in validate_object(o)]


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def committed_files() -> list[Path]:
    return sorted((DEPLOY / "manifests").glob("*.yaml")) + sorted(
        (DEPLOY / "examples").glob("*.yaml"))


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objs, kind)
    if len(found) != 1:
        raise AssertionError(f"expected one {kind}, found {len(found)}")
    return found[0]


def flags_of(container: dict[str, Any]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for a in container.get("args", []):
        m = re.fullmatch(r"--([a-z0-9_]+)(?:=(.*))?", a)
        if not m:
            raise AssertionError(f"container {container['name']}: arg {a!r} is not --flag[=value]")
        out[m.group(1)] = m.group(2)
    return out


def coordinator_service(objs: list[dict[str, Any]]) -> dict[str, Any]:
    found = [o for o in by_kind(objs, "Service")
             if o["metadata"]["labels"].get("app.kubernetes.io/component") == "coordinator"]
    if len(found) != 1:
        raise AssertionError(f"expected one coordinator Service, found {len(found)}")
    return found[0]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


# --------------------------------------------------------------------------
# PromQL names (for the dashboard)

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "bool", "offset", "inf", "nan", "atan2"}


def promql_problems(expr: str) -> list[str]:
    """Metric or label names in a PromQL expression that accord does not export."""
    problems = []
    # Grafana's label_values(metric_selector, label) template query.
    m = re.fullmatch(r"\s*label_values\((.*),\s*([a-zA-Z_]\w*)\s*\)\s*", expr)
    if m:
        expr, label = m.group(1), m.group(2)
        if label not in {lbl for labels in METRICS.values() for lbl in labels}:
            problems.append(f"label {label!r} is not an accord label")
    known_labels = {lbl for labels in METRICS.values() for lbl in labels} | {"le"}
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    for block in re.findall(r"\{([^}]*)\}", text):  # label matchers
        for name in re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", block):
            if name not in known_labels:
                problems.append(f"label {name!r} is not an accord label")
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text):
        for name in re.findall(r"[a-zA-Z_]\w*", clause):
            if name not in known_labels:
                problems.append(f"label {name!r} is not an accord label")
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # dashboard variables
    allowed = set(METRICS) - HISTOGRAMS
    allowed |= {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, is_call = m.group(1), m.group(2)
        if is_call or name in PROMQL_WORDS:
            continue
        if name not in allowed:
            problems.append(f"metric {name!r} is not one of accord's metrics")
    return problems


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((p.get("title", "?"), t.get("expr", "")))
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            out.append((f"variable {var['name']}", q.get("query") if isinstance(q, dict) else q))
    return out


# --------------------------------------------------------------------------
# Tests


class CommittedManifestsTest(unittest.TestCase):
    """deploy/manifests and deploy/examples: what operators without Helm apply."""

    def test_every_committed_object_validates(self):
        files = committed_files()
        self.assertTrue(files, "no manifests under deploy/manifests or deploy/examples")
        objs = [o for f in files for o in load_yaml_docs(f)]
        kinds = {o["kind"] for o in objs}
        for k in ("ServiceAccount", "Service", "Deployment", "PodDisruptionBudget", "Job",
                  "ServiceMonitor", "PodMonitor"):
            self.assertIn(k, kinds)
        errors = validate_all(objs)
        self.assertEqual(errors, [], "\n".join(errors))
        print(f"  validated {len(objs)} committed objects from {len(files)} files "
              f"against Kubernetes {', '.join(K8S_VERSIONS)}", file=sys.stderr)

    def test_invalid_objects_are_rejected(self):
        objs = [o for f in committed_files() for o in load_yaml_docs(f)]
        deploy = one(objs, "Deployment")
        job = one(objs, "Job")
        smon = one(objs, "ServiceMonitor")
        pmon = one(objs, "PodMonitor")
        cases = []

        bad = copy.deepcopy(deploy)
        bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "seventy"
        cases.append(("containerPort as a string", bad))
        bad = copy.deepcopy(deploy)
        bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 7070}
        cases.append(("misspelled probe field", bad))
        bad = copy.deepcopy(deploy)
        del bad["spec"]["selector"]
        cases.append(("Deployment without selector", bad))
        bad = copy.deepcopy(job)
        bad["spec"]["template"]["spec"]["initContainers"][0]["restartPolicy"] = 1
        cases.append(("restartPolicy not a string", bad))
        bad = copy.deepcopy(smon)
        bad["spec"]["endpoints"][0]["port"] = 9090
        cases.append(("ServiceMonitor port as a number", bad))
        bad = copy.deepcopy(pmon)
        bad["spec"]["podMetricsEndpoint"] = bad["spec"].pop("podMetricsEndpoints")
        cases.append(("PodMonitor misspelled field", bad))
        cases.append(("unknown kind", {"apiVersion": "v1", "kind": "Pood", "metadata": {"name": "x"}}))

        for what, obj in cases:
            with self.subTest(what):
                self.assertNotEqual(validate_object(obj), [], f"{what} was accepted")


@unittest.skipUnless(HELM, HELM_WHY)
class ChartTest(unittest.TestCase):
    """deploy/helm/accord rendered by Helm's engine."""

    COMBOS = {
        "defaults": {},
        "plain-manifest values": render.PLAIN_VALUES,
        "plaintext, no auth, everything on": {
            "tls": {"enabled": False, "allowPlaintext": True},
            "auth": {"enabled": False},
            "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                           "podMonitor": {"enabled": True}, "paramSkipMetrics": True},
            "trainerExample": {"enabled": True, "nodes": 4, "procsPerNode": 8},
        },
        "options": {
            "imagePullSecrets": [{"name": "regcred"}],
            "serviceAccount": {"create": False, "name": "accord-sa"},
            "coordinator": {"podDisruptionBudget": {"enabled": False}, "eventLog": "",
                            "nodeSelector": {"pool": "cpu"},
                            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                            "podAnnotations": {"a": "b"}, "extraArgs": ["--foo=1"],
                            "service": {"type": "LoadBalancer"}},
            "sidecar": {"extraArgs": ["--bar"]},
        },
        "relays": {
            "relay": {"enabled": True, "replicas": 2, "nodesPerRelay": 2,
                      "extraArgs": ["--foo=1"]},
            "monitoring": {"podMonitor": {"enabled": True}},
            "trainerExample": {"enabled": True, "nodes": 4, "procsPerNode": 8},
        },
    }

    @classmethod
    def setUpClass(cls):
        cls.renders = {name: render.objects(render.render(v)) for name, v in cls.COMBOS.items()}

    def test_every_rendered_object_validates(self):
        total = 0
        for name, objs in self.renders.items():
            with self.subTest(name):
                errors = validate_all(objs)
                self.assertEqual(errors, [], "\n".join(errors))
                total += len(objs)
        print(f"  validated {total} rendered objects from {len(self.renders)} value sets",
              file=sys.stderr)

    def test_helm_lint_strict_is_clean(self):
        import helm_python as helm

        for name, values in self.COMBOS.items():
            with self.subTest(name):
                report = helm.lint(str(render.CHART), values, strict=True, kube_version="v1.29.0")
                serious = [m for m in report["messages"] if m["severity"] >= 2]
                self.assertEqual((report["errors"], serious), ([], []), report)

    def test_committed_manifests_match_the_chart(self):
        for rel, text in render.plain_files().items():
            with self.subTest(rel):
                self.assertEqual((DEPLOY / rel).read_text(), text,
                                 f"deploy/{rel} is stale: run deploy/render-manifests")

    def test_bad_values_fail_with_a_clear_message(self):
        import helm_python as helm

        trainer = {"trainerExample": {"enabled": True}}
        cases = [
            ({"tls": {"enabled": False}}, "tls.allowPlaintext=true"),
            ({"tls": {"enabled": True, "allowPlaintext": True}}, "only applies with tls.enabled=false"),
            ({"tls": {"coordinatorSecret": None}}, "tls.coordinatorSecret"),
            ({"tls": {"sidecarSecret": None}, **trainer}, "tls.sidecarSecret"),
            ({"auth": {"coordinatorTokensSecret": None}}, "auth.coordinatorTokensSecret"),
            ({"auth": {"sidecarTokenSecret": None}, **trainer}, "auth.sidecarTokenSecret"),
            ({"coordinator": {"ports": {"grpc": 9090, "metrics": 9090, "health": 7071}}},
             "coordinator.ports must be distinct"),
            ({"coordinator": {"ports": {"grpc": 70000, "metrics": 9090, "health": 7071}}},
             "/coordinator/ports/grpc"),
            ({"coordinator": {"replicas": 2}}, "/coordinator/replicas"),
            ({"logLevel": "loud"}, "/logLevel"),
            ({"deadline": "30"}, "/deadline"),
            ({"image": {"tag": 1.5}}, "/image/tag"),
            ({"limits": {"maxRanks": 0}}, "/limits/maxRanks"),
            ({"tls": {"coordinatorSecret": "Not_A_Name"}}, "/tls/coordinatorSecret"),
            ({"imag": {"tag": "x"}}, "'imag' not allowed"),
            ({"trainerExample": {"enabled": True, "jobId": "Bad Id"}}, "/trainerExample/jobId"),
            ({"relay": {"enabled": True, "replicas": 1, "nodesPerRelay": 2},
              "trainerExample": {"enabled": True, "nodes": 4}},
             "relay.replicas x relay.nodesPerRelay (1 x 2) must cover trainerExample.nodes (4)"),
            ({"relay": {"enabled": True, "tlsSecret": None}}, "relay.tlsSecret"),
            ({"relay": {"nodesPerRelay": 0}}, "/relay/nodesPerRelay"),
        ]
        for values, expected in cases:
            with self.subTest(values=values):
                with self.assertRaises(helm.HelmError) as ctx:
                    render.render(values)
                self.assertIn(expected, str(ctx.exception))

    def test_coordinator_wiring(self):
        for name, objs in self.renders.items():
            with self.subTest(name):
                values = self.COMBOS[name]
                tls = values.get("tls", {}).get("enabled", True)
                dep = one(objs, "Deployment")
                svc = coordinator_service(objs)
                self.assertEqual(dep["spec"]["replicas"], 1)
                self.assertEqual(dep["spec"]["strategy"]["type"], "Recreate")
                pod = dep["spec"]["template"]
                sel = dep["spec"]["selector"]["matchLabels"]
                self.assertLessEqual(sel.items(), pod["metadata"]["labels"].items())
                self.assertEqual(svc["spec"]["selector"], sel)
                for pdb in by_kind(objs, "PodDisruptionBudget"):
                    self.assertEqual(pdb["spec"]["selector"]["matchLabels"], sel)
                c = pod["spec"]["containers"][0]
                flags = flags_of(c)
                ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                self.assertEqual(flags["listen"], f"0.0.0.0:{ports['grpc']}")
                self.assertEqual(int(flags["metrics_port"]), ports["metrics"])
                self.assertEqual({p["name"]: p["port"] for p in svc["spec"]["ports"]},
                                 {"grpc": 7070, "metrics": 9090})
                probe_port = ports["health"] if tls else ports["grpc"]
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    self.assertEqual(c[probe]["grpc"]["port"], probe_port, probe)
                if tls:
                    self.assertNotIn("plaintext", flags)
                    self.assertEqual(int(flags["health_port"]), ports["health"])
                    for f in ("tls_cert", "tls_key", "tls_ca"):
                        self.assertTrue(flags[f].startswith("/etc/accord/tls/"))
                else:
                    self.assertIn("plaintext", flags)
                    self.assertFalse({"tls_cert", "tls_key", "tls_ca", "health_port"} & flags.keys())
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                for f in ("tls_cert", "tls_key", "tls_ca", "tokens_file", "event_log"):
                    if flags.get(f):
                        self.assertIn(str(Path(flags[f]).parent), mounts, f)
                self.assertEqual(c["securityContext"]["runAsUser"], 65532)
                self.assertTrue(c["securityContext"]["runAsNonRoot"])
                self.assertTrue(c["resources"]["requests"] and c["resources"]["limits"])

    def test_trainer_wiring(self):
        for name, objs in self.renders.items():
            jobs = by_kind(objs, "Job")
            if not self.COMBOS[name].get("trainerExample", {}).get("enabled"):
                self.assertEqual(jobs, [])
                continue
            with self.subTest(name):
                job = one(objs, "Job")
                svc = coordinator_service(objs)
                spec = job["spec"]["template"]["spec"]
                self.assertEqual(job["spec"]["completionMode"], "Indexed")
                (sidecar,) = spec["initContainers"]
                (trainer,) = spec["containers"]
                self.assertEqual(sidecar["restartPolicy"], "Always")  # native sidecar
                run = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
                for c in (sidecar, trainer):
                    vols = {m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/run/accord"}
                    self.assertTrue(vols & run, f"{c['name']} does not mount the shared /run/accord")
                flags = flags_of(sidecar)
                env = env_of(trainer)
                self.assertEqual(flags["socket"], env["ACCORD_SOCKET"])
                self.assertEqual(env["ACCORD_SOCKET"], "/run/accord/sidecar.sock")
                self.assertEqual(env["ACCORD_JOB"], job["metadata"]["labels"]["accord.dev/job"])
                for var in ("NODE_RANK", "NNODES", "NPROC_PER_NODE", "WORLD_SIZE"):
                    self.assertIn(var, env)
                side_env = env_of(sidecar)
                self.assertEqual(side_env["NODE_NAME"]["fieldRef"]["fieldPath"], "spec.nodeName")
                self.assertEqual(side_env["POD_NAME"]["fieldRef"]["fieldPath"], "metadata.name")
                self.assertIn("$(NODE_NAME)", flags["node_id"])
                self.assertIn("$(POD_NAME)", flags["node_id"])
                ns = svc["metadata"]["namespace"]
                if self.COMBOS[name].get("relay", {}).get("enabled"):
                    # The sidecar's shell computes its relay from the pod index.
                    self.assertNotIn("coordinator", flags)
                    self.assertEqual(sidecar["command"][:2], ["/bin/sh", "-c"])
                    self.assertIn("--coordinator=accord-relay-$((JOB_COMPLETION_INDEX / 2))"
                                  f".accord-relay.{ns}.svc:7072", sidecar["command"][2])
                else:
                    self.assertEqual(flags["coordinator"],
                                     f"{svc['metadata']['name']}.{ns}.svc:7070")
                self.assertEqual(spec["securityContext"]["fsGroup"], 65532)
                self.assertEqual(sidecar["securityContext"]["runAsUser"], 65532)
                tls = self.COMBOS[name].get("tls", {}).get("enabled", True)
                self.assertEqual("plaintext" in flags, not tls)
                auth = self.COMBOS[name].get("auth", {}).get("enabled", True)
                self.assertEqual("token_file" in flags, auth)
                for pm in by_kind(objs, "PodMonitor"):
                    if pm["metadata"]["labels"]["app.kubernetes.io/component"] == "relay":
                        continue  # test_relay_wiring
                    labels = job["spec"]["template"]["metadata"]["labels"]
                    self.assertLessEqual(pm["spec"]["selector"]["matchLabels"].items(), labels.items())
                    port_names = {p["name"] for p in sidecar["ports"]}
                    for ep in pm["spec"]["podMetricsEndpoints"]:
                        self.assertIn(ep["port"], port_names)

    def test_relay_wiring(self):
        for name, objs in self.renders.items():
            sets = by_kind(objs, "StatefulSet")
            if not self.COMBOS[name].get("relay", {}).get("enabled"):
                self.assertEqual(sets, [])
                continue
            with self.subTest(name):
                sts = one(objs, "StatefulSet")
                (headless,) = [o for o in by_kind(objs, "Service")
                               if o["spec"].get("clusterIP") == "None"]
                self.assertEqual(sts["spec"]["serviceName"], headless["metadata"]["name"])
                self.assertEqual(sts["spec"]["replicas"], 2)
                sel = sts["spec"]["selector"]["matchLabels"]
                self.assertEqual(headless["spec"]["selector"], sel)
                self.assertNotEqual(coordinator_service(objs)["spec"]["selector"], sel)
                (c,) = sts["spec"]["template"]["spec"]["containers"]
                flags = flags_of(c)
                svc = coordinator_service(objs)
                ns = svc["metadata"]["namespace"]
                self.assertEqual(flags["coordinator"], f"{svc['metadata']['name']}.{ns}.svc:7070")
                self.assertEqual(flags["listen"], "0.0.0.0:7072")
                self.assertEqual(flags["relay_id"], "$(POD_NAME)")
                for f in ("tls_cert", "tls_key", "tls_ca", "upstream_tls_cert",
                          "upstream_tls_key", "upstream_tls_ca", "tokens_file"):
                    self.assertTrue(flags[f].startswith("/etc/accord/"), f)
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                for f in ("tls_cert", "upstream_tls_ca", "tokens_file"):
                    self.assertIn(str(Path(flags[f]).parent), mounts, f)
                self.assertEqual(c["securityContext"]["runAsUser"], 65532)
                # The relays' PodMonitor scrapes their metrics port.
                self.assertEqual(flags["metrics_port"], "9092")
                (pm,) = [p for p in by_kind(objs, "PodMonitor")
                         if p["metadata"]["labels"]["app.kubernetes.io/component"] == "relay"]
                pod_labels = sts["spec"]["template"]["metadata"]["labels"]
                self.assertLessEqual(pm["spec"]["selector"]["matchLabels"].items(),
                                     pod_labels.items())
                ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                self.assertEqual(ports.get(pm["spec"]["podMetricsEndpoints"][0]["port"]), 9092)

    def test_service_monitor_selects_the_service(self):
        objs = self.renders["plain-manifest values"]
        svc = one(objs, "Service")
        sm = one(objs, "ServiceMonitor")
        self.assertLessEqual(sm["spec"]["selector"]["matchLabels"].items(),
                             svc["metadata"]["labels"].items())
        self.assertIn(sm["spec"]["endpoints"][0]["port"], {p["name"] for p in svc["spec"]["ports"]})
        self.assertTrue(sm["spec"]["endpoints"][0]["honorLabels"])
        self.assertEqual(by_kind(self.renders["defaults"], "ServiceMonitor"), [])
        self.assertEqual(by_kind(self.renders["defaults"], "PodMonitor"), [])

    def test_readme_documents_every_flag(self):
        readme = (DEPLOY / "README.md").read_text()
        flags = set()
        for objs in self.renders.values():
            for o in objs:
                spec = o.get("spec", {}).get("template", {}).get("spec", {})
                for c in spec.get("containers", []) + spec.get("initContainers", []):
                    if c["name"] in ("coordinator", "accord-sidecar", "relay"):
                        flags |= flags_of(c).keys()
        flags -= {"foo", "bar"}  # extraArgs test values
        for f in sorted(flags):
            with self.subTest(flag=f):
                self.assertIn(f"--{f}", readme)
                self.assertIn(f"ACCORD_{f.upper()}", readme)


class DashboardTest(unittest.TestCase):
    def setUp(self):
        self.dash = json.loads((DEPLOY / "grafana" / "accord-dashboard.json").read_text())

    def test_queries_use_only_accord_metrics(self):
        queries = dashboard_queries(self.dash)
        self.assertGreater(len(queries), 10)
        used = set()
        for where, expr in queries:
            with self.subTest(where=where, expr=expr):
                self.assertTrue(expr, "empty query")
                self.assertEqual(promql_problems(expr), [])
                used |= set(re.findall(r"accord_\w+", expr))
        base = {re.sub(r"_(bucket|sum|count)$", "", u) if u.startswith(tuple(HISTOGRAMS)) else u
                for u in used}
        self.assertEqual(base, set(METRICS), "every accord metric should appear on the dashboard")

    def test_required_panels_exist(self):
        titles = " | ".join(p["title"].lower() for p in self.dash["panels"])
        for word in ("parameter x rank", "negotiation", "cache hit", "stalled"):
            self.assertIn(word, titles)
        ids = [p["id"] for p in self.dash["panels"]]
        self.assertEqual(len(ids), len(set(ids)), "duplicate panel ids")

    def test_checker_rejects_foreign_names(self):
        self.assertEqual(promql_problems(
            'sum by (job, le) (rate(accord_negotiation_wait_seconds_bucket{job=~"$job"}[5m]))'), [])
        self.assertNotEqual(promql_problems("rate(accord_bogus_total[5m])"), [])
        self.assertNotEqual(promql_problems("up"), [])
        self.assertNotEqual(promql_problems("accord_negotiation_wait_seconds"), [])
        self.assertNotEqual(promql_problems("sum by (pod) (accord_decisions_total)"), [])
        self.assertNotEqual(promql_problems('accord_decisions_total{instance="x"}'), [])
        self.assertNotEqual(promql_problems("label_values(accord_connected_ranks, pod)"), [])

    def test_readme_documents_every_metric(self):
        readme = (DEPLOY / "README.md").read_text()
        for m in METRICS:
            self.assertIn(m, readme)


class DockerfileTest(unittest.TestCase):
    def setUp(self):
        self.text = (DEPLOY / "Dockerfile").read_text()
        # Join continuation lines so each instruction is one line.
        self.lines = [ln.strip() for ln in re.sub(r"\\\n", " ", self.text).splitlines()
                      if ln.strip() and not ln.strip().startswith("#")]

    def test_stages_packages_flags_and_user(self):
        froms = [ln for ln in self.lines if ln.startswith("FROM ")]
        self.assertEqual(len(froms), 2, froms)
        self.assertIn("ARG DEBIAN_IMAGE=debian:12", self.lines)
        self.assertIn("ARG RUNTIME_IMAGE=debian:12-slim", self.lines)
        build = " ".join(self.lines)
        for pkg in ("libgrpc++-dev", "protobuf-compiler-grpc", "libprotobuf-dev", "protobuf-compiler",
                    "libabsl-dev", "libgloo-dev", "libcivetweb-dev", "cmake", "ninja-build", "g++"):
            self.assertRegex(build, rf"(?<![\w+-]){re.escape(pkg)}(?![\w+-])", pkg)
        for flag in ("-G Ninja", "-DACCORD_BUILD_TESTS=OFF", "-DACCORD_BUILD_BENCHMARKS=OFF",
                     "-DACCORD_CUDA=OFF", "cmake --install build"):
            self.assertIn(flag, build)
        for b in ("accord-coordinator", "accord-sidecar", "accordctl"):
            self.assertIn(b, build)
        users = [ln for ln in self.lines if ln.startswith("USER ")]
        self.assertEqual(users, ["USER 65532:65532"])
        after_runtime = self.lines[self.lines.index(froms[1]):]
        self.assertIn("USER 65532:65532", after_runtime)

    def test_dockerignore_keeps_sources(self):
        ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
        for must in (".git", "build*"):
            self.assertIn(must, ignore)
        for src in ("core", "proto", "daemon", "client", "cmake", "CMakeLists.txt"):
            self.assertNotIn(src, ignore)


if __name__ == "__main__":
    result = unittest.main(verbosity=2, exit=False).result
    ran = result.testsRun
    failed = len(result.failures) + len(result.errors)
    skipped = len(result.skipped)
    print(f"deploy: {ran - failed - skipped} passed, {failed} failed, {skipped} skipped")
    sys.exit(0 if result.wasSuccessful() else 1)
