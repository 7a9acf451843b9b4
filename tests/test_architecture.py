"""The architecture as written in docs/ARCHITECTURE.md holds in the code: imports go one way (no cycle,
no edge the document does not allow), the engine names no policy and no model family, its size stays
small, and every module path and name the document cites exists."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "ecache_cli"
DOC = REPO / "docs" / "ARCHITECTURE.md"


def modules() -> dict[str, Path]:
    """Dotted module name → file, for every module and package of ecache_cli."""
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """Module → the ecache_cli modules importing it runs: every import statement (also inside functions),
    plus the package ``__init__`` of each imported module's parents, less the importer's own parent
    packages (already run before it)."""
    mods = modules()
    graph = {}
    for mod, f in mods.items():
        is_pkg = f.name == "__init__.py"
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                if base and base.split(".")[0] == "ecache_cli":
                    targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.split(".")[0] == "ecache_cli"}
        runs = {".".join(t.split(".")[:i]) for t in targets for i in range(2, t.count(".") + 2)} & set(mods)
        ancestors = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        graph[mod] = runs - ancestors - {mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def allowed_imports() -> dict[str, set[str]]:
    """The ```imports block of docs/ARCHITECTURE.md: package → the packages it may import."""
    block = re.search(r"```imports\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/ARCHITECTURE.md has no ```imports block"
    out = {}
    for line in block.group(1).splitlines():
        src, _, dst = line.partition("->")
        out[src.strip()] = {d.strip() for d in dst.split(",") if d.strip()}
    return out


def package_of(mod: str) -> str:
    return mod.split(".")[1] if "." in mod else "ecache_cli"


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_between_packages_is_one_the_document_allows():
    allowed = allowed_imports()
    bad = []
    for mod, deps in import_graph().items():
        src = package_of(mod)
        if src == "ecache_cli":
            continue
        assert src in allowed, f"package {src} is missing from the imports block of docs/ARCHITECTURE.md"
        bad += [f"{mod} -> {d}" for d in sorted(deps) if package_of(d) != src and package_of(d) not in allowed[src]]
    assert bad == [], "imports the architecture does not allow:\n" + "\n".join(bad)


def code_tokens(path: Path) -> list[str]:
    """The names and string literals of a module, without its docstrings and comments."""
    src = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.add(first.lineno)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.NAME:
            out.append(tok.string)
        elif tok.type == tokenize.STRING and tok.start[0] not in docstrings:
            out.append(tok.string)
    return out


def test_the_engine_names_no_policy_and_no_model_family():
    from ecache_cli.cache import POLICIES

    # "block" is also the canvas's own unit (a row's block, its block clock), which the engine must name
    words = {w for name in POLICIES for w in (name, name.replace("-", "_")) if w != "block"} | {"llada", "dream"}
    hits = []
    for f in sorted((PKG / "engine").glob("*.py")):
        for tok in code_tokens(f):
            is_string = tok[-1:] in "\"'"
            if is_string and any(re.search(rf"\b{re.escape(w)}\b", tok.lower()) for w in words):
                hits.append(f"{f.name}: {tok}")
            elif not is_string and any(w in {tok, tok.lower()} if w in ("llada", "dream") else w == tok
                                       for w in words):
                hits.append(f"{f.name}: {tok}")
    assert hits == []


def test_the_token_check_sees_names_and_strings_but_not_docstrings(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""Cites Dream and dual."""\nx = dream\ny = "dual cache"\n# entropy\n')
    assert code_tokens(f) == ["x", "dream", "y", '"dual cache"']


def test_the_engine_stays_small():
    sizes = {f.name: len(f.read_text().splitlines()) for f in (PKG / "engine").glob("*.py")}
    assert sizes["core.py"] <= 300 and sum(sizes.values()) <= 900, sizes
    long = []
    for f in (PKG / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{f.name}:{node.name} {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def long_functions(folder: Path, limit: int) -> list[str]:
    """``file:function N lines`` for every function or method of the modules in ``folder`` (nested ones
    too) longer than ``limit`` lines, its decorators and docstring included."""
    long = []
    for f in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit:
                long.append(f"{f.name}:{node.name} {node.end_lineno - node.lineno + 1} lines")
    return long


def test_no_function_of_runs_is_over_50_lines():
    assert long_functions(PKG / "runs", 50) == []


def test_no_function_of_models_is_over_60_lines():
    """The shared forward reads as its layer loop; each family file declares, it does not compute."""
    assert long_functions(PKG / "models", 60) + long_functions(PKG / "models" / "families", 60) == []


def test_the_length_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(50))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body}\n")
    assert long_functions(tmp_path, 50) == ["m.py:long 51 lines"]


def defined_names() -> set[str]:
    """Every module, package, class, function, method, argument and assigned attribute name in ecache_cli."""
    names = {part for mod in modules() for part in mod.split(".")}
    for f in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names |= {a.arg for a in node.args.args + node.args.kwonlyargs}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                names |= {t.attr for t in node.targets if isinstance(t, ast.Attribute)}
    return names


def test_every_module_path_and_name_the_document_cites_exists():
    text = DOC.read_text()
    cited = re.findall(r"`([^`\n]+)`", text)
    missing = []
    files = {f.name for f in PKG.rglob("*.py")}
    for c in cited:
        for path in re.findall(r"[\w/]+\.py\b", c):
            if "/" not in path and path in files:  # a file named within its folder's row
                continue
            if not any((base / path).exists() for base in (REPO, PKG)):
                missing.append(path)
    names = defined_names()
    for c in cited:  # Name, Name.attr and call forms: each dotted part must be defined somewhere
        m = re.fullmatch(r"([A-Za-z_][\w.]*)(\(.*\))?(?: -> \w+)?", c.strip())
        if not m or "/" in c or m.group(1).endswith(".py"):
            continue
        for part in m.group(1).split("."):
            if part not in names and part not in {"ecache", "import", "self", "store", "model", "state", "record",
                                                  "torch"} and not part.isupper() and len(part) > 2:
                missing.append(c)
                break
    assert missing == [], f"docs/ARCHITECTURE.md cites what does not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("cited", ["`ecache_cli/engine/nowhere.py`", "`Run.launch`"])
def test_the_citation_check_catches_a_missing_path_or_name(tmp_path, monkeypatch, cited):
    doc = tmp_path / "ARCHITECTURE.md"
    doc.write_text(DOC.read_text() + f"\n{cited}\n")
    monkeypatch.setattr(__import__(__name__), "DOC", doc)
    with pytest.raises(AssertionError, match="cites what does not exist"):
        test_every_module_path_and_name_the_document_cites_exists()
