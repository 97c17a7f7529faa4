"""The plugin manager: built-in defaults (registered trylast) plus plugins from the `strata`
entry-point group, and the chooser objects the engine resolves once when it is built.
"""
from __future__ import annotations

import difflib
import importlib.metadata
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import pluggy

from strata import hookspecs
from strata.errors import ConfigError
from strata.hookspecs import (CHOOSER_HOOKS, CHOOSER_INTERFACES, OBSERVER_HOOKS, KVGrow,
                              ReadInterleave, SlotPicker, TierPolicy, hookimpl)

ENTRY_POINT_GROUP = "strata"
AUTOLOAD_OFF_ENV = "STRATA_DISABLE_PLUGIN_AUTOLOAD"
BUILTIN_PLUGIN_NAME = "strata.builtin"

log = logging.getLogger("strata.plugins")


class BuiltinDefaults:
    """Strata's own policies, registered trylast so that any installed plugin overrides them."""

    @hookimpl(trylast=True)
    def strata_slot_picker(self):
        """Longest cached prefix, else an empty slot, else the least recently used."""
        from strata.engine.slots import LongestPrefixPicker

        return LongestPrefixPicker()

    @hookimpl(trylast=True)
    def strata_read_interleave(self, config):
        """Decoding slots keep >= half their solo rate; short prompts go first."""
        from strata.engine.interleave import HalfRateInterleave

        chunk = getattr(config, "prompt_chunk_tokens", None)
        if chunk is None:
            return HalfRateInterleave()
        solo = getattr(config, "solo_chunk_tokens", None)  # resolved by the engine: an int
        return HalfRateInterleave(chunk, solo_chunk_tokens=solo if isinstance(solo, int)
                                  else None)

    @hookimpl(trylast=True)
    def strata_tier_policy(self, config):
        """Decayed routing counts per (layer, expert): free slots first, then the best swaps.
        (On the default model's real routing trace it beats `window-score`, which does better on
        synth traces: docs/tier.md.)"""
        from strata.experts.tier import DecayedCountTier

        return DecayedCountTier(getattr(config, "expert_cache_slots", None),
                                max_swaps=getattr(config, "adapt_swaps", None) or 64)

    @hookimpl(trylast=True)
    def strata_kv_grow(self):
        """Lends the run of expert-cache slots the tier values least; refills with the best."""
        from strata.experts.kv_grow import LeastValuedKVGrow

        return LeastValuedKVGrow()


def is_autoload_disabled() -> bool:
    """True when STRATA_DISABLE_PLUGIN_AUTOLOAD is set to anything but "" or "0"."""
    return os.environ.get(AUTOLOAD_OFF_ENV, "") not in ("", "0")


