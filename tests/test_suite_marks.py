"""The test suite's own hygiene: a ``pytest.mark`` (``skipif``, ``parametrize``...) takes effect
only on a test function or class; put on a helper (a fixture, a context manager) it does
nothing, and the test it was meant for runs where it should have been skipped. That happened
once: a CPU-feature ``skipif`` slid onto a helper when the helper was inserted above its test,
and the test failed on the first AVX2-only machine. Checked by reading every test module's
syntax tree (no import).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_mark(node: ast.expr, aliases: set[str]) -> bool:
    """``pytest.mark.X``, ``pytest.mark.X(...)``, or a module-level name bound to one."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id in aliases
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return isinstance(node, ast.Name) and [node.id, *reversed(parts)][:2] == ["pytest", "mark"]


def misplaced_marks(source: str) -> list[str]:
    """Names of the functions and classes of ``source`` that carry a mark but are not tests."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    for stmt in tree.body:  # e.g. ``needs_cuda = pytest.mark.skipif(...)``
        if isinstance(stmt, ast.Assign) and _is_mark(stmt.value, aliases):
            aliases.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            test = node.name.startswith("test")
        elif isinstance(node, ast.ClassDef):
            test = node.name.startswith("Test")
        else:
            continue
        if not test and any(_is_mark(d, aliases) for d in node.decorator_list):
            bad.append(f"{node.name} (line {node.lineno})")
    return bad


def test_the_check_sees_a_mark_on_a_helper():
    src = (
        "import contextlib, pytest\n"
        "needs = pytest.mark.skipif(True, reason='x')\n"
        "@pytest.mark.skipif(True, reason='x')\n"
        "@contextlib.contextmanager\n"
        "def helper():\n    yield\n"
        "@needs\n"
        "def other_helper():\n    pass\n"
        "@pytest.mark.parametrize('a', [1])\n"
        "def test_ok(a):\n    pass\n"
        "@pytest.fixture\n"
        "def fix():\n    return 1\n"
        "@pytest.mark.slow\n"
        "class TestGroup:\n    pass\n"
    )
    assert misplaced_marks(src) == ["helper (line 5)", "other_helper (line 8)"]


def test_no_mark_sits_on_a_helper():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50
    bad = {}
    for f in files:
        found = misplaced_marks(f.read_text())
        if found:
            bad[str(f.relative_to(TESTS))] = found
    assert not bad, f"marks on non-test functions or classes (no effect there): {bad}"
