"""An Installation (accord.torch's and accord.deepspeed's) is built complete
by its own constructor and changed only by its own methods: no other module
in python/accord assigns to its attributes or grows its lists and dicts
(STYLE.md, "Construct complete"). Checked statically; the check is shown to
catch planted writes."""

import ast
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The modules that define an Installation: they write `self.<attr>`.
OWNERS = ("python/accord/torch/installation.py", "python/accord/deepspeed/installation.py")
# How other modules hold an installation.
REFS = ("inst", "installation")
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "add",
            "discard", "setdefault", "__setitem__", "__delitem__"}


def _is_ref(node) -> bool:
    """`inst`, `installation`, or `<anything>.inst` / `<anything>.installation`."""
    if isinstance(node, ast.Name):
        return node.id in REFS
    return isinstance(node, ast.Attribute) and node.attr in REFS


def _installation_attr(node) -> bool:
    """`<ref>.<attr>`: an attribute of an installation."""
    return isinstance(node, ast.Attribute) and _is_ref(node.value)


def _stored(targets) -> list:
    """The stored nodes of assignment targets (tuples unpacked)."""
    out = []
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)):
            out += _stored(t.elts)
        elif isinstance(t, ast.Starred):
            out += _stored([t.value])
        else:
            out.append(t)
    return out


def _writes(tree) -> list:
    """(line, source) of every write to an installation's attribute."""
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in _stored(targets):
            if _installation_attr(target) or (isinstance(target, ast.Subscript)
                                              and _installation_attr(target.value)):
                out.append((node.lineno, ast.unparse(target)))
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in MUTATORS and _installation_attr(f.value):
                out.append((node.lineno, ast.unparse(f)))
            if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args \
                    and _is_ref(node.args[0]):
                out.append((node.lineno, ast.unparse(node)))
    return out


def findings(root: str) -> dict:
    """Module path (relative to root) -> its writes to an installation."""
    found = {}
    base = os.path.join(root, "python", "accord")
    for dirpath, dirnames, names in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel in OWNERS:
                continue
            with open(path, encoding="utf-8") as f:
                writes = _writes(ast.parse(f.read(), path))
            if writes:
                found[rel] = writes
    return found


def test_no_module_writes_an_installations_attributes():
    assert findings(ROOT) == {}


def test_the_check_catches_planted_writes(tmp_path):
    pkg = tmp_path / "python" / "accord" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "installation.py").write_text("class Installation:\n"
                                         "    def __init__(self):\n"
                                         "        self.learned = []\n")
    (pkg / "assigns.py").write_text("def f(inst):\n    inst.step_open = False\n")
    (pkg / "counts.py").write_text("def f(self):\n    self.inst.release_index += 1\n")
    (pkg / "grows.py").write_text("def f(self, name):\n    self.inst.learned.append(name)\n")
    (pkg / "keys.py").write_text("def f(hooked, k):\n    hooked.installation.groups[k] = 1\n")
    (pkg / "sets.py").write_text("def f(installation):\n"
                                 "    setattr(installation, 'guard', None)\n")
    # Counters of a record the installation holds, and calls of its methods, are not writes.
    (pkg / "fine.py").write_text("def f(inst):\n    inst.timing.releases += 1\n"
                                 "    inst.steps.close()\n    inst.released(3)\n")
    found = findings(str(tmp_path))
    assert set(found) == {f"python/accord/torch/{m}.py"
                          for m in ("assigns", "counts", "grows", "keys", "sets")}, found
    assert found["python/accord/torch/grows.py"] == [(2, "self.inst.learned.append")]
