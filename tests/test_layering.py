"""The package's import graph: layers depend one way, and no module imports itself back.

Layers, bottom up: ``shmem`` (host SHMEM) <- ``language`` (dl) <- ``runtime`` (call sites,
dispatch) <- the ops and tools. Read from the sources (module-level and function-level
imports alike), so a lazy import cannot hide a cycle.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

import jax_triton_dist

PACKAGE = pathlib.Path(jax_triton_dist.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = ("jax_triton_dist",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[module] = {t for t in targets if t.startswith("jax_triton_dist")}
    names = set(graph)
    # `from pkg import mod` names module pkg.mod; `from mod import fn` names mod.
    return {m: {t for t in ts if t in names and t != m} for m, ts in graph.items()}


def _in(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


GRAPH = _imports()


def test_shmem_imports_neither_language_nor_runtime():
    for module, targets in GRAPH.items():
        if _in(module, "jax_triton_dist.shmem"):
            bad = {t for t in targets if not _in(t, "jax_triton_dist.shmem")
                   and t != "jax_triton_dist"}
            assert not bad, f"{module} imports {sorted(bad)}"


def test_language_does_not_import_the_runtime():
    for module, targets in GRAPH.items():
        if _in(module, "jax_triton_dist.language"):
            bad = {t for t in targets if _in(t, "jax_triton_dist.runtime")}
            assert not bad, f"{module} imports {sorted(bad)}"


def test_kernels_use_only_the_language_and_swizzle():
    allowed = ("jax_triton_dist.language", "jax_triton_dist.kernels", "jax_triton_dist.swizzle")
    for module, targets in GRAPH.items():
        if _in(module, "jax_triton_dist.kernels"):
            bad = {t for t in targets if not any(_in(t, a) for a in allowed)
                   and t != "jax_triton_dist"}
            assert not bad, f"{module} imports {sorted(bad)}"


def _cycle() -> list[str] | None:
    """A cycle among the package's modules (ignoring imports of a package by its own
    submodules, which name the package's __init__ only as a namespace), or None."""
    def edges(module):
        return [t for t in GRAPH[module] if not _in(module, t)]

    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in edges(module):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(GRAPH):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycles():
    assert _cycle() is None, " -> ".join(_cycle())


def test_no_module_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_an_unbuilt_source_tree_says_why_it_cannot_be_imported():
    source = pathlib.Path(__file__).resolve().parents[1]
    if list((source / "jax_triton_dist").glob("_shmem*")):
        pytest.skip("the extensions are built inside this checkout")
    result = subprocess.run([sys.executable, "-c", "import jax_triton_dist"], cwd=source,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"imported from {source / 'jax_triton_dist'}, which holds no built" in result.stderr
    assert "run from another directory" in result.stderr
