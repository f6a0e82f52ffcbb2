"""FSDP2's private names are reached only from accord/torch/fsdp2/: checked
statically over the package (scripts/structure's rule) and at run time
(boundary_audit, on in every test process under ctest); each check is shown
to catch a planted access."""

import importlib.machinery
import importlib.util
import os

import pytest

import boundary_audit
from harness import check_results, run_ranks

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _structure():
    path = os.path.join(ROOT, "scripts", "structure")
    loader = importlib.machinery.SourceFileLoader("structure", path)
    spec = importlib.util.spec_from_loader("structure", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _boundary_findings(root):
    s = _structure()
    rel = lambda p: os.path.relpath(p, root)
    return {f[1]: f[4] for f in s.py_findings(root, rel) if f[0] == "fsdp2-private" and f[2]}


def test_no_module_outside_the_boundary_names_fsdp2_privates():
    assert _boundary_findings(ROOT) == {}


def test_the_static_check_catches_a_planted_access(tmp_path):
    pkg = tmp_path / "python" / "accord" / "torch"
    (pkg / "fsdp2").mkdir(parents=True)
    (pkg / "fsdp2" / "__init__.py").write_text("def params(g):\n    return g.fsdp_params\n")
    (pkg / "leaky.py").write_text("def f(group):\n    return group.unsharded_accumulated_grad\n")
    (pkg / "importer.py").write_text(
        "from torch.distributed.fsdp._fully_shard import _fsdp_param_group\n")
    found = _boundary_findings(str(tmp_path))
    assert set(found) == {"python/accord/torch/leaky.py", "python/accord/torch/importer.py"}
    assert any("unsharded_accumulated_grad" in x for x in found["python/accord/torch/leaky.py"])


def _planted(filename, source, env):
    exec(compile(source, filename, "exec"), env)
    return env["result"]


def test_the_run_time_audit_catches_a_planted_access():
    import accord
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import torch.distributed as dist

    boundary_audit.install()
    root = os.path.dirname(os.path.abspath(accord.__file__))
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
    state = model._get_fsdp_state()
    # torch 2.13 keeps a list of groups, torch 2.11 one group.
    attr = "_fsdp_param_groups" if hasattr(state, "_fsdp_param_groups") else "_fsdp_param_group"
    group = state._fsdp_param_groups[0] if attr.endswith("s") else state._fsdp_param_group
    source = "result = len(group.fsdp_params)"
    inside = os.path.join(root, "torch", "fsdp2", "planted.py")
    assert _planted(inside, source, {"group": group}) == 2
    with pytest.raises(boundary_audit.BoundaryViolation, match="FSDPParamGroup.fsdp_params"):
        _planted(os.path.join(root, "torch", "planted.py"), source, {"group": group})
    with pytest.raises(boundary_audit.BoundaryViolation, match=f"FSDPState.{attr}"):
        _planted(os.path.join(root, "planted.py"), f"result = s.{attr}", {"s": state})
    # Outside the accord package (user code, torch itself) nothing is checked.
    assert _planted(os.path.join(ROOT, "elsewhere.py"), source, {"group": group}) == 2


@pytest.mark.parametrize("scenario", ["rank_branch", "grad_accumulation"])
def test_accord_torch_stays_inside_the_boundary_while_training(scenario, monkeypatch):
    import fsdp_scenarios

    monkeypatch.setenv("ACCORD_TEST_BOUNDARY_AUDIT", "1")
    results = run_ranks(getattr(fsdp_scenarios, scenario), 2, timeout_s=120, agreement="fake")
    check_results(results)
