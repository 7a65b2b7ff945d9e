"""No function body in the package runs over MAX_BODY lines (its signature, decorators and
docstring aside; a nested function counts in its parent's body and on its own), except those in
LONG, which are to be split: a new one fails here, and so does a listed one once it is split,
so that the list only shrinks."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "python" / "river_gguf"
MAX_BODY = 100

#: Functions over MAX_BODY lines today ("module:qualified name"), to be split.
LONG: set = set()


def _body_lines(fn: ast.AST) -> int:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function in `tree`, methods and nested functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def long_functions() -> dict:
    """'module:qualified name' -> body lines, of every function over MAX_BODY lines."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).with_suffix("").as_posix()
        for name, fn in _functions(ast.parse(path.read_text(), str(path))):
            n = _body_lines(fn)
            if n > MAX_BODY:
                out[f"{module}:{name}"] = n
    return out


def test_the_measure_counts_a_body_without_its_docstring():
    src = 'def f(a,\n      b):\n    """Doc\n    string."""\n    x = 1\n\n    return x\n'
    (name, fn), = _functions(ast.parse(src))
    assert name == "f" and _body_lines(fn) == 3
    cls = "class C:\n    def m(self):\n        def inner():\n            pass\n        return inner\n"
    assert [n for n, _ in _functions(ast.parse(cls))] == ["C.m", "C.m.inner"]


def test_no_new_function_body_over_the_limit():
    new = {k: v for k, v in long_functions().items() if k not in LONG}
    assert not new, f"function bodies over {MAX_BODY} lines (split them by meaning): {new}"


def test_every_listed_long_function_is_still_long():
    gone = LONG - set(long_functions())
    assert not gone, f"split or gone, so take them off LONG: {sorted(gone)}"
