"""The plugin manager: entry-point autoload and its switch, checks on answers, the listing."""
from __future__ import annotations

import re
import textwrap

import pytest
from click.testing import CliRunner

from strata.engine.slots import LongestPrefixPicker
from strata.errors import ConfigError
from strata.hookspecs import hookimpl
from strata.plugins import (AUTOLOAD_OFF_ENV, BUILTIN_PLUGIN_NAME, describe_hooks,
                            describe_plugins, get_plugin_manager, implementations_in_call_order,
                            is_autoload_disabled, resolve_choosers)
from strata.tool.plugins_cmd import plugins as plugins_command

CONTEXT = dict(config=None, spec=None, num_slots=2)


def make_distribution(root, dist_name: str, entry_points: dict[str, str],
                      modules: dict[str, str]):
    """An installed distribution on disk: a .dist-info with entry points, plus its modules."""
    info = root / f"{dist_name.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 1.2.3\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[strata]\n{lines}")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


PLUGIN_SOURCE = """
    from strata.hookspecs import hookimpl


    class FirstSlot:
        name = "first-slot"

        def pick(self, prompt_tokens, slots):
            return next(s.index for s in slots if not s.is_busy), 0


    @hookimpl
    def strata_slot_picker():
        '''Test plugin: always the first idle slot.'''
        return FirstSlot()
"""


@pytest.mark.parametrize("value, is_disabled", [(None, False), ("", False), ("0", False),
                                                ("1", True), ("yes", True)])
def test_autoload_switch(monkeypatch, value, is_disabled):
    if value is None:
        monkeypatch.delenv(AUTOLOAD_OFF_ENV, raising=False)
    else:
        monkeypatch.setenv(AUTOLOAD_OFF_ENV, value)
    assert is_autoload_disabled() is is_disabled


def test_entry_point_plugins_load_unless_switched_off(tmp_path, monkeypatch):
    make_distribution(tmp_path, "strata-first-slot", {"first-slot": "first_slot_plugin"},
                      {"first_slot_plugin": PLUGIN_SOURCE})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(AUTOLOAD_OFF_ENV, "1")
    off = get_plugin_manager()
    assert [name for name, _ in describe_plugins(off)] == [BUILTIN_PLUGIN_NAME]
    monkeypatch.delenv(AUTOLOAD_OFF_ENV)
    pm = get_plugin_manager()
    assert describe_plugins(pm) == [
        (BUILTIN_PLUGIN_NAME, "built in"),
        ("first-slot", "strata-first-slot 1.2.3 (entry point group 'strata')")]
    choosers = resolve_choosers(pm, **CONTEXT)
    assert choosers.slot_picker.name == "first-slot"
    assert choosers.sources["strata_slot_picker"] == "first-slot"
    assert get_plugin_manager(autoload=False).get_plugin("first-slot") is None


def test_a_broken_entry_point_is_a_config_error_naming_the_switch(tmp_path, monkeypatch):
    make_distribution(tmp_path, "strata-broken", {"broken": "no_such_module_xyz"}, {})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=f"{AUTOLOAD_OFF_ENV}=1") as info:
        get_plugin_manager(autoload=True)
    assert "no_such_module_xyz" in str(info.value)


def test_an_answer_that_misses_the_interface_is_rejected():
    class Wrong:
        @hookimpl
        def strata_slot_picker(self):
            return object()

    pm = get_plugin_manager(autoload=False)
    pm.register(Wrong(), name="wrong")
    with pytest.raises(ConfigError, match="'wrong' answered strata_slot_picker with object, "
                                          "which does not implement SlotPicker"):
        resolve_choosers(pm, **CONTEXT)


MISSPELLED_SOURCE = """
    from strata.hookspecs import hookimpl


    @hookimpl
    def strata_slot_piker():
        return None
"""


def test_a_misspelled_hook_is_a_config_error_naming_the_plugin(tmp_path, monkeypatch):
    make_distribution(tmp_path, "strata-typo", {"typo": "typo_plugin"},
                      {"typo_plugin": MISSPELLED_SOURCE})
    monkeypatch.syspath_prepend(str(tmp_path))
    message = ("plugin 'typo' implements 'strata_slot_piker', which is not a Strata hook (did "
               "you mean 'strata_slot_picker'?")
    with pytest.raises(ConfigError, match=re.escape(message)):
        get_plugin_manager(autoload=True)

    class RegisteredLater:  # after the manager was built: found when the engine resolves
        @hookimpl
        def strata_windows_done(self, stats):
            pass

    pm = get_plugin_manager(autoload=False)
    pm.register(RegisteredLater(), name="later")
    with pytest.raises(ConfigError, match=re.escape(
            "plugin 'later' implements 'strata_windows_done', which is not a Strata hook (did "
            "you mean 'strata_window_done'?")):
        resolve_choosers(pm, **CONTEXT)


