"""The runtime's modules import each other without a circle, and nothing outside the chunk's
module assigns a chunk's fields: both read from the source (AST), every import counted (at
module level, under `if TYPE_CHECKING:`, and inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

import fxstar
from fxstar.runtime import chunk as chunk_module

PACKAGE = Path(fxstar.__file__).parent
RUNTIME = "fxstar.runtime"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.Module, module: str, known: set[str]) -> set[str]:
    """The modules of `known` this module's source imports anywhere in it."""
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package the module is in
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1],
                                 *([base] if base else [])])  # fmt: skip
            # `from fxstar.runtime import chunk` names a module; `from x import Name` names x
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in known and name != module}
    return found


def import_graph(prefix: str = RUNTIME) -> dict[str, set[str]]:
    """Each module under `prefix` and the modules under `prefix` it imports."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = {name for name in paths if name == prefix or name.startswith(prefix + ".")}
    return {
        name: _imported(ast.parse(paths[name].read_text()), name, known) - {prefix}
        for name in sorted(known)
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports (its modules in order, the first repeated last), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(graph[name]):
            cycle = visit(target)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name)
        if cycle is not None:
            return cycle
    return None


def test_the_cycle_finder_reports_a_circle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_counts_imports_in_functions_and_under_type_checking(tmp_path):
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fxstar.runtime.b import B\n"
        "def f():\n    from fxstar.runtime import c\n"
        "import fxstar.runtime.d as d\n"
    )
    known = {"fxstar.runtime.a", "fxstar.runtime.b", "fxstar.runtime.c", "fxstar.runtime.d"}
    assert _imported(ast.parse(source), "fxstar.runtime.a", known) == known - {"fxstar.runtime.a"}


def test_no_module_of_the_runtime_imports_itself_through_others():
    graph = import_graph()
    assert len(graph) > 20 and "fxstar.runtime.chunk" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "the runtime's imports form a circle: " + " -> ".join(cycle)


def _assigned(node: ast.AST) -> list[ast.Attribute]:
    """The attributes an assignment node assigns (plain, augmented, annotated, setattr with a
    constant name: as an Attribute of its object)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == "setattr" and len(node.args) == 3
          and isinstance(node.args[1], ast.Constant)):  # fmt: skip
        attribute = ast.Attribute(node.args[0], node.args[1].value, ast.Store())
        return [ast.copy_location(attribute, node)]
    else:
        return []
    return [t for target in targets for t in ast.walk(target) if isinstance(t, ast.Attribute)]


def _on_self(attribute: ast.Attribute) -> bool:
    return isinstance(attribute.value, ast.Name) and attribute.value.id == "self"


def _chunk_fields() -> set[str]:
    """Every attribute the Chunk class sets on itself (`self.<name> = ...` in its methods)."""
    tree = ast.parse(Path(chunk_module.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Chunk")
    return {a.attr for node in ast.walk(cls) for a in _assigned(node) if _on_self(a)}


def assignments_to(fields: set[str], root: Path, skip: Path | None = None) -> list[str]:
    """`file:line attribute` of every assignment to an attribute named in `fields` on anything
    but `self`, in the Python source under `root` but `skip`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == skip:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            found += [f"{path.relative_to(root.parent)}:{a.lineno} {a.attr}"
                      for a in _assigned(node) if a.attr in fields and not _on_self(a)]  # fmt: skip
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1].split()[0])))


def test_the_field_finder_sees_plain_augmented_annotated_and_setattr_assignments(tmp_path):
    (tmp_path / "pkg").mkdir()
    source = tmp_path / "pkg" / "x.py"
    source.write_text(
        "c._pins = 1\nc._pins += 1\nc._pins: int = 2\nsetattr(c, '_pins', 3)\n"
        "a, c._state = 1, 2\nself._pins = 0\nc.other = 4\nc.pin()\n"
    )
    found = assignments_to({"_pins", "_state"}, tmp_path / "pkg")
    assert found == ["pkg/x.py:1 _pins", "pkg/x.py:2 _pins", "pkg/x.py:3 _pins",
                     "pkg/x.py:4 _pins", "pkg/x.py:5 _state"]  # fmt: skip
    assert assignments_to({"_pins"}, tmp_path / "pkg", skip=source) == []


def test_nothing_outside_the_chunk_module_assigns_a_chunk_field():
    fields = _chunk_fields()
    assert {"_pins", "_state", "_home", "_rooms", "_offset"} <= fields
    found = assignments_to(fields, PACKAGE, skip=Path(chunk_module.__file__))
    assert not found, "chunk fields assigned outside fxstar/runtime/chunk.py: " + ", ".join(found)
