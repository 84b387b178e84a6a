"""The import graph, read from the sources with `ast` (nothing is imported or run): the product never
imports the tooling package, no kernel folder imports another in a cycle, the layering
eval -> decoders -> declab_arch -> declab_kernels has no back edge, every import of a lab module names
one that exists, and no benchmark (`bench.py`) sits in the product. Imports inside functions count."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lower layers first: a module may import its own layer or one below it.
LAYERS = ["declab_kernels", "declab_arch", "decoders", "eval"]
TOOLING = "declab_bench"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every module `path` imports (absolute names; relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # `from pkg import sub` may name a submodule: both are recorded, the check takes the longest.
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def product_graph() -> dict[str, set[str]]:
    """module -> the modules of the lab (product and tooling) it imports."""
    ours = tuple(LAYERS) + (TOOLING,)
    graph = {}
    for top in LAYERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            graph[module_name(path)] = {m for m in imports_of(path) if m.split(".")[0] in ours}
    return graph


def kernel_folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "declab_kernels" and len(parts) > 1 and (ROOT / "declab_kernels" / parts[1]).is_dir() else None


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph `edges` as a list of nodes (first repeated last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_imports_of_resolves_relative_and_nested_imports(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    src = tmp_path / "pkg" / "sub" / "mod.py"
    src.write_text("from . import sibling\nfrom ..other import thing\n\ndef f():\n    import declab_bench.gemv\n")
    assert imports_of(src, tmp_path) >= {"pkg.sub.sibling", "pkg.other.thing", "declab_bench.gemv"}


def module_exists(name: str, root: Path = ROOT) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def missing_imports(path: Path, root: Path = ROOT) -> list[str]:
    """The lab modules `path` imports that do not exist (`import a.b`, `from a.b import c` needs a.b)."""
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    ours = tuple(LAYERS) + (TOOLING,)
    missing = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [base]
        else:
            continue
        missing += [n for n in names if n.split(".")[0] in ours and not module_exists(n, root)]
    return missing


def test_missing_imports_finds_a_deleted_module(tmp_path):
    (tmp_path / "decoders").mkdir()
    (tmp_path / "decoders" / "records.py").write_text("")
    src = tmp_path / "decoders" / "user.py"
    src.write_text("from decoders.records import append_jsonl\nfrom declab_kernels.benchtools import time_ms\n")
    assert missing_imports(src, tmp_path) == ["declab_kernels.benchtools"]


def test_every_lab_import_names_a_module_that_exists():
    paths = [p for top in LAYERS + [TOOLING] for p in sorted((ROOT / top).rglob("*.py"))]
    bad = sorted(f"{module_name(p)} imports {m}" for p in paths for m in missing_imports(p))
    assert not bad, bad


def test_benchmarks_live_in_the_tooling_package():
    benches = sorted(str(p.relative_to(ROOT)) for top in LAYERS for p in (ROOT / top).rglob("bench.py"))
    assert not benches, benches


def test_the_product_never_imports_the_tooling():
    bad = sorted(f"{m} imports {i}" for m, deps in product_graph().items() for i in deps if i.split(".")[0] == TOOLING)
    assert not bad, bad


def test_no_back_edge_between_layers():
    rank = {top: i for i, top in enumerate(LAYERS)}
    bad = sorted(f"{m} imports {i}" for m, deps in product_graph().items() for i in deps
                 if i.split(".")[0] in rank and rank[i.split(".")[0]] > rank[m.split(".")[0]])
    assert not bad, bad


def test_no_cycle_between_kernel_folders():
    folders: dict[str, set[str]] = {}
    for module, deps in product_graph().items():
        if (src := kernel_folder(module)) is not None:
            folders.setdefault(src, set()).update(d for d in map(kernel_folder, deps) if d is not None and d != src)
    assert set(folders) >= {"paged_attention", "rotary", "gemv"}
    assert find_cycle(folders) is None, find_cycle(folders)