def test_a_chooser_hook_that_raises_is_a_config_error_naming_the_plugin():
    class Raises:
        @hookimpl
        def strata_tier_policy(self, config):
            raise KeyError("expert_cache_slots")

    pm = get_plugin_manager(autoload=False)
    pm.register(Raises(), name="raises")
    with pytest.raises(ConfigError, match=re.escape(
            "plugin 'raises' failed in strata_tier_policy: KeyError: 'expert_cache_slots'; fix "
            "or uninstall the plugin")):
        resolve_choosers(pm, **CONTEXT)


def test_missing_engine_context_is_named():
    with pytest.raises(TypeError, match=r"\['num_slots'\]"):
        resolve_choosers(get_plugin_manager(autoload=False), config=None, spec=None)


def test_extra_engine_context_is_ignored():
    choosers = resolve_choosers(get_plugin_manager(autoload=False), **CONTEXT, device="cpu")
    assert type(choosers.slot_picker) is LongestPrefixPicker


def test_without_the_builtin_defaults_resolution_fails_clearly():
    pm = get_plugin_manager(autoload=False)
    pm.unregister(name=BUILTIN_PLUGIN_NAME)
    with pytest.raises(ConfigError, match="no plugin answered strata_slot_picker"):
        resolve_choosers(pm, **CONTEXT)


def test_call_order_puts_tryfirst_first_and_builtin_last():
    class Late:
        @hookimpl
        def strata_slot_picker(self):
            return None

    class Early:
        @hookimpl(tryfirst=True)
        def strata_slot_picker(self):
            return None

    pm = get_plugin_manager(autoload=False)
    pm.register(Early(), name="early")
    pm.register(Late(), name="late")
    names = [i.plugin_name for i in implementations_in_call_order(pm, "strata_slot_picker")]
    assert names == ["early", "late", BUILTIN_PLUGIN_NAME]


def test_listing_names_each_hooks_resolution():
    pm = get_plugin_manager(autoload=False)
    assert describe_hooks(pm) == [
        ("strata_slot_picker", "strata.builtin (BuiltinDefaults.strata_slot_picker): Longest "
                               "cached prefix, else an empty slot, else the least recently used."),
        ("strata_read_interleave", "strata.builtin (BuiltinDefaults.strata_read_interleave): "
                                   "Decoding slots keep >= half their solo rate; short prompts "
                                   "go first."),
        ("strata_tier_policy", "strata.builtin (BuiltinDefaults.strata_tier_policy): Decayed "
                               "routing counts per (layer, expert): free slots first, then the "
                               "best swaps."),
        ("strata_kv_grow", "strata.builtin (BuiltinDefaults.strata_kv_grow): Lends the run of "
                           "expert-cache slots the tier values least; refills with the best."),
        ("strata_window_done", "none"),
        ("strata_request_done", "none"),
    ]


def test_plugins_command_lists_plugins_and_hooks(tmp_path, monkeypatch):
    make_distribution(tmp_path, "strata-first-slot", {"first-slot": "first_slot_plugin2"},
                      {"first_slot_plugin2": PLUGIN_SOURCE})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(AUTOLOAD_OFF_ENV)
    result = CliRunner().invoke(plugins_command, [])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[:3] == ["plugins:", f"  {'strata.builtin':<24} built in",
                         f"  {'first-slot':<24} strata-first-slot 1.2.3 (entry point group "
                         "'strata')"]
    assert f"  {'strata_slot_picker':<24} first-slot (strata_slot_picker): Test plugin: always " \
           "the first idle slot." in lines
    assert f"  {'strata_kv_grow':<24} strata.builtin (BuiltinDefaults.strata_kv_grow): Lends " \
           "the run of expert-cache slots the tier values least; refills with the best." in lines
    off = CliRunner().invoke(plugins_command, ["--no-autoload"])
    assert "first-slot" not in off.output and "strata.builtin (BuiltinDefaults" in off.output


def test_plugins_command_reports_a_broken_plugin(tmp_path, monkeypatch):
    make_distribution(tmp_path, "strata-broken", {"broken": "no_such_module_abc"}, {})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(AUTOLOAD_OFF_ENV)
    result = CliRunner().invoke(plugins_command, [])
    assert result.exit_code == 2
    assert "error: a plugin in the 'strata' entry-point group failed to load" in result.output
