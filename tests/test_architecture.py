"""The package's import graph runs one way: from ``launch`` down to ``numerics``.

Every import statement of every module is read from its source (function-local and
``TYPE_CHECKING`` ones included, and importing ``a.b.c`` counts as importing the packages ``a``
and ``a.b`` too, whose ``__init__`` runs first), then: no cycle between files, no cycle between
the top-level rooms, no room importing one above it, and no underscore name imported from
another module.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "dist_sr"
# The rooms, bottom to top: a room may import its own and lower rooms only.
LAYERS = [
    ("config", "net", "faults", "secret", "registry", "collectives", "patching", "startup_check"),
    ("numerics",),
    ("optim", "replica", "sources", "cluster"),
    ("precision",),
    ("engines",),
    ("weightsync",),
    ("rollout",),
    ("rl",),
    ("launch", "integrations", "testing"),
    ("__init__",),  # dist_sr/__init__.py: the public names
]
LEVEL = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, top: str = "dist_sr") -> list[tuple[str, list[str]]]:
    """``(module imported, names taken from it)`` for every import statement in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return [(t, names) for t, names in found if t == top or t.startswith(top + ".")]


def graph(package: Path = PACKAGE) -> tuple[dict[str, set[str]], list[str]]:
    """Import edges between the package's modules. Importing ``a.b.c`` also runs the packages on
    the way (``a``, ``a.b``): edges to those, except to a module's own ancestors (which are running
    already when it is imported). A name taken from a package (``from .. import Name``, a name
    that is not a submodule) is an edge to that package even when it is an ancestor: the module
    needs the package's ``__init__`` to have run that far, which is how a cycle hides in import
    order."""
    mods = modules(package)
    edges: dict[str, set[str]] = defaultdict(set)
    private = []
    for name, path in mods.items():
        for target, names in imports(name, path, package.name):
            targets = {target}
            for n in names:  # ``from pkg import module`` imports the module
                if f"{target}.{n}" in mods:
                    targets.add(f"{target}.{n}")
                elif n.startswith("_") and not n.startswith("__"):
                    private.append(f"{name} imports {n} from {target}")
            if target in mods and target != name and any(f"{target}.{n}" not in mods for n in names):
                edges[name].add(target)  # a name defined by the package's __init__
            for t in targets:
                parts = t.split(".")
                for i in range(1, len(parts) + 1):  # the packages on the way run their __init__ first
                    prefix = ".".join(parts[:i])
                    if prefix in mods and prefix != name and not name.startswith(prefix + "."):
                        edges[name].add(prefix)
    return edges, private


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_every_room_has_a_layer():
    assert {room(m) for m in modules()} <= set(LEVEL), "add the new room to LAYERS"


def test_no_import_cycle_between_files():
    edges, _ = graph()
    assert cycles(edges) == []


def test_no_import_cycle_between_rooms_and_no_room_imports_a_higher_one():
    edges, _ = graph()
    rooms: dict[str, set[str]] = defaultdict(set)
    upward = []
    for a, targets in edges.items():
        for b in targets:
            ra, rb = room(a), room(b)
            if ra != rb:
                rooms[ra].add(rb)
                if LEVEL[rb] > LEVEL[ra] and ra != "__init__":
                    upward.append(f"{a} -> {b}")
    assert cycles(rooms) == []
    assert upward == []


def test_no_underscore_name_is_imported_from_another_module():
    _, private = graph()
    assert private == []


def test_the_walker_sees_a_cycle_hidden_in_import_order(tmp_path):
    """A package whose ``__init__`` defines a name, then imports a submodule that takes that name
    back with ``from .. import Name``: it imports only because of line order."""
    pkg = tmp_path / "pkg"
    (pkg / "backends" / "fast").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "backends" / "__init__.py").write_text("class KeyStep:\n    pass\n\n\nfrom . import fast  # noqa\n")
    (pkg / "backends" / "fast" / "__init__.py").write_text("from .. import KeyStep\n")
    edges, _ = graph(pkg)
    assert cycles(edges) == [["pkg.backends", "pkg.backends.fast"]]
    (pkg / "backends" / "base.py").write_text("class KeyStep:\n    pass\n")  # the contract in its own module
    (pkg / "backends" / "fast" / "__init__.py").write_text("from ..base import KeyStep\n")
    assert cycles(graph(pkg)[0]) == []


