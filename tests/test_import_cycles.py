"""The package's modules import one another without a cycle, counting every import statement
(module level and inside functions), so that the layers of docs/architecture.md point one way."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "river_gguf"
# The package's compiled modules (CMakeLists.txt's pybind11 modules, installed into it): imports of
# them are outside the scan, whatever else binds their name.
COMPILED = {f"river_gguf.{m}" for m in re.findall(r"pybind11_add_module\((\w+)", (ROOT / "CMakeLists.txt").read_text())}


def _modules() -> dict:
    """Dotted module name -> source path, for every module of the checkout's package."""
    root = PACKAGE.parent
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _bound_names(path: pathlib.Path) -> set:
    """The names a module binds at its top level (definitions, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _imports(name: str, path: pathlib.Path, mods: dict) -> set:
    """The package's modules that `name` imports: `import a.b` names a.b; `from a import b` names
    the module a.b when there is one, else a when a binds b (a compiled module a.b, such as the
    native engine, is outside the scan)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in mods or sub in COMPILED:
                    out.add(sub)
                elif base in mods and (a.name == "*" or a.name in _bound_names(mods[base])):
                    out.add(base)
    return {m for m in out if m in mods and m != name}


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _graph() -> dict:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_the_package_has_no_import_cycle():
    assert COMPILED == {"river_gguf._native"}
    graph = _graph()
    assert len(graph) > 20 and sum(map(len, graph.values())) > 40, "the scan found too little: it is not looking"
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_imports_inside_functions_count():
    mods = _modules()
    # serve_cmd imports the web app only when `river-gguf serve` runs: that import still counts.
    assert "river_gguf.serve.app" in _imports("river_gguf.cli.serve_cmd", mods["river_gguf.cli.serve_cmd"], mods)
