"""Mistakes a plugin author makes, each reported by name before the engine runs: a module that
raises at import, a hook function without @hookimpl, a chooser that returns its class."""
from __future__ import annotations

import re

import pytest
from test_plugin_manager import CONTEXT, make_distribution

from strata.errors import ConfigError
from strata.hookspecs import hookimpl
from strata.plugins import get_plugin_manager, resolve_choosers

RAISES_AT_IMPORT = """
    raise RuntimeError("no GPU driver for my policy")
"""

UNMARKED_HOOK = """
    class FirstSlot:
        name = "first-slot"

        def pick(self, prompt_tokens, slots):
            return next(s.index for s in slots if not s.is_busy), 0


    def strata_slot_picker():  # @hookimpl forgotten: pluggy alone would skip it silently
        return FirstSlot()
"""


def test_a_plugin_that_raises_at_import_is_named(tmp_path, monkeypatch):
    make_distribution(tmp_path, "strata-crash", {"crash-policy": "crash_plugin"},
                      {"crash_plugin": RAISES_AT_IMPORT})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape(
            "failed to load (entry point crash-policy = crash_plugin, from strata-crash 1.2.3): "
            "RuntimeError: no GPU driver for my policy")):
        get_plugin_manager(autoload=True)


def test_a_hook_function_without_hookimpl_is_a_config_error(tmp_path, monkeypatch):
    make_distribution(tmp_path, "strata-unmarked", {"unmarked": "unmarked_plugin"},
                      {"unmarked_plugin": UNMARKED_HOOK})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape(
            "plugin 'unmarked' defines strata_slot_picker without @hookimpl")):
        get_plugin_manager(autoload=True)


def test_a_chooser_that_returns_its_class_is_rejected_at_build():
    class Picker:  # has `name` and `pick`, so the class itself passes the Protocol check
        name = "class-not-instance"

        def pick(self, prompt_tokens, slots):
            return 0, 0

    class ReturnsClass:
        @hookimpl
        def strata_slot_picker(self):
            return Picker

    pm = get_plugin_manager(autoload=False)
    pm.register(ReturnsClass(), name="returns-class")
    with pytest.raises(ConfigError, match=re.escape(
            "plugin 'returns-class' answered strata_slot_picker with the class Picker, not an "
            "instance: return Picker()")):
        resolve_choosers(pm, **CONTEXT)
