"""The package's layout, read from its source: no import circles, the engine never needs a tool, no
import runs back up the layers (the leaves; the build and the kernels; the native handles; the decoding
engine; the runtime and the request surface; the front doors; the programs that drive them), and the
package's root holds only its public surface and two leaves: every other module sits in a folder named
for what it holds.

Every module of ``dflash_gguf`` is parsed (never imported: no native library is loaded) and each of its
imports resolved to the module it loads - ``import x`` and ``from x import y``, relative ones, those
inside functions (they run on first use, and a circle through one is a circle all the same), and the
names a package's ``_LAZY`` table loads on first use. Imports under ``if TYPE_CHECKING:`` never run and
are left out. Imports by computed name (``importlib.import_module(variable)``) are not followed.
"""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import pytest

pytestmark = pytest.mark.pure

PACKAGE = "dflash_gguf"
SOURCE = Path(__file__).resolve().parents[1]

# the modules the package's root holds: its public surface and two leaves every layer reads
ROOT = ("dflash_gguf", "dflash_gguf.__main__", "dflash_gguf.api", "dflash_gguf.batch", "dflash_gguf.pair",
        "dflash_gguf.constructors", "dflash_gguf.runtime", "dflash_gguf.hub", "dflash_gguf.cli", "dflash_gguf.options",
        "dflash_gguf.demo", "dflash_gguf.errors", "dflash_gguf.paths")
# the leaves: the typed errors and where things live (files, caches, the patch series)
LEAVES = ("dflash_gguf.errors", "dflash_gguf.paths")
# the native handles: the library's bindings, its models and contexts, and what runs beside them
NATIVE = ("dflash_gguf.native",)
# ggml's kernels checked and switched from Python, and the build of the patched library
KERNELS = ("dflash_gguf.kernels",)
BUILD = ("dflash_gguf.build",)
# the decoding engine and the front doors built on it
ENGINE = ("dflash_gguf.decoding", "dflash_gguf.native", "dflash_gguf.kernels", "dflash_gguf.requests",
          "dflash_gguf.runtime", "dflash_gguf.api", "dflash_gguf.batch", "dflash_gguf.server", "dflash_gguf.pair",
          "dflash_gguf.constructors", "dflash_gguf.hub", "dflash_gguf.cli", "dflash_gguf.options")
# tools: they drive the engine from outside and are never part of it
TOOLS = ("dflash_gguf.bench", "dflash_gguf.reliability")
# the request surface the front doors share (dflash_gguf.requests), but its defaults table: a leaf that the
# engine's SamplingParams reads too
REQUESTS = ("dflash_gguf.requests.served", "dflash_gguf.requests.stops", "dflash_gguf.requests.prompts",
            "dflash_gguf.requests.responses", "dflash_gguf.requests.stopping", "dflash_gguf.requests.logprobs",
            "dflash_gguf.requests.calls")
DEFAULTS = "dflash_gguf.requests.defaults"
# what the decoding engine is built into: the front doors, what builds their runtimes and requests, and the
# programs that run them
FRONT_DOORS = ("dflash_gguf.api", "dflash_gguf.batch", "dflash_gguf.server", "dflash_gguf.pair",
               "dflash_gguf.constructors", "dflash_gguf.runtime", "dflash_gguf.options", "dflash_gguf.hub",
               "dflash_gguf.cli", "dflash_gguf.demo", "dflash_gguf.convert") + REQUESTS
