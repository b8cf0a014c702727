"""No file cycles in the native layer: each file of ``_native/`` calls others only one way.

Every ``_native/**/*.c`` of the library's module is compiled as ``build_ffi.py`` compiles it
(same sources, defines, includes), and ``nm`` says which functions each object defines and
which it needs. A file that needs a function another defines (a call, or its address in an
ops table) depends on that file. The graph must have no strongly connected component of
more than one file. Data symbols (the transport table ``hx_transports[]`` naming each
transport's hooks) are the one sanctioned way for core to reach a transport and are not
edges. ``python tests/test_architecture.py`` prints the graph and the cycles.

The same holds for the Python package: no modules of ``aiohixl`` importing each other in a
circle (imports inside functions count).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "_native")


def _build_config():
    spec = importlib.util.spec_from_file_location("_aiohixl_build_ffi", os.path.join(NATIVE, "build_ffi.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _symbols(obj: str) -> tuple[set[str], set[str]]:
    """Functions the object defines (global), and symbols it needs."""
    out = subprocess.run(["nm", "-P", obj], check=True, capture_output=True, text=True).stdout
    defined, needed = set(), set()
    for line in out.splitlines():
        name, kind = line.split()[:2]
        if kind == "T":
            defined.add(name)
        elif kind == "U":
            needed.add(name)
    return defined, needed


def file_graph() -> dict[str, set[str]]:
    """file (relative to _native/) -> the files whose functions it needs."""
    cfg = _build_config()
    flags = ["-O0", *cfg.COMPILE_ARGS, f"-I{sysconfig.get_paths()['include']}"]
    flags += [f"-I{os.path.join(ROOT, d)}" for d in cfg.INCLUDE_DIRS]
    flags += [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in cfg.DEFINE_MACROS]
    sources = [os.path.relpath(os.path.join(ROOT, s) if not os.path.isabs(s) else s, NATIVE) for s in cfg.SOURCES]
    with tempfile.TemporaryDirectory() as tmp:

        def compile_one(src: str) -> tuple[str, set[str], set[str]]:
            obj = os.path.join(tmp, src.replace(os.sep, "_") + ".o")
            subprocess.run(["gcc", "-c", *flags, "-o", obj, os.path.join(NATIVE, src)], check=True)
            return (src, *_symbols(obj))

        with ThreadPoolExecutor(max_workers=2) as pool:
            objs = list(pool.map(compile_one, sources))
    owner = {sym: src for src, defined, _ in objs for sym in defined}
    return {src: {owner[s] for s in needed if s in owner and owner[s] != src} for src, _, needed in objs}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def module_graph(package: str = os.path.join(ROOT, "aiohixl")) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in its text)."""
    paths = {}
    for dirpath, _, files in os.walk(package):
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(dirpath, f[:-3]), os.path.dirname(package)).split(os.sep)
                paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(dirpath, f)
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        base = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
        targets: set[str] = set()
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                rel = ".".join(base[: len(base) - node.level + 1] + [node.module or ""]).strip(".")
                root = rel if node.level else node.module or ""
                targets |= {root} | {f"{root}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[mod] = {t for t in targets if t in paths and t not in (mod, "aiohixl")}
    return graph


def test_cycles_are_found():
    """The checker itself: a cycle of three and a self-contained pair are seen; a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("nm") is None, reason="needs gcc and nm")
def test_native_files_have_no_cycles():
    graph = file_graph()
    assert len(graph) > 20, sorted(graph)  # every file was compiled and read
    assert cycles(graph) == []


def test_python_modules_have_no_cycles():
    graph = module_graph()
    assert len(graph) > 20 and sum(map(len, graph.values())) > 40, graph  # the imports were read
    assert cycles(graph) == []


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
def test_the_module_exports_its_init_alone():
    """Built with hidden visibility: the hx_* functions the files share are not the module's ABI."""
    from aiohixl import _hixl

    out = subprocess.run(["nm", "-D", "--defined-only", _hixl.__file__], check=True, capture_output=True, text=True)
    names = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    assert "PyInit__hixl" in names
    assert not {n for n in names if n.startswith(("hx_", "tcp_", "vb_", "cma_"))}


if __name__ == "__main__":
    g = file_graph()
    for src in sorted(g):
        print(f"{src} -> {', '.join(sorted(g[src])) or '-'}")
    found = cycles(g)
    for scc in found:
        print("cycle:", " <-> ".join(scc))
    print(f"{len(found)} file cycle(s) among {len(g)} files")
    py = cycles(module_graph())
    for scc in py:
        print("import cycle:", " <-> ".join(scc))
    print(f"{len(py)} import cycle(s) among the Python modules")
    sys.exit(1 if found or py else 0)
