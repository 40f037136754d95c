"""The layering rule, enforced: no package imports a higher one, nor uses another package's private names.

docs/architecture.md states the rule and the order below. Imports are read
with `ast` (type-only imports under TYPE_CHECKING count too), so the test
needs nothing importable.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tcoll"

# Lowest first. A module may import its own package and any lower layer.
LAYERS: list[set[str]] = [
    {"errors", "env", "ops", "buffers", "native", "keepalive"},
    {"segments"},
    {"store"},
    {"p2p"},
    {"transport"},
    {"algos"},
    {"shm"},
    {"comm"},
    {"startup"},
    {"api"},
    {"__init__"},
    {"torch", "bench", "launch", "trace"},
    {"cli"},
    {"__main__"},
]
LONGEST = 500  # lines per module
EXCEPTIONS: dict[str, int] = {}  # modules allowed more than LONGEST lines (none now)
RANK = {package: level for level, packages in enumerate(LAYERS) for package in packages}


def _package(module: str) -> str:
    """The layer name of a module: 'comm' for tcoll.comm.dispatch, 'ops' for tcoll.ops."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(relative.parts)
        found[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
    assert len(found) > 50, f"found only {len(found)} modules under {SRC}: the layering checks would check nothing"
    return found


def _imports(module: str, tree: ast.Module, is_package: bool) -> set[str]:
    """The tcoll modules (or packages) `module` imports, with relative imports resolved."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names if alias.name.startswith("tcoll")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[:len(base) - node.level + 1]
                name = ".".join(stem + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("tcoll"):
                targets.add(name)
                targets |= {f"{name}.{alias.name}" for alias in node.names if _exists(f"{name}.{alias.name}")}
    return targets


def _exists(module: str) -> bool:
    """Whether `module` names a module or package of tcoll (not a class or function)."""
    path = SRC.parent / Path(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _is_package(module: str) -> bool:
    return (SRC.parent / Path(*module.split(".")) / "__init__.py").exists()


def test_every_package_has_a_layer() -> None:
    packages = {_package(name) for name in _modules()}
    assert packages <= set(RANK), f"packages without a layer: {sorted(packages - set(RANK))}"


def test_no_package_imports_a_higher_one() -> None:
    modules = _modules()
    upward = []
    for module, tree in modules.items():
        mine = RANK[_package(module)]
        for target in _imports(module, tree, _is_package(module)):
            if target == "tcoll":
                if target == "tcoll" and mine < RANK["__init__"]:
                    upward.append(f"{module} imports tcoll (the top)")
                continue
            if RANK[_package(target)] > mine:
                upward.append(f"{module} (layer {_package(module)}) imports {target}")
    assert not upward, "\n".join(sorted(upward))


def _private_names_defined() -> dict[str, set[str]]:
    """{_name: the packages that define it} for methods and attributes assigned on self."""
    defined: dict[str, set[str]] = defaultdict(set)
    for module, tree in _modules().items():
        package = _package(module)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                defined[node.name].add(package)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                defined[node.attr].add(package)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    target = item.target if isinstance(item, ast.AnnAssign) else None
                    if isinstance(target, ast.Name) and _private(target.id):
                        defined[target.id].add(package)
    return defined


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _foreign_names(tree: ast.Module) -> set[str]:
    """The names a module binds to other libraries' modules and objects (torch's `c10d`): not tcoll's privates."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(alias.asname or alias.name.split(".")[0]) for alias in node.names
                      if not alias.name.startswith("tcoll")}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("tcoll"):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def test_no_package_uses_another_ones_private_names() -> None:
    """`obj._name` where only other packages define `_name`, in either direction (up or down the layers).

    A class's own `self._name` is its business, also where a base class in another
    package defines it (a subclass of p2p's Work finishing itself): what is flagged
    is a module reaching into an object it does not own.
    """
    defined = _private_names_defined()
    reaches = []
    for module, tree in _modules().items():
        mine = _package(module)
        foreign = _foreign_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ({"self", "cls"} | foreign):
                continue
            owners = defined.get(node.attr, set())
            if owners and mine not in owners:
                reaches.append(f"{module}:{node.lineno} uses .{node.attr}, private to {sorted(owners)}")
    assert not reaches, "\n".join(sorted(reaches))


def test_no_package_imports_another_ones_private_names() -> None:
    """`from ..comm.communicator import _hooks` in startup: a private name imported across packages."""
    imported = []
    for module, tree in _modules().items():
        base = module.split(".") if _is_package(module) else module.split(".")[:-1]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            if not source.startswith("tcoll") or _package(source) == _package(module):
                continue
            imported += [f"{module}:{node.lineno} imports {alias.name} from {source}"
                         for alias in node.names if _private(alias.name)]
    assert not imported, "\n".join(sorted(imported))


def test_the_import_graph_has_no_cycles_between_packages() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, tree in _modules().items():
        for target in _imports(module, tree, _is_package(module)):
            if target != "tcoll" and _package(target) != _package(module):
                edges[_package(module)].add(_package(target))
    order = sorted(RANK, key=RANK.get)  # a topological order exists iff every edge goes down
    for package in order:
        for target in edges[package]:
            assert RANK[target] < RANK[package], f"{package} -> {target} goes up"


def test_the_top_level_stays_small() -> None:
    top = sorted(path.name for path in SRC.glob("*.py"))
    assert len(top) <= 12, top
    sizes = {str(path.relative_to(SRC)): len(path.read_text().splitlines()) for path in SRC.rglob("*.py")}
    too_long = {name: n for name, n in sizes.items() if n > EXCEPTIONS.get(name, LONGEST)}
    assert not too_long, too_long
