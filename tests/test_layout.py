"""The library's shape: no import circle, no import from a lower layer up (pxn_kernels < transport < integration),
no file over 900 lines, no class over 700 lines or 45 methods. Read from the source with ``ast``; nothing is run."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("pxn_kernels", "transport", "integration")  # each may import only those before it, and itself
MAX_FILE_LINES, MAX_CLASS_LINES, MAX_METHODS = 900, 700, 45


def _modules():
    mods = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _imports(path, name, mods):
    """The library modules ``path`` imports, at any depth (imports inside functions count: they still tie the
    modules together)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def test_no_import_circle_and_no_import_up():
    mods = _modules()
    graph = {name: _imports(path, name, mods) for name, path in mods.items()}
    up = [f"{a} -> {b}" for a, deps in graph.items() for b in deps
          if LAYERS.index(b.split(".")[0]) > LAYERS.index(a.split(".")[0])]
    assert not up, f"imports from a lower layer up: {up}"
    # a package's __init__ re-exporting its children is not a circle of the code's own
    edges = {a: {b for b in deps if not (mods[b].name == "__init__.py" and a.startswith(b + "."))
                 and not (mods[a].name == "__init__.py" and b.startswith(a + "."))} for a, deps in graph.items()}
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                circles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_no_file_or_class_over_the_limits():
    over = []
    for path in _modules().values():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            over.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                n_lines = node.end_lineno - node.lineno + 1
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if n_lines > MAX_CLASS_LINES or methods > MAX_METHODS:
                    over.append(f"{path.relative_to(ROOT)}:{node.name}: {n_lines} lines, {methods} methods")
    assert not over, f"over {MAX_FILE_LINES} lines a file / {MAX_CLASS_LINES} lines or {MAX_METHODS} methods a " \
                     f"class: {over}"
