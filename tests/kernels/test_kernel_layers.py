"""Every module of kvcore_kernels sits in one layer (docs/kernels.md, "Package layers"): it
imports only modules of lower layers (or, in the layout and shared-part layers, of its own,
without a cycle), never another module's private name, and it imports on its own."""

import ast
import subprocess
import sys
from pathlib import Path

import kvcore_kernels

PKG = Path(kvcore_kernels.__file__).parent
# Higher may import lower. 0 base, 1 layouts and checks, 2 kernel parts shared across layouts,
# 3 backends (one layout, one of torch / Triton), 4 per-layout dispatchers, 5 entry points that
# pick the layout's variant, 6 package namespaces.
LAYERS = {
    "errors": 0, "device": 0, "triton_util": 0,
    "cache": 1, "plan": 1, "checks": 1, "mla.cache": 1, "quant.formats": 1, "quant.codecs": 1,
    "quant.residual": 1, "quant.cache": 1, "quant.checks": 1,
    "schedule": 2, "splits_triton": 2, "chunks_torch": 2, "paged_triton": 2, "quant.load_triton": 2,
    "quant.encode_triton": 2, "quant.read_torch": 2, "softmax_triton": 2, "cpu_native": 2,
    "attention_torch": 3, "attention_triton": 3, "store_torch": 3, "store_triton": 3,
    "mla.attention_torch": 3, "mla.attention_triton": 3, "quant.attention_torch": 3,
    "quant.attention_triton": 3,
    "quant.store_torch": 3, "quant.store_triton": 3, "quant.kivi_triton": 3,
    "attention_cpu": 3, "quant.attention_cpu": 3,
    "mla.attention": 4, "quant.attention": 4, "quant.store": 4, "quant.blocks": 4,
    "attention": 5, "store": 5, "ops_cpu": 5, "linear_cpu": 5,
    "step_calls": 6,
    "__init__": 7, "quant.__init__": 7, "mla.__init__": 7,
}  # fmt: skip
SAME_LAYER_OK = (0, 1, 2)  # backends never import backends, dispatchers never dispatchers


def _modules() -> list[str]:
    return sorted(
        str(p.relative_to(PKG).with_suffix("")).replace("/", ".") for p in PKG.rglob("*.py")
    )


def _imports(module: str) -> list[tuple[str, list[str]]]:
    """(target module, imported names) of every package import, lazy (in-function) ones too."""
    tree = ast.parse((PKG / (module.replace(".", "/") + ".py")).read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvcore_kernels"):
            target = node.module.removeprefix("kvcore_kernels").lstrip(".")
            names = [a.name for a in node.names]
            if (PKG / target.replace(".", "/") / "__init__.py").exists() or not target:
                # `from kvcore_kernels[.quant] import x`: a submodule if there is one, else the
                # package namespace itself.
                pkg = target + "." if target else ""
                for n in names:
                    sub = pkg + n
                    found.append((sub, []) if sub in LAYERS else (pkg + "__init__", [n]))
            else:
                found.append((target, names))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kvcore_kernels"):
                    target = a.name.removeprefix("kvcore_kernels").lstrip(".") or "__init__"
                    found.append((target, []))
    return found


def test_layer_table_covers_every_module():
    assert set(_modules()) == set(LAYERS)


def test_no_module_imports_upward_or_private_names():
    graph: dict[str, set[str]] = {}
    for module in _modules():
        graph[module] = set()
        for target, names in _imports(module):
            assert target in LAYERS, f"{module} imports unknown module {target}"
            lo, hi = LAYERS[target], LAYERS[module]
            assert lo < hi or (lo == hi and hi in SAME_LAYER_OK), (
                f"{module} (layer {hi}) imports {target} (layer {lo})"
            )
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{module} imports private names {private} from {target}"
            if lo == hi:
                graph[module].add(target)
    # Same-layer imports form no cycle (depth-first search for a back edge).
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in graph.get(m, ()):
            assert state.get(t) != 1, f"import cycle: {' -> '.join([*path, m, t])}"
            if t not in state:
                visit(t, [*path, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_each_module_imports_on_its_own():
    # One fresh interpreter (torch and triton load once). Before each import the package is
    # dropped from sys.modules and its namespaces replaced by empty ones (no __init__ run), so a
    # module gets only what it imports itself: a module that works only after another one was
    # imported, or an import cycle, fails here. The namespaces' own __init__ run last, for real.
    mods = _modules()
    namespaces = ["__init__", "quant.__init__", "mla.__init__"]
    names = [m for m in mods if not m.endswith("__init__")] + namespaces
    code = (
        "import importlib, sys, types, torch, triton\n"
        f"pkg = {str(PKG)!r}\n"
        f"for m in {names!r}:\n"
        "    for k in [k for k in sys.modules if k.startswith('kvcore_kernels')]:\n"
        "        del sys.modules[k]\n"
        "    if not m.endswith('__init__'):\n"
        "        for ns, sub in (('kvcore_kernels', ''), ('kvcore_kernels.quant', '/quant'),\n"
        "                        ('kvcore_kernels.mla', '/mla')):\n"
        "            sys.modules[ns] = types.ModuleType(ns)\n"
        "            sys.modules[ns].__path__ = [pkg + sub]\n"
        "    importlib.import_module(('kvcore_kernels.' + m).removesuffix('.__init__'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_every_kv_loop_takes_the_same_arguments():
    # paged_triton's kernel calls each layout's KV_LOOP with KV_LOOP_ARGS, positionally.
    import inspect

    from kvcore_kernels.attention_triton import plain_kv_loop
    from kvcore_kernels.paged_triton import KV_LOOP_ARGS
    from kvcore_kernels.quant.attention_triton import quant_kv_loop

    for loop in (plain_kv_loop, quant_kv_loop):
        assert tuple(inspect.signature(loop.fn).parameters) == KV_LOOP_ARGS, loop.fn.__name__