# the package's layers, bottom first: a module imports from its own layer and the layers below, never above
# (imports inside functions too). Every module has one: the longest name of the table that holds it.
LAYERS = (
    LEAVES + (DEFAULTS, PACKAGE),            # the package itself: its version, and names that load on first use
    BUILD + KERNELS,
    NATIVE,
    ("dflash_gguf.decoding",),
    ("dflash_gguf.runtime", "dflash_gguf.requests"),
    ("dflash_gguf.__main__", "dflash_gguf.api", "dflash_gguf.batch", "dflash_gguf.server",
     "dflash_gguf.pair", "dflash_gguf.constructors", "dflash_gguf.hub", "dflash_gguf.options", "dflash_gguf.cli",
     "dflash_gguf.convert"),
    TOOLS + ("dflash_gguf.demo",),           # the demo ends with a benchmark's line: a program beside the tools
)
# the rules that load without the native build (their tests run under ``pytest --pure``)
PURE = ("dflash_gguf.decoding.gate", "dflash_gguf.decoding.sampling", "dflash_gguf.decoding.constraints",
        "dflash_gguf.requests.stopping",
        DEFAULTS, "dflash_gguf.requests.served", "dflash_gguf.requests.stops", "dflash_gguf.requests.responses",
        "dflash_gguf.decoding.acceptance", "dflash_gguf.decoding.batch_costs",
        "dflash_gguf.decoding.stats", "dflash_gguf.decoding.confidence", "dflash_gguf.decoding.rollback",
        "dflash_gguf.decoding.history", "dflash_gguf.decoding.policy", "dflash_gguf.decoding.ngram")
# what a pure module must not load: the patched llama.cpp, its bindings, the conversion stack
NATIVE_LIBRARIES = ("llama_cpp", "cffi", "_cffi_backend", "torch", "transformers")


class Import(NamedTuple):
    target: str          # a module of the package, or a top-level outside name (numpy, llama_cpp)
    line: int
    deferred: bool       # inside a function: runs on first use, not when the module loads


def _in(module: str, areas: tuple[str, ...]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in areas)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under ``root/dflash_gguf``: its dotted name -> (file, whether it is a package)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _lazy_names(modules: dict[str, tuple[Path, bool]], trees: dict[str, ast.Module]) -> dict[str, str]:
    """``package.name`` -> the module a package's ``_LAZY`` table loads it from on first use."""
    out = {}
    for name, (_, package) in modules.items():
        if not package:
            continue
        for node in trees[name].body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
                for attr, where in ast.literal_eval(node.value).items():
                    out[f"{name}.{attr}"] = where if where.startswith(PACKAGE + ".") else f"{name}.{where}"
    return out


@lru_cache(maxsize=None)
def imports(root: Path = SOURCE) -> dict[str, list[Import]]:
    """Each module's imports that run (TYPE_CHECKING blocks left out)."""
    modules = _modules(root)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, (path, _) in modules.items()}
    lazy = _lazy_names(modules, trees)

    def resolve(name: str) -> str:
        name = lazy.get(name, name)
        if not _in(name, (PACKAGE,)):
            return name.partition(".")[0]
        while name and name not in modules:           # an attribute of a module: the module
            name = name.rpartition(".")[0]
        return name or PACKAGE

    def source_of(node: ast.ImportFrom, here: str) -> str:
        if not node.level:
            return node.module or ""
        base = here.split(".")[:len(here.split(".")) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, here: str, deferred: bool, out: list[Import]) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, here, deferred, out)
            return
        if isinstance(node, ast.Import):
            out.extend(Import(resolve(a.name), node.lineno, deferred) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = source_of(node, here)
            for a in node.names:
                full = f"{source}.{a.name}"
                out.append(Import(resolve(full if full in modules or full in lazy else source), node.lineno, deferred))
        deferred = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        # an import is a statement: only the blocks of statements are read, never an expression
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, block, ()):
                visit(child, here, deferred, out)

    found = {}
    for name, (_, package) in modules.items():
        out: list[Import] = []
        visit(trees[name], name if package else name.rpartition(".")[0], False, out)
        found[name] = list(dict.fromkeys(i for i in out if i.target != name))   # one per line and target
    return found


