"""The shape of the repository: the README's two commands stay true (CI runs exactly the README's
test command), no import circle, no long module, no parser that takes abbreviated flags."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:3]]
    main_cmd, test_cmd = blocks
    assert "lmengine generate --prompt-file examples/prompts.txt" in main_cmd
    assert "pytest" in test_cmd
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci_lines
    assert readme.index(main_cmd) < readme.index("## ")  # both open the README


def test_every_test_file_has_a_kind_in_both_maps(pytestconfig):
    """tests/conftest.py marks each test file with its kind (unit, engine, ...); the map in
    docs/testing.md names every file under the same kind, and each kind is a registered marker."""
    from tests.conftest import FOLDER_KINDS, TEST_KINDS, kind_of

    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert set(TEST_KINDS) | set(FOLDER_KINDS.values()) <= registered
    doc = (ROOT / "docs" / "testing.md").read_text()
    rows = {}  # kind -> its row of the map: | `kind` | what | files |
    for line in doc.split("## The map", 1)[1].split("\n## ", 1)[0].splitlines():
        if line.startswith("| `"):
            rows[line.split("`")[1]] = line
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        where = path.relative_to(ROOT)
        kind = kind_of(path)
        assert kind is not None, f"{where} has no kind: add it to TEST_KINDS in tests/conftest.py"
        if path.parent.name in FOLDER_KINDS:
            assert f"{path.parent.name}/" in rows[kind], f"docs/testing.md: {kind} row, {where}"
        else:
            assert f"`{path.name}`" in rows[kind], f"docs/testing.md names {where} as {kind}"


# ---- the shape of the package: no import circle, no long module, no abbreviated flag --------

MAX_MODULE_LINES = 500


def _module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module under root/package (a package is its __init__)."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _import_nodes(tree: ast.AST):
    """Every import statement at any depth (functions too), except under `if TYPE_CHECKING:`."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str) -> dict[str, dict[str, str]]:
    """module -> {imported module of the package: "file:line" of the first such import}.

    `import a.b` is an edge to a.b; `from a.b import c` to a.b.c when that is a module, else to
    a.b; an edge to a package is one to its __init__ (which runs what it imports)."""
    modules = _module_names(root, package)
    graph: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        edges: dict[str, str] = {}
        is_package = path.name == "__init__.py"
        for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            where = f"{path.relative_to(root)}:{node.lineno}"
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package upwards
                    anchor = name if is_package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(target, where)
        graph[name] = edges
    return graph


def _strongly_connected(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's components with more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def import_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The shortest cycle through each module that lies on one, each once, as [a, b, ..., a]."""
    cycles: dict[tuple[str, ...], list[str]] = {}
    for component in _strongly_connected(graph):
        members = set(component)
        for start in component:
            parent: dict[str, str | None] = {start: None}
            queue, last = [start], None
            while queue and last is None:  # breadth first: the shortest way back to start
                node = queue.pop(0)
                for child in sorted(set(graph[node]) & members):
                    if child == start:
                        last = node
                        break
                    if child not in parent:
                        parent[child] = node
                        queue.append(child)
            path: list[str] = []
            node = last
            while node is not None:
                path.append(node)
                node = parent[node]
            path.reverse()
            first = path.index(min(path))
            key = tuple(path[first:] + path[:first])
            cycles.setdefault(key, [*key, key[0]])
    return sorted(cycles.values())


def describe_cycle(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    steps = [f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join([*steps, cycle[-1]])


def test_import_graph_follows_every_import_but_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import f\n",
        "a.py": "def f():\n    from pkg import b\n    return b\n",
        "b.py": "import pkg.sub.c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from .. import a\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
        "else:\n    import pkg.b\n",
        "e.py": "from pkg import g\nimport os\n",
        "f.py": "from .b import name_in_b\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg"] == {"pkg.a": "pkg/__init__.py:1"}
    assert set(graph["pkg.a"]) == {"pkg.b"}  # inside a function, `from pkg import b`: a module
    assert set(graph["pkg.sub.c"]) == {"pkg.a"}  # relative, a module of the package
    assert set(graph["pkg.f"]) == {"pkg.b"}  # relative, a name in a module
    assert set(graph["pkg.d"]) == {"pkg.b"}  # the TYPE_CHECKING branch is not an import
    assert set(graph["pkg.e"]) == {"pkg"}  # a name of the package: its __init__
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    text = describe_cycle(graph, import_cycles(graph)[0])
    assert text == (
        "pkg.a (pkg/a.py:2) -> pkg.b (pkg/b.py:1) -> pkg.sub.c (pkg/sub/c.py:1) -> pkg.a"
    )
    # a submodule that imports its package's __init__, which re-exports it, is a circle too
    (pkg / "e.py").write_text("from pkg import a\nfrom pkg.sub import nothing\n")
    (pkg / "sub/__init__.py").write_text("from pkg.e import x\n")
    cycles = import_cycles(import_graph(tmp_path, "pkg"))
    assert ["pkg.e", "pkg.sub", "pkg.e"] in cycles


def test_no_import_circle_in_lmengine():
    graph = import_graph(ROOT, "lmengine")
    # the lazy import of a Triton launcher, inside the dispatching function, is an edge
    assert "lmengine.kernels.triton.paged_attention" in graph["lmengine.kernels.paged_attention"]
    cycles = [describe_cycle(graph, c) for c in import_cycles(graph)]
    assert not cycles, "import circles (module (the import's file:line) -> ...):\n" + "\n".join(
        cycles
    )


def test_no_module_over_the_line_limit():
    too_long = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / "lmengine").rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


# the engine's parts: only the engine (and the tensor-parallel agent, which is one) reach them
ENGINE_PARTS = {"request_manager", "scheduler", "model_agent", "validator", "output_stage"}


def test_front_ends_go_through_the_engine_client():
    """Nothing in lmengine/ outside the engine reaches into its parts: the pipeline, the
    server and the tools submit, stream, cancel and read stats through `engine.client`."""
    reached = []
    for path in sorted((ROOT / "lmengine").rglob("*.py")):
        rel = path.relative_to(ROOT / "lmengine").parts
        if rel[0] in ("engine", "distributed", "scheduler"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS:
                reached.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not reached, reached


def _parser_calls(tree: ast.AST):
    """Calls that make an argparse parser: ArgumentParser(...) and subparsers' add_parser(...)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("ArgumentParser", "add_parser"):
                yield node


def test_every_parser_refuses_abbreviated_flags():
    files = [
        path
        for folder in ("lmengine", "benchmarks", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
    ]
    found, allowing = 0, []
    for path in files:
        for call in _parser_calls(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            found += 1
            flags = {k.arg: k.value for k in call.keywords}
            value = flags.get("allow_abbrev")
            if not (isinstance(value, ast.Constant) and value.value is False):
                allowing.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert found >= 10  # the CLI, its sub-commands and the benchmark scripts
    assert not allowing, f"parsers without allow_abbrev=False: {allowing}"
