"""fusionpass's modules import each other without cycles (issue 42): at module level, and also were
every import inside a function moved to module level, so no function-level import exists only to
break a cycle (those that remain defer Triton and the kernels to the first launch). Read from the
source with ast; an ancestor package is initialized before its modules, so it is no edge."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fusionpass"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (annotations only, never run)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            found |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return found


def _targets(module: str, node, modules) -> list[str]:
    """The fusionpass modules an import statement runs."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    base = node.module or ""
    if node.level:
        package = module.split(".") if modules[module].name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    names = len(submodules) < len(node.names)  # names defined by the module `base` itself
    return submodules + ([base] if names and base in modules else [])


def import_graph(function_level: bool) -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = _type_checking_only(tree)
        statements = ast.walk(tree) if function_level else (
            n for top in tree.body for n in ([top] if not isinstance(top, ast.Try) else top.body))
        edges = set()
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                edges |= {t for t in _targets(module, node, modules)
                          if t != module and not module.startswith(t + ".")}
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_at_module_level():
    assert cycles(import_graph(function_level=False)) == []


def test_no_function_level_import_breaks_a_cycle():
    assert cycles(import_graph(function_level=True)) == []


def test_the_check_sees_a_cycle():
    graph = import_graph(function_level=False)
    assert "fusionpass.registry" in graph["fusionpass.config"]  # config reads the registry
    graph["fusionpass.registry"] = {*graph["fusionpass.registry"], "fusionpass.config"}
    assert ["fusionpass.config", "fusionpass.registry"] in cycles(graph)
