"""The import graph of the packages, read statically (ast) from every module, function-level imports
included: no circle between modules, imports only down the stack kernels <- layers <- zoo <- infer
<- train, and no module importing another module's private (_underscore) name.

`python tests/zoo/test_imports.py ROOT` prints what it finds under another checkout's ROOT.
"""

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("kernels", "layers", "zoo", "infer", "train")  # each imports only those before it


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the packages."""
    return {module_name(root, f): f for pkg in LAYERS for f in sorted((root / pkg).rglob("*.py"))}


def imports(name: str, path: Path, known: dict[str, Path]):
    """(imported module, imported name or None) for every import statement of the module, and
    (module, attribute) for every attribute read through a name bound to a module (`m._helper`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    bound = {}  # local name -> the module of the packages it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    bound[alias.asname or alias.name] = sub
                yield (sub, None) if sub in known else (base, alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            yield bound[node.value.id], node.attr


def graph(root: Path):
    """(edges: module -> the modules of the packages it imports, private: (module, imported name) pairs)."""
    known = modules(root)
    edges, private = defaultdict(set), set()
    for name, path in known.items():
        for target, attr in imports(name, path, known):
            if target.split(".")[0] not in LAYERS:
                continue
            if attr is not None and attr.startswith("_") and not attr.startswith("__"):
                private.add((name, f"{target}.{attr}"))
            # Importing a.b.c runs a's and a.b's __init__ first: an edge to every enclosing package
            # that is not already an enclosing package of the importer (those are being imported anyway).
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in known and dep != name and not name.startswith(dep + "."):
                    edges[name].add(dep)
    return edges, private


def cycles(edges) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def upward(edges) -> list[str]:
    """Imports against the stack: a package importing one later in LAYERS."""
    rank = {pkg: i for i, pkg in enumerate(LAYERS)}
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if rank[b.split(".")[0]] > rank[a.split(".")[0]])


def problems(root: Path) -> dict[str, list]:
    edges, private = graph(root)
    return {"cycles": cycles(edges), "upward imports": upward(edges),
            "private imports": sorted(f"{a} imports {b}" for a, b in private)}


@pytest.fixture(scope="module")
def found():
    return problems(ROOT)


def test_no_import_cycle(found):
    assert found["cycles"] == []


def test_imports_go_down_the_stack(found):
    assert found["upward imports"] == []


def test_no_private_name_imported_across_modules(found):
    assert found["private imports"] == []


def test_the_checks_see_each_kind_of_problem(tmp_path):
    files = {"kernels/__init__.py": "", "kernels/a.py": "def f():\n    from layers import b\n",
             "layers/__init__.py": "", "layers/b.py": "from layers.c import _helper\n",
             "layers/c.py": "import layers.b as b\n\n\ndef _helper():\n    return b._x\n",
             "zoo/__init__.py": "", "infer/__init__.py": "", "train/__init__.py": ""}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert problems(tmp_path) == {
        "cycles": [["layers.b", "layers.c"]], "upward imports": ["kernels.a -> layers", "kernels.a -> layers.b"],
        "private imports": ["layers.b imports layers.c._helper", "layers.c imports layers.b._x"]}


if __name__ == "__main__":
    for kind, items in problems(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT).items():
        print(f"{kind}: {len(items)}")
        for item in items:
            print(f"  {item}")
