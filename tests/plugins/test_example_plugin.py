"""plugins/strata-example-plugin: installed with pip, it replaces the slot picker."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from strata.hookspecs import SlotPicker, SlotView
from strata.plugins import AUTOLOAD_OFF_ENV

PLUGIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "plugins" / "strata-example-plugin"

# One subprocess (a fresh interpreter sees the installed entry point): resolve with autoload
# on, list with `strata-tool plugins`, resolve again with the switch set.
RESOLVE_SCRIPT = """
import json, os
from click.testing import CliRunner
from strata.hookspecs import SlotView
from strata.plugins import AUTOLOAD_OFF_ENV, get_plugin_manager, resolve_choosers
from strata.tool.plugins_cmd import plugins

def resolve():
    choosers = resolve_choosers(get_plugin_manager(), config=None, spec=None, num_slots=3)
    slots = [SlotView(0, (1, 2, 3), False, 5), SlotView(1, (9,), False, 2),
             SlotView(2, (), False, 7)]
    return {"source": choosers.sources["strata_slot_picker"],
            "name": choosers.slot_picker.name,
            "pick": choosers.slot_picker.pick([1, 2, 3, 4], slots)}

on = resolve()
listing = CliRunner().invoke(plugins, []).output.splitlines()
os.environ[AUTOLOAD_OFF_ENV] = "1"
print(json.dumps({"on": on, "listing": listing, "off": resolve()}))
"""


@pytest.fixture
def example_module(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN_DIR / "src"))
    import strata_example_plugin

    return strata_example_plugin


def make_slots(*specs):
    return [SlotView(i, tuple(tokens), busy, tick) for i, (tokens, busy, tick) in enumerate(specs)]


def test_example_picker_takes_the_least_recently_used_idle_slot(example_module):
    picker = example_module.strata_slot_picker(num_slots=3)
    assert isinstance(picker, SlotPicker) and picker.name == "example-lru"
    slots = make_slots(([1, 2, 3], False, 5), ([9], False, 2), ((), True, 1), ((), False, 7))
    # The built-in would take slot 0 (prefix 3); the example takes slot 1 (tick 2).
    assert picker.pick([1, 2, 3, 4], slots) == (1, 0)
    slots = make_slots(([1, 2, 3], False, 1), ([9], False, 2))
    assert picker.pick([1, 2, 3, 4], slots) == (0, 3)
    assert picker.pick([1, 2, 3], slots) == (0, 2)
    assert picker.pick([5], make_slots(([1], False, 0), ([2], False, 0))) == (0, 0)


@pytest.mark.slow
def test_strata_slot_picker_resolves_to_the_installed_example_plugin(tmp_path):
    source = tmp_path / "src"
    # Build from a copy: an in-tree build leaves build/ and *.egg-info in the checkout.
    shutil.copytree(PLUGIN_DIR, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "--disable-pip-version-check",
                    "--target", str(target), str(source)], check=True, capture_output=True)
    assert (target / "strata_example_plugin" / "__init__.py").is_file()

    env = {k: v for k, v in os.environ.items() if k != AUTOLOAD_OFF_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(target), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run = subprocess.run([sys.executable, "-c", RESOLVE_SCRIPT], env=env, capture_output=True,
                         text=True, check=True)
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["on"] == {"source": "lru-slot-picker", "name": "example-lru", "pick": [1, 0]}
    assert f"  {'lru-slot-picker':<24} strata-example-plugin 0.1.0 (entry point group " \
           "'strata')" in result["listing"]
    assert f"  {'strata_slot_picker':<24} lru-slot-picker (strata_slot_picker): Example " \
           "plugin: always the least recently used idle slot." in result["listing"]
    assert result["off"] == {"source": "strata.builtin", "name": "longest-prefix",
                             "pick": [0, 3]}