def test_the_checks_catch_a_cycle_and_an_upward_import():
    # the walker on a planted graph: a cycle through a package __init__, and numerics -> rl
    planted = {"dist_sr.a.x": {"dist_sr.a"}, "dist_sr.a": {"dist_sr.a.x"}}
    assert cycles(planted) == [["dist_sr.a", "dist_sr.a.x"]]
    assert LEVEL[room("dist_sr.rl.trainer")] > LEVEL[room("dist_sr.numerics.key")]


def test_scripts_run_from_their_folders_do_not_shadow_the_packages_they_import():
    """``python bench/x.py`` puts ``bench/`` first on ``sys.path``: a script named like a package
    (``bench/kernels.py`` vs Hugging Face's ``kernels``, which transformers probes for) breaks every
    script beside it that imports transformers."""
    import subprocess
    import sys

    for folder in ("bench", "launch", "examples"):
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT / folder)!r}); "
            "import transformers.models.qwen2.modeling_qwen2, torch.distributed, safetensors.torch"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{folder}/: {r.stderr[-1500:]}"


def private_attributes(package: Path = PACKAGE) -> list[str]:
    """``obj._name`` read or written in one module where ``_name`` is an attribute only another of
    the package's modules defines (as a method, a class attribute or ``self._name = ...``): one
    module reaching into another's objects. ``self``/``cls`` and dunders are left alone; a private
    attribute of torch, vLLM or a peer (defined by none of our modules) is integration glue."""
    mods = modules(package)
    defined: dict[str, set[str]] = defaultdict(set)
    trees = {name: ast.parse(path.read_text()) for name, path in mods.items()}

    def private(attr: str) -> bool:
        return attr.startswith("_") and not attr.startswith("__")

    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(node.name):
                defined[node.name].add(name)
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
                    for t in targets:
                        if isinstance(t, ast.Name) and private(t.id):
                            defined[t.id].add(name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    defined[node.attr].add(name)
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            owners = defined.get(node.attr, set())
            if owners and name not in owners:
                found.append(f"{name}:{node.lineno} reaches {node.attr} of {', '.join(sorted(owners))}")
    return sorted(found)


# private attributes of torch, vLLM or a peer whose names one of our own modules also defines
THEIRS = {"_devices": "torch's ProcessGroupGloo options"}


def test_no_module_reaches_into_another_modules_private_attributes():
    assert [f for f in private_attributes() if f.split(" reaches ")[1].split(" of ")[0] not in THEIRS] == []


def test_what_the_wheel_ships_beside_the_package_only_forwards_to_it():
    """The wheel ships ``dist_sr/`` and, at the top of site-packages, the modules pyproject's
    ``py-modules`` names (the name the start-up ``.pth`` imports): each only forwards to the
    package, and nothing in the package imports them back (no arrow runs up out of the rooms)."""
    import tomllib

    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["py-modules"]
    assert shipped == ["dist_sr_deepspeed_hook"]
    for name in shipped:
        path = ROOT / f"{name}.py"
        found = imports(name, path)
        assert found == [("dist_sr.integrations.startup", ["register"])], found
        everything = [t for t, _ in imports(name, path, top=name)]
        assert everything == [], everything
        for mod, mod_path in modules().items():
            assert not any(t == name for t, _ in imports(mod, mod_path, top=name)), f"{mod} imports {name}"


def test_the_start_up_hook_loads_nothing_heavy():
    """Every Python process of an environment with dist-sr installed runs the hook's ``.pth`` line:
    importing it (and so ``dist_sr``) must not load torch."""
    import subprocess
    import sys

    code = "import sys, dist_sr_deepspeed_hook; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
