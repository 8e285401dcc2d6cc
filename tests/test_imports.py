"""minddp's modules import one another without a cycle, counting imports inside functions
(a cycle dodged by a function-local import is still a cycle), and without the optional
frameworks where they are not used."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "minddp")


def _modules():
    """module name -> source path, for every .py file under minddp/."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
                found[name] = os.path.join(folder, f)
    return found


def _imports(path, name, modules):
    """The minddp modules `name` imports (a `from pkg import mod` counts as mod)."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from package, up level - 1
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    edges.add(full)
                elif base in modules:
                    edges.add(base)
    edges.discard(name)
    return edges


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_no_import_cycle_in_minddp():
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert {"minddp.reducer", "minddp.compression"} <= graph["minddp.ddp"]  # the parse works
    assert "minddp.registry" in graph and not graph["minddp.registry"], (
        "the registry must import nothing of minddp: everything imports it")
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
