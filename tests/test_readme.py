"""What README.md and the docs tell users, checked against the code: every option they name
exists where they say, the defaults they state are the commands' defaults, the files, shapes
and subcommands they name exist. (The README's client examples run in
tests/server/test_readme_examples.py.)"""
from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from strata.cli import main as strata_main
from strata.tool.cli import main as tool_main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# the user-facing pages; offload.md and tier.md are measurement logs, cuda.md and DEVELOPING.md
# name profilers' and pip's options too
USER_DOCS = ("expert-cache.md", "plugins.md", "conversations.md", "drafts.md", "qwen3next.md")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")
OTHER_FLAGS = {"--help", "--dist", "--maxprocesses", "--durations",  # click, pytest
               "--index-url",  # pip
               "--kv-unified"}  # llama-server's, named where its -c differs


def options_of(command: click.Command) -> set[str]:
    names = set()
    for param in command.params:
        names.update(n for n in param.opts + param.secondary_opts if n.startswith("--"))
    return names


def strata_options(name: str) -> set[str]:
    return options_of(strata_main.commands[name])


def all_command_options() -> set[str]:
    names = set()
    for group in (strata_main, tool_main):
        for command in group.commands.values():
            names |= options_of(command)
    return names


def tools_script_options() -> set[str]:
    """The options the developer scripts under tools/ define (argparse strings)."""
    names = set()
    for path in (ROOT / "tools").iterdir():
        if path.suffix in (".py", ".sh"):
            names.update(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", path.read_text()))
    return names


@pytest.mark.parametrize("page", ("README.md",) + USER_DOCS)
def test_every_option_named_exists(page):
    text = README if page == "README.md" else (ROOT / "docs" / page).read_text()
    known = all_command_options() | tools_script_options() | OTHER_FLAGS
    unknown = sorted(set(FLAG.findall(text)) - known)
    assert not unknown, f"{page} names options no command or tools/ script has: {unknown}"


# The README's "(run, serve, bench)" style claims: which commands take an option.
COMMANDS_OF = {
    "--device": ("run", "serve", "bench"),
    "--no-mmap": ("run", "serve", "bench"),
    "--kv": ("run", "serve", "bench"),
    "--expert-cache": ("run", "serve", "bench"),
    "--expert-profile": ("run", "serve", "bench"),
    "--ctx-checkpoints": ("run", "serve"),
    "--spec-type": ("run", "serve"),
    "--draft-max": ("run", "serve"),
    "--draft-min": ("run", "serve"),
    "--spec-ngram-size-n": ("run", "serve"),
    "--grammar": ("run",),
    "--grammar-file": ("run",),
    "--split-device": ("run", "serve", "bench"),
    "--layer-split": ("run", "serve", "bench"),
    "--batch-groups": ("run", "serve", "bench"),
    "--parallel": ("run", "serve", "bench"),
    "--json": ("bench",),
    "--n-depth": ("bench",),
    "--api-key": ("serve",),
    "--alias": ("serve",),
    "--reasoning-budget": ("serve",),
    "--slot-save-path": ("serve",),
    "--no-slots": ("serve",),
    "--conversation-cache-dir": ("run", "serve"),
}


@pytest.mark.parametrize("flag,commands", sorted(COMMANDS_OF.items()))
def test_options_are_on_the_commands_the_readme_says(flag, commands):
    assert flag in FLAG.findall(README), f"README no longer names {flag}: update COMMANDS_OF"
    for name in commands:
        assert flag in strata_options(name), f"strata {name} has no {flag}"


def default_of(command: str, flag: str):
    for param in strata_main.commands[command].params:
        if flag in param.opts or flag in param.secondary_opts:
            return param.default
    raise KeyError(flag)


@pytest.mark.parametrize("flag,stated", [
    ("--spec-ngram-size-n", 12), ("--draft-max", 16), ("--draft-min", 0),
    ("--ctx-checkpoints", 8), ("--cache-ram", 8192), ("--conversation-cache-disk-mib", 65536),
    ("--adapt-every", 4), ("--adapt-async", 1), ("--adapt-min-gain", 0), ("--read-chunk", "auto"),
    ("--device", "auto"), ("--kv", "auto"), ("--parallel", 1), ("--spec-type", "none")])
def test_stated_defaults(flag, stated):
    """The defaults README.md, docs/drafts.md and docs/expert-cache.md give."""
    for command in ("run", "serve"):
        assert default_of(command, flag) == stated, (command, flag)


def test_serve_defaults():
    assert default_of("serve", "--host") == "127.0.0.1"  # "127.0.0.1 only"
    assert default_of("serve", "--port") == 8080  # the examples' base_url
    assert default_of("serve", "--reasoning-budget") == -1


def test_bench_defaults_are_llama_bench_s():
    assert (default_of("bench", "--n-prompt"), default_of("bench", "--n-gen"),
            default_of("bench", "--repetitions")) == (512, 128, 5)


def test_synth_shapes_listed():
    from strata.tool.presets import PRESETS

    listed = re.search(r"`--list` shows the\s+shapes \(([^)]*)\)", README).group(1)
    assert [s.strip() for s in listed.replace("\n", " ").split(",")] == list(PRESETS)


def test_strata_tool_subcommands_exist():
    named = set(re.findall(r"`strata-tool ([a-z][a-z-]*)", README))
    named |= set(re.findall(r"^strata-tool ([a-z][a-z-]*)", README, re.M))
    assert named <= set(tool_main.commands), sorted(named - set(tool_main.commands))
    assert set(tool_main.commands) <= named, "a strata-tool subcommand the README never names"


def test_builtin_policy_names_in_plugins_doc():
    from strata.engine.interleave import HalfRateInterleave
    from strata.engine.slots import LongestPrefixPicker
    from strata.experts.kv_grow import LeastValuedKVGrow
    from strata.experts.tier import DecayedCountTier

    text = (ROOT / "docs" / "plugins.md").read_text()
    for cls in (LongestPrefixPicker, HalfRateInterleave, DecayedCountTier, LeastValuedKVGrow):
        assert f"`{cls.__name__}`" in text and f"{cls.name}" in text, cls


def test_cache_folders():
    """README: --expert-profile auto and --conversation-cache-dir auto use `profiles/` and
    `conversations/` of $STRATA_CACHE_DIR (else $XDG_CACHE_HOME/strata, else ~/.cache/strata)."""
    import os

    from strata.config import EngineConfig
    from strata.data import default_model_path
    from strata.experts.profile import stored_profile_path

    saved = os.environ.get("STRATA_CACHE_DIR")
    os.environ["STRATA_CACHE_DIR"] = "/nonexistent-strata-cache"
    try:
        assert stored_profile_path(default_model_path()).parent == Path(
            "/nonexistent-strata-cache/profiles")
        config = EngineConfig(default_model_path(), conversation_cache_dir="auto")
        assert config.resolve_conversation_dir() == Path("/nonexistent-strata-cache/conversations")
    finally:
        if saved is None:
            del os.environ["STRATA_CACHE_DIR"]
        else:
            os.environ["STRATA_CACHE_DIR"] = saved
    assert "`profiles/` of its cache folder (`$STRATA_CACHE_DIR`, else" in README


def named_paths(text: str) -> set[str]:
    return set(re.findall(r"`((?:src|tests|tools|docs|plugins)/[A-Za-z0-9_./-]+)`", text))


@pytest.mark.parametrize("page", ("README.md",) + USER_DOCS + ("cuda.md", "DEVELOPING.md"))
def test_named_files_exist(page):
    text = README if page == "README.md" else (ROOT / "docs" / page).read_text()
    missing = sorted(p for p in named_paths(text) if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"{page} names files that do not exist: {missing}"


def test_ci_runs_the_readmes_second_line():
    block = README.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[0].endswith('.venv/bin/strata run "What is the for statement?"')
    assert "-m pytest" in block[1] and "--dist worksteal" in block[1]
