"""Custom tools (`{"type": "custom"}`: free-form input, as Codex sends apply_patch where its
config asks for the freeform tool), on /v1/responses (`{type, name, description, format}`) and
/v1/chat/completions (`{type, custom: {name, description, format}}`, its grammar one level
deeper): offered to the template as a function of one string argument, CUSTOM_INPUT, its input
held to its grammar where one converts (engine/lark_grammar.py, regex_grammar.py), and its
calls answered as custom calls."""
from __future__ import annotations

import json
import logging
from typing import Any

from strata.server.api_error import invalid, missing
from strata.server.schema import _object, _string

log = logging.getLogger("strata.server")

# the one argument of a custom tool's function
CUSTOM_INPUT = "input"


def custom_tool(tool: dict, where: str) -> dict:
    """A custom tool `{name, description, format}` (the Responses form; `chat_custom_tool`
    gives the chat form's) as a function of one string argument. Its grammar (Lark or a
    regex) is shown to the model in the description, and its calls' input is held to it
    (`custom_tool_grammars`)."""
    from strata.server.chat_schema import flat_function_tool  # (which reads chat tools here)

    function = flat_function_tool({k: tool.get(k) for k in ("name", "description")
                                   if tool.get(k) is not None}, where, "parameters")["function"]
    fmt = _object(tool, "format", param=f"{where}.format")
    kind = None if fmt is None else fmt.get("type")
    if kind not in (None, "text", "grammar"):
        raise invalid(f"'{where}.format.type' is {kind!r}; use 'text' or 'grammar'.",
                      f"{where}.format.type")
    what = "The tool's whole input, as raw text"
    if kind == "grammar":
        syntax = fmt.get("syntax")
        if syntax not in ("lark", "regex"):
            raise invalid(f"'{where}.format.syntax' is {syntax!r}; use 'lark' or 'regex'.",
                          f"{where}.format.syntax")
        definition = _string(fmt, "definition", param=f"{where}.format.definition")
        if not definition:
            raise missing(f"{where}.format.definition", "the grammar the input follows")
        what += f", following this {'Lark grammar' if syntax == 'lark' else 'regex'}:\n" \
            + definition
    function["parameters"] = {"type": "object", "required": [CUSTOM_INPUT],
                              "additionalProperties": False, "properties": {
                                  CUSTOM_INPUT: {"type": "string", "description": what}}}
    return {"type": "function", "function": function}


def chat_custom_tool(tool: dict, where: str) -> dict:
    """The chat form's custom tool `{type, custom: {name, description, format: {type,
    grammar: {definition, syntax}}}}` in the Responses form `custom_tool` reads."""
    custom = _object(tool, "custom", param=f"{where}.custom")
    if custom is None:
        raise missing(f"{where}.custom", "the custom tool's name, description and format")
    flat = {"type": "custom", **{k: custom[k] for k in ("name", "description") if k in custom}}
    fmt = _object(custom, "format", param=f"{where}.custom.format")
    if fmt is not None:
        flat["format"] = {"type": fmt.get("type")}
        if fmt.get("type") == "grammar":
            grammar = _object(fmt, "grammar", param=f"{where}.custom.format.grammar")
            if grammar is None:
                raise missing(f"{where}.custom.format.grammar", "the grammar the input follows")
            flat["format"].update({k: grammar.get(k) for k in ("syntax", "definition")})
    return flat


def custom_tool_grammars(tools: Any) -> dict[str, str]:
    """Custom tool name -> the GBNF grammar (engine/gbnf.py) its input follows, for the tools
    among `tools` (the Responses form, checked by `custom_tool`) whose format is a grammar that
    engine/lark_grammar.py or regex_grammar.py can turn into one. One they cannot (a Lark
    feature or regex construct they lack) is shown to the model only: logged, the request
    served."""
    from strata.engine.gbnf import GrammarError, compiled_grammar
    from strata.engine.lark_grammar import lark_to_gbnf
    from strata.engine.regex_grammar import regex_to_gbnf

    out = {}
    for tool in tools or ():
        fmt = tool.get("format") if tool.get("type") == "custom" else None
        if not isinstance(fmt, dict) or fmt.get("type") != "grammar":
            continue
        syntax, definition = fmt["syntax"], fmt["definition"]
        try:
            text = lark_to_gbnf(definition) if syntax == "lark" else regex_to_gbnf(definition)
            compiled_grammar(text)
        except GrammarError as exc:
            log.warning("custom tool %r: its %s grammar is shown to the model but not held "
                        "(%s)", tool["name"], syntax, exc)
            continue
        except Exception:  # noqa: BLE001 - a converter's fault must not end the agent's turns
            log.exception("custom tool %r: converting its %s grammar failed; it is shown to "
                          "the model but not held", tool["name"], syntax)
            continue
        out[tool["name"]] = text
    return out


def custom_tool_names(tools: Any) -> frozenset[str]:
    """The names of the custom tools among `tools` (checked by parse_responses_tools)."""
    return frozenset(tool["name"] for tool in tools or () if tool.get("type") == "custom")


def custom_input(arguments: str) -> str:
    """A custom tool call's input, from the arguments its function call was read with."""
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return arguments
    value = decoded.get(CUSTOM_INPUT) if isinstance(decoded, dict) else None
    return value if isinstance(value, str) else arguments