def _graph(found: dict[str, list[Import]], deferred: bool = True) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (with imports inside functions unless ``deferred`` is False)."""
    return {m: {i.target for i in found[m] if i.target in found and (deferred or not i.deferred)} for m in found}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: every strongly connected group of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def reached(graph: dict[str, set[str]], roots: list[str]) -> dict[str, list[str]]:
    """Every module ``roots`` load, directly or not: module -> the chain of imports from a root to it."""
    chains = {r: [r] for r in roots}
    todo = list(roots)
    while todo:
        m = todo.pop()
        for t in sorted(graph[m]):
            if t not in chains:
                chains[t] = chains[m] + [t]
                todo.append(t)
    return chains


def violations(found: dict[str, list[Import]], sources: tuple[str, ...], forbidden: tuple[str, ...],
               deferred: bool = True) -> list[str]:
    """The modules of ``forbidden`` that a module of ``sources`` loads, each with the chain that gets there."""
    chains = reached(_graph(found, deferred), [m for m in found if _in(m, sources)])
    return [" -> ".join(chain) for m, chain in sorted(chains.items()) if _in(m, forbidden)]


def _describe(group: list[str], found: dict[str, list[Import]]) -> str:
    inside = set(group)
    edges = [f"{m} -> {i.target} (line {i.line}{', in a function' if i.deferred else ''})"
             for m in group for i in found[m] if i.target in inside]
    return "\n  ".join(edges)


# ---------------------------------------------------------------------------- the package's rules
def test_no_import_circles():
    found = imports()
    assert len(found) > 50 and all(_in(m, (PACKAGE,)) for m in found), "the package's modules were not found"
    circles = cycles(_graph(found))
    assert not circles, "import circles:\n  " + "\n\n  ".join(_describe(g, found) for g in circles)


def test_the_engine_never_imports_the_tools():
    """bench and reliability drive the engine from outside; the engine and its front doors never load
    them, not even on first use of a function."""
    bad = violations(imports(), ENGINE, TOOLS)
    assert not bad, "the engine loads a tool:\n  " + "\n  ".join(bad)


def test_the_decoding_engine_does_not_import_its_front_doors():
    """The decoding engine is what the front doors are built on: it loads none of them, nor what builds
    their runtimes and requests."""
    bad = violations(imports(), ("dflash_gguf.decoding",), FRONT_DOORS + TOOLS)
    assert not bad, "the decoding engine loads what is built on it:\n  " + "\n  ".join(bad)


def test_the_native_handles_import_nothing_built_on_them():
    bad = violations(imports(), NATIVE, ("dflash_gguf.decoding",) + FRONT_DOORS + TOOLS)
    assert not bad, "the native handles load what is built on them:\n  " + "\n  ".join(bad)


def _outside(found: dict[str, list[Import]], sources: tuple[str, ...], allowed: tuple[str, ...]) -> list[str]:
    """The package's modules that a module of ``sources`` imports outside ``sources`` and ``allowed``."""
    return [f"{m} -> {i.target} (line {i.line})" for m in sorted(found) if _in(m, sources) for i in found[m]
            if _in(i.target, (PACKAGE,)) and not _in(i.target, sources + allowed)]


def test_the_lower_folders_import_only_themselves_and_the_leaves():
    """The native handles, the kernels and the build stand on nothing of the package but the leaves (the
    typed errors, where things live); the kernels not even on those; the leaves on nothing."""
    found = imports()
    bad = (_outside(found, NATIVE, LEAVES) + _outside(found, BUILD, LEAVES) + _outside(found, KERNELS, ())
           + _outside(found, LEAVES, ()))
    assert not bad, "a lower folder loads what is above it:\n  " + "\n  ".join(bad)


def _layer(module: str) -> int | None:
    best = max(((len(a), n) for n, areas in enumerate(LAYERS) for a in areas if module == a or
                (a != PACKAGE and module.startswith(a + "."))), default=None)
    return best[1] if best else None


def test_no_import_runs_back_up_the_layers():
    """Each module imports from its own layer and those below it: leaves, build and kernels, native
    handles, decoding engine, runtime and request surface, front doors, programs that drive them."""
    found = imports()
    unplaced = [m for m in found if _layer(m) is None]
    assert not unplaced, f"modules no layer holds: {unplaced}"
    bad = [f"{m} (layer {_layer(m)}) -> {i.target} (layer {_layer(i.target)}, line {i.line}"
           f"{', in a function' if i.deferred else ''})"
           for m in sorted(found) for i in found[m] if i.target in found and _layer(i.target) > _layer(m)]
    assert not bad, "imports that run back up:\n  " + "\n  ".join(bad)