def get_plugin_manager(autoload: bool | None = None) -> pluggy.PluginManager:
    """A new plugin manager with the hookspecs, the built-in defaults and (unless `autoload` is
    False, or None and the environment switch is set) the plugins of the `strata` entry-point
    group."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(BuiltinDefaults(), name=BUILTIN_PLUGIN_NAME)
    if autoload is None:
        autoload = not is_autoload_disabled()
    if autoload:
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except Exception as exc:
            raise ConfigError(
                f"a plugin in the {ENTRY_POINT_GROUP!r} entry-point group failed to load"
                f"{_failed_entry_point(pm, exc)}: {type(exc).__name__}: {exc}; fix or uninstall "
                f"it, or set {AUTOLOAD_OFF_ENV}=1 to start without plugins") from exc
        check_hook_names(pm)
    return pm


def _failed_entry_point(pm: pluggy.PluginManager, exc: Exception) -> str:
    """' (entry point NAME = VALUE, from DIST VERSION)' for the entry point pluggy stopped at:
    it loads them in this order and registers each before the next, so the first one not
    registered (a PluginValidationError names its plugin itself: '')."""
    if isinstance(exc, pluggy.PluginValidationError):
        return ""
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if (ep.group == ENTRY_POINT_GROUP and not pm.has_plugin(ep.name)
                    and not pm.is_blocked(ep.name)):
                return (f" (entry point {ep.name} = {ep.value}, from {dist.metadata['Name']} "
                        f"{dist.version})")
    return ""


def check_hook_names(pm: pluggy.PluginManager) -> None:
    """ConfigError naming the plugin when one implements a hook that has no spec (a misspelled
    name would otherwise never be called; optional hooks are left alone), or defines a hook's
    function without the @hookimpl marker."""
    known = sorted(CHOOSER_HOOKS + OBSERVER_HOOKS)
    for plugin_name, plugin in pm.list_name_plugin():
        for hook_name in known:  # pluggy skips an unmarked function without a word
            if (callable(getattr(plugin, hook_name, None))
                    and pm.parse_hookimpl_opts(plugin, hook_name) is None):
                raise ConfigError(
                    f"plugin {plugin_name!r} defines {hook_name} without @hookimpl (from "
                    "strata.hookspecs import hookimpl), so it is never called; fix or "
                    "uninstall the plugin")
    for hook_name, hook in vars(pm.hook).items():
        if hook_name.startswith("_") or hook.has_spec():
            continue
        for impl in hook.get_hookimpls():
            if impl.optionalhook:
                continue
            close = difflib.get_close_matches(hook_name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"plugin {impl.plugin_name!r} implements {hook_name!r}, which is not a Strata "
                f"hook ({hint}the hooks: {', '.join(known)}); fix or uninstall the plugin")


@dataclass
class Choosers:
    """The policy objects the engine calls, resolved once; `sources` names the plugin that
    answered each chooser hook (None: nobody did)."""

    slot_picker: SlotPicker
    read_interleave: ReadInterleave
    tier_policy: TierPolicy | None
    kv_grow: KVGrow | None
    sources: dict[str, str | None] = field(default_factory=dict)
    # the built-in read interleave, which the engine uses for a plan the plugin's gets wrong
    fallback_read_interleave: ReadInterleave | None = None
    _window_done: tuple = field(default=(), repr=False)  # (plugin name, call) per observer
    _request_done: tuple = field(default=(), repr=False)
    _failed_observers: set = field(default_factory=set, repr=False)

    def window_done(self, stats) -> None:
        """Tell the observers a window ended (no pluggy dispatch per window)."""
        self._notify("strata_window_done", self._window_done, stats)

    def request_done(self, stats) -> None:
        self._notify("strata_request_done", self._request_done, stats)

    def _notify(self, hook_name: str, observers: tuple, stats) -> None:
        """Call every observer; one that raises is logged and the others still run: an
        observer never fails a window or a request."""
        for plugin_name, notify in observers:
            try:
                notify(stats=stats)
            except Exception:  # noqa: BLE001 - a faulty observer plugin is only logged
                key = (plugin_name, hook_name)
                if key in self._failed_observers:
                    log.debug("plugin %r failed in %s again", plugin_name, hook_name,
                              exc_info=True)
                    continue
                self._failed_observers.add(key)
                log.exception("plugin %r failed in %s; the engine goes on (its later failures "
                              "are logged at DEBUG): fix or uninstall the plugin", plugin_name,
                              hook_name)


def resolve_choosers(pm: pluggy.PluginManager, **engine_context: Any) -> Choosers:
    """Call each chooser hook once with the engine context (config, spec, num_slots; extra keys
    are ignored) and check each answer implements its interface."""
    check_hook_names(pm)
    resolved: dict[str, Any] = {}
    sources: dict[str, str | None] = {}
    for hook_name in CHOOSER_HOOKS:
        result, source = _first_answer(pm, hook_name, engine_context)
        interface = CHOOSER_INTERFACES[hook_name]
        if isinstance(result, type):  # a class passes the Protocol check; its methods are unbound
            raise ConfigError(
                f"plugin {source!r} answered {hook_name} with the class {result.__name__}, not "
                f"an instance: return {result.__name__}(); fix or uninstall the plugin")
        if result is not None and not isinstance(result, interface):
            raise ConfigError(
                f"plugin {source!r} answered {hook_name} with {type(result).__name__}, which "
                f"does not implement {interface.__name__} (see docs/plugins.md); fix or "
                "uninstall the plugin")
        resolved[hook_name] = result
        sources[hook_name] = source
    for hook_name in ("strata_slot_picker", "strata_read_interleave"):
        if resolved[hook_name] is None:
            raise ConfigError(f"no plugin answered {hook_name}, not even the built-in default; "
                              f"a plugin must not unregister {BUILTIN_PLUGIN_NAME!r}")
    observers = {name: _observer_calls(pm, name) for name in OBSERVER_HOOKS}
    fallback = resolved["strata_read_interleave"]
    if sources["strata_read_interleave"] != BUILTIN_PLUGIN_NAME:
        fallback = BuiltinDefaults().strata_read_interleave(engine_context.get("config"))
    return Choosers(resolved["strata_slot_picker"], resolved["strata_read_interleave"],
                    resolved["strata_tier_policy"], resolved["strata_kv_grow"], sources,
                    fallback, observers["strata_window_done"],
                    observers["strata_request_done"])


def implementations_in_call_order(pm: pluggy.PluginManager, hook_name: str) -> list:
    """The hook's implementations in the order pluggy calls them (tryfirst first, trylast last,
    later registrations before earlier ones)."""
    return list(reversed(getattr(pm.hook, hook_name).get_hookimpls()))


def _first_answer(pm: pluggy.PluginManager, hook_name: str,
                  context: dict[str, Any]) -> tuple[Any, str | None]:
    """pluggy's firstresult call, done by hand to learn which plugin answered."""
    hook = getattr(pm.hook, hook_name)
    missing = [a for a in hook.spec.argnames if a not in context]
    if missing:
        raise TypeError(f"resolve_choosers() needs the engine context {missing} for {hook_name}")
    impls = implementations_in_call_order(pm, hook_name)
    if any(impl.hookwrapper or impl.wrapper for impl in impls):
        # A wrapper may change the result: let pluggy run the whole chain; the source is unknown.
        args = {a: context[a] for a in hook.spec.argnames}
        return _called(hook_name, "(wrapped)", hook, args), "(wrapped)"
    for impl in impls:
        result = _called(hook_name, impl.plugin_name, impl.function,
                         {a: context[a] for a in impl.argnames})
        if result is not None:
            return result, impl.plugin_name
    return None, None


