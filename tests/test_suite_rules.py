"""Rules that keep the suite from quietly shrinking: under QWEN3VL_REQUIRE_REFERENCES=1 a
skip fails unless its reason is allowed (tests/require_references.py); every test that
checks against a reference implementation carries the `parity` marker, so `make parity`
runs it; tests import library code, never a benchmark script by its path; and test names
and descriptions carry no tracker numbers."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SKIPPING = '''
import pytest

def test_unlisted():
    pytest.skip("some submodule did not import")

def test_allowed():
    pytest.skip("mounting a small tmpfs needs root")

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_to_fail():
    assert False

def test_runs():
    pass
'''


def run_suite(tmp_path, required: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "QWEN3VL_REQUIRE_REFERENCES": "1" if required else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "require_references", "-p", "no:cacheprovider",
                           str(tmp_path / "test_skipping.py")], capture_output=True, text=True, env=env, cwd=tmp_path)


def test_a_skip_off_the_allowlist_fails_when_references_are_required(tmp_path):
    done = run_suite(tmp_path, required=True)
    assert done.returncode == 1, done.stdout
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed" in done.stdout, done.stdout
    assert "skipped under QWEN3VL_REQUIRE_REFERENCES=1: some submodule did not import" in done.stdout


def test_skips_stay_skips_otherwise(tmp_path):
    done = run_suite(tmp_path, required=False)
    assert done.returncode == 0 and "1 passed, 2 skipped, 1 xfailed" in done.stdout, done.stdout


# A test (or a fixture or helper of its module it uses) that touches one of these checks
# against a reference implementation.
REFERENCE = re.compile(r"""importorskip\(["'](torch|transformers|mlx|mlx_vlm)|\b(import|from) (torch|transformers|"""
                       r"""mlx|mlx_vlm|torch_reference)\b|\bmx\.|\btorch\.|\btransformers\.""")


def unmarked_parity_tests(path: Path) -> list[str]:
    """`path`'s test functions that use a reference implementation without the parity marker."""
    source = path.read_text()
    tree = ast.parse(source)
    if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
           and "parity" in ast.get_source_segment(source, n) for n in tree.body):
        return []
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    found = []
    for name, node in functions.items():
        if not name.startswith("test"):
            continue
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {a.arg for a in node.args.args}
        text = "".join(ast.get_source_segment(source, functions[n]) for n in used | {name} if n in functions)
        marked = any("parity" in ast.get_source_segment(source, d) for d in node.decorator_list)
        if REFERENCE.search(text) and not marked:
            found.append(f"{path.name}::{name}")
    return found


def test_every_check_against_a_reference_is_marked_parity():
    paths = [p for p in sorted(TESTS.glob("test_*.py")) if p.name != Path(__file__).name]  # its examples are text
    assert [t for path in paths for t in unmarked_parity_tests(path)] == []


def test_the_marker_check_sees_an_unmarked_reference_test(tmp_path):
    (tmp_path / "test_x.py").write_text("import pytest\n\ndef test_a():\n    torch = pytest.importorskip('torch')\n\n"
                                        "@pytest.mark.parity\ndef test_b():\n    import transformers\n")
    assert unmarked_parity_tests(tmp_path / "test_x.py") == ["test_x.py::test_a"]


def test_no_test_loads_a_script_by_its_path():
    loading = [p.name for p in TESTS.glob("test_*.py")
               if p.name != Path(__file__).name and "spec_from_file_location" in p.read_text()]
    assert loading == []


def test_no_tracker_numbers_in_test_names_or_descriptions():
    tracker = re.compile(r"\b(issue|bug|ticket)[ #_]?\d+", re.I)
    found = [f"{p.name}:{n}" for p in sorted(TESTS.glob("*.py")) if p.name != Path(__file__).name
             for n, line in enumerate(p.read_text().splitlines(), 1) if tracker.search(line)]
    assert found == []
