"""Meta-test: every hookspec has a test in tests/plugins and a section in docs/plugins.md."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

from strata import hookspecs
from strata.hookspecs import CHOOSER_HOOKS, OBSERVER_HOOKS

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "plugins.md"


def hookspec_names() -> list[str]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return sorted(name for name, value in vars(hookspecs).items()
                  if name.startswith("strata_") and hasattr(value, marker))


def plugin_test_names() -> set[str]:
    names = set()
    for path in pathlib.Path(__file__).parent.glob("test_*.py"):
        if path.name == pathlib.Path(__file__).name:
            continue  # this file names every hook; it must not count as their test
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.add(node.name)
    return names


def test_the_hook_lists_match_the_specs():
    assert hookspec_names() == sorted(CHOOSER_HOOKS + OBSERVER_HOOKS)
    assert len(hookspec_names()) == 6


@pytest.mark.parametrize("hook_name", hookspec_names())
def test_every_hook_has_a_test(hook_name):
    tests = [name for name in plugin_test_names() if hook_name in name]
    assert tests, f"no test in tests/plugins has {hook_name!r} in its name"


@pytest.mark.parametrize("hook_name", hookspec_names())
def test_every_hook_has_a_documentation_section(hook_name):
    sections = re.findall(r"^## `?(strata_\w+)`?", DOC.read_text(), flags=re.MULTILINE)
    assert hook_name in sections, f"docs/plugins.md has no '## {hook_name}' section"


def test_every_documented_hook_exists():
    sections = re.findall(r"^## `?(strata_\w+)`?", DOC.read_text(), flags=re.MULTILINE)
    assert sorted(sections) == hookspec_names()


@pytest.mark.parametrize("hook_name", hookspec_names())
def test_every_hookspec_documents_when_and_what(hook_name):
    doc = " ".join((getattr(hookspecs, hook_name).__doc__ or "").split())
    assert "Called" in doc and ("first non-None result wins" in doc
                                or "Every implementation is called" in doc)