def _called(hook_name: str, plugin_name: str, function, args: dict[str, Any]) -> Any:
    """A chooser hook's answer; ConfigError naming the plugin when it raises (the built-ins'
    ConfigErrors, about an option, go through as they are)."""
    try:
        return function(**args)
    except Exception as exc:
        if plugin_name == BUILTIN_PLUGIN_NAME and isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"plugin {plugin_name!r} failed in {hook_name}: "
                          f"{type(exc).__name__}: {exc}; fix or uninstall the plugin") from exc


def _observer_calls(pm: pluggy.PluginManager, hook_name: str) -> tuple:
    impls = implementations_in_call_order(pm, hook_name)
    if any(impl.hookwrapper or impl.wrapper for impl in impls):
        return (("(wrapped)", getattr(pm.hook, hook_name)),)
    return tuple((impl.plugin_name, _bind_stats(impl.function, impl.argnames))
                 for impl in impls)


def _bind_stats(function, argnames):
    # An observer may declare fewer arguments than the spec (pluggy allows it).
    if "stats" in argnames:
        return function

    def call(stats):
        return function()

    return call


def describe_hooks(pm: pluggy.PluginManager) -> list[tuple[str, str]]:
    """(hook name, what it resolves to) for `strata-tool plugins`, without calling any hook:
    a chooser resolves to its first implementation in call order (unless that one returns None
    at engine build), an observer to all of them."""
    lines = []
    for hook_name in CHOOSER_HOOKS + OBSERVER_HOOKS:
        impls = implementations_in_call_order(pm, hook_name)
        if not impls:
            lines.append((hook_name, "none"))
        elif hook_name in CHOOSER_HOOKS:
            lines.append((hook_name, _describe_impl(impls[0])))
        else:
            lines.append((hook_name, "; ".join(_describe_impl(i) for i in impls)))
    return lines


def _describe_impl(impl) -> str:
    doc = (impl.function.__doc__ or "").strip().splitlines()
    summary = f": {doc[0].strip()}" if doc else ""
    return f"{impl.plugin_name} ({impl.function.__qualname__}){summary}"


def describe_plugins(pm: pluggy.PluginManager) -> list[tuple[str, str]]:
    """(plugin name, where it comes from) for every registered plugin."""
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    lines = []
    for name, plugin in pm.list_name_plugin():
        if name == BUILTIN_PLUGIN_NAME:
            origin = "built in"
        elif id(plugin) in dists:
            dist = dists[id(plugin)]
            origin = f"{dist.project_name} {dist.version} (entry point group {ENTRY_POINT_GROUP!r})"
        else:
            origin = "registered at run time"
        lines.append((name, origin))
    return lines