def test_the_root_holds_only_the_public_surface_and_the_leaves():
    """A new module goes into the folder named for what it holds, not into the package's root."""
    found = imports()
    root = {m for m in found if m.count(".") <= 1 and not (Path(SOURCE / PACKAGE / m.rpartition(".")[2]).is_dir())}
    assert root == set(ROOT), root ^ set(ROOT)


def test_the_pure_rules_load_without_the_native_build():
    """Loading one of these loads no native library (imports inside functions run later, if at all)."""
    found = imports()
    assert all(m in found for m in PURE), [m for m in PURE if m not in found]
    chains = reached(_graph(found, deferred=False), list(PURE))
    bad = [" -> ".join(chains[m] + [i.target]) for m in sorted(chains) for i in found[m]
           if not i.deferred and (i.target in NATIVE_LIBRARIES or _in(i.target, NATIVE + KERNELS + BUILD))]
    assert not bad, "a pure rule loads the native build:\n  " + "\n  ".join(bad)


def test_the_request_surface_is_one_folder_of_front_door_parts_and_a_leaf_table():
    """Every module of dflash_gguf.requests is placed above (a new one too), and the defaults table loads
    nothing of the package: the engine reads it without loading what is built on the engine."""
    found = imports()
    surface = {m for m in found if _in(m, ("dflash_gguf.requests",))} - {"dflash_gguf.requests"}
    assert surface == set(REQUESTS) | {DEFAULTS}, surface ^ (set(REQUESTS) | {DEFAULTS})
    assert not [i.target for i in found[DEFAULTS] if _in(i.target, (PACKAGE,))]


# ---------------------------------------------------------------------------- the reader itself
def test_the_reader_sees_deferred_relative_and_lazy_imports_and_skips_type_checking(tmp_path):
    """A reader that missed an import would let every rule above pass: a package made to break each."""
    pkg = tmp_path / PACKAGE
    (pkg / "inner").mkdir(parents=True)
    files = {
        "__init__.py": '_LAZY = {"Thing": "dflash_gguf.c"}\n',
        "a.py": "from typing import TYPE_CHECKING\nimport numpy\nif TYPE_CHECKING:\n    from dflash_gguf import b\n"
                "def f():\n    from . import b\n\nclass K:\n    def g(self):\n        try:\n            import json\n"
                "        except ImportError:\n            pass\n",
        "b.py": "from dflash_gguf import Thing\n",
        "c.py": "import llama_cpp.llama_cpp\nfrom .inner.d import x\n",
        "inner/__init__.py": '_LAZY = {"y": "d"}\n',
        "inner/d.py": "x = 1\ny = 2\n",
        "inner/e.py": "from .. import a\nfrom dflash_gguf.inner import y\nif TYPE_CHECKING:\n    import dflash_gguf.c\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    found = imports(tmp_path)
    assert {(i.target, i.deferred) for i in found["dflash_gguf.a"]} == \
        {("typing", False), ("numpy", False), ("dflash_gguf.b", True), ("json", True)}
    assert [i.target for i in found["dflash_gguf.b"]] == ["dflash_gguf.c"]
    assert [i.target for i in found["dflash_gguf.c"]] == ["llama_cpp", "dflash_gguf.inner.d"]
    assert [i.target for i in found["dflash_gguf.inner.e"]] == ["dflash_gguf.a", "dflash_gguf.inner.d"]
    assert cycles(_graph(found)) == [] and cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == [["x", "y", "z"]]
    assert violations(found, ("dflash_gguf.a",), ("dflash_gguf.inner",)) == \
        ["dflash_gguf.a -> dflash_gguf.b -> dflash_gguf.c -> dflash_gguf.inner.d"]
    assert violations(found, ("dflash_gguf.a",), ("dflash_gguf.inner",), deferred=False) == []
