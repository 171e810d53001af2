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


MAX_FUNCTION_LINES, MAX_COMPLEXITY = 80, 25


def _complexity(fn) -> int:
    """McCabe's count of one function: 1 + its decisions (branches, loops, handlers, each extra operand of
    ``and``/``or``, each comprehension and its conditions, each ``case``); nested functions count on their own."""
    n = 1
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, (ast.If, ast.For, ast.While, ast.AsyncFor, ast.ExceptHandler, ast.IfExp,
                             ast.match_case)):
            n += 1
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            n += 1 + len(node.ifs)
        stack.extend(ast.iter_child_nodes(node))
    return n


def test_no_function_over_the_limits():
    """A function over 80 lines or McCabe complexity 25 is split by decision (one function per message type,
    unit kind or case), which keeps each readable and testable alone."""
    over = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n_lines, cx = node.end_lineno - node.lineno + 1, _complexity(node)
                if n_lines > MAX_FUNCTION_LINES or cx > MAX_COMPLEXITY:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n_lines} lines, "
                                f"complexity {cx}")
    assert not over, f"over {MAX_FUNCTION_LINES} lines or complexity {MAX_COMPLEXITY} a function: {over}"


# private names of other code that the library may read, each for a reason
PRIVATE_ALLOWED = {
    "_getframe": "sys._getframe: the stdlib's way to find the caller's frame (the sglang plug-in's import hook)",
    "_replace": "namedtuple._replace is public API despite its underscore (urllib's SplitResult)",
    "_C": "torch._C: the current raw CUDA stream, which torch exposes nowhere else",
    "_cuda_getCurrentRawStream": "torch._C: the current raw CUDA stream, which torch exposes nowhere else",
}


def _own_private_names(tree) -> set:
    """The private names a module defines: its functions, classes and module names, and every ``self._x`` or
    ``cls._x`` it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_no_module_reads_another_modules_private_members():
    """A part reads another part through its public methods: ``obj._x`` is allowed only where the reading module
    defines ``_x`` itself (its own classes' members), and no module imports another's ``_private`` name."""
    found = []
    for layer in ("transport", "integration"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            tree = ast.parse(path.read_text())
            own = _own_private_names(tree)
            where = path.relative_to(ROOT)
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                        and not node.attr.startswith("__") and node.attr not in own \
                        and node.attr not in PRIVATE_ALLOWED \
                        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{where}:{node.lineno} {ast.unparse(node)[:60]}")
                elif isinstance(node, ast.ImportFrom):
                    found += [f"{where}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, f"{len(found)} read(s) of another module's private members: {found}"
