"""The MLA kernel modules are layered: checks/layout at the bottom, backends above, the
dispatcher on top; no module imports one above its layer or another module's private name, and
each imports on its own."""

import ast
import subprocess
import sys
from pathlib import Path

import kvcore_kernels

PKG = Path(kvcore_kernels.__file__).parent
# Layer of each MLA module and of the shared modules it may use (higher may import lower).
LAYERS = {
    "errors": 0, "plan": 0, "cache": 0, "triton_util": 0, "mla_cache": 1,
    "mla_torch": 2, "mla_triton": 2, "mla": 3,
}  # fmt: skip
MLA = ("mla_cache", "mla_torch", "mla_triton", "mla")


def _imports(module: str) -> list[tuple[str, list[str]]]:
    tree = ast.parse((PKG / f"{module}.py").read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvcore_kernels."):
            found.append((node.module.split(".")[1], [a.name for a in node.names]))
    return found


def test_mla_modules_import_only_lower_layers_and_public_names():
    for module in MLA:
        for target, names in _imports(module):
            assert target in LAYERS, f"{module} imports {target}, outside the MLA layers"
            same_backend = module in ("mla_torch", "mla_triton") and target == module
            assert LAYERS[target] < LAYERS[module] or (
                LAYERS[target] == 0 and LAYERS[module] == 0
            ), f"{module} (layer {LAYERS[module]}) imports {target} (layer {LAYERS[target]})"
            assert not same_backend
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{module} imports private names {private} from {target}"


def test_each_mla_module_imports_on_its_own():
    # One fresh interpreter (torch loads once); the package is dropped before each import, so
    # every module is imported first, as it would be alone (an import cycle would fail here).
    code = (
        "import sys, importlib, torch\n"
        f"for m in {MLA!r}:\n"
        "    for k in [k for k in sys.modules if k.startswith('kvcore_kernels')]:\n"
        "        del sys.modules[k]\n"
        "    importlib.import_module('kvcore_kernels.' + m)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
