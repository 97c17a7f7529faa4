"""Validation of OpenAI request bodies: every field type-checked, each error naming the field,
the value it had and what is accepted. Unknown fields are ignored, as OpenAI's clients add some."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from strata.engine.logprobs import MAX_TOP_LOGPROBS
from strata.model.tokenizer import valid_text
from strata.server.api_error import ApiError, invalid

MAX_STOP_STRINGS = 16
# Characters a stop string may hold: the generation's stop matcher holds back a partial match
# and, where the next token breaks it, looks for a shorter one, quadratic in its length (16
# stops of 64K characters: ~2.5 s of the engine thread each time a long partial match breaks)
MAX_STOP_CHARS = 4096
MAX_LOGIT_BIAS = 1024   # OpenAI's logit_bias: at most this many tokens, each biased by [-100, 100]
_MAX_ID_DIGITS = 12  # a logit_bias key longer than this names no token of any vocabulary
_MISSING = object()


@dataclass
class GenerationOptions:
    """Sampling and streaming fields shared by both endpoints (None = the engine's default)."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None  # llama.cpp's: the repetition penalty's window
    is_stream: bool = False
    is_usage_streamed: bool = False
    is_eos_ignored: bool = False  # vLLM's `ignore_eos` extension: generate to max_tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias
    json_object: bool = False  # the answer held to one JSON object (response_format)
    json_schema: dict | None = None  # ... that follows this schema (json_schema format)
    grammar: str | None = None  # llama.cpp's GBNF grammar: the answer is a sentence of it
    held_tool_calls: list[dict] | None = None  # the functions of held tool calls (the prompt
    tool_call_form: str = "json"                # sets both: json or xml, as its template asks)
    tool_call_required: bool = False  # the answer opens with a call (tool_choice required / named)
    is_parallel_tool_calls: bool = True  # False: at most one call (parallel_tool_calls false)
    thinking_budget: int | None = None  # tokens a <think> block may take (None: the server's)
    stop_token_ids: list[int] = field(default_factory=list)  # beside EOS (a FIM prompt's)
    logprobs: int | None = None  # each token's log probability and this many alternatives
    prompt_logprobs: int | None = None  # ... of the prompt's tokens too (an echo)
    # llama.cpp's post_sampling_probs: the figures are the sampler chain's probabilities
    post_sampling_probs: bool = False


# `n`: most answers one request may ask for (each one is a request of its own to the engine);
# `best_of`: most candidates it may have generated, of which the `n` best are returned
MAX_CHOICES = 16


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]
    options: GenerationOptions
    n: int = 1  # answers to the same prompt (choices)
    best_of: int = 1  # candidates generated, of which the n best are returned (best_of.py)
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"
    response_format: dict | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    assistant_prefill: str = ""  # the answer continues this text (Anthropic's last assistant turn)
    # a custom tool's name -> the GBNF grammar its one string argument follows (Responses)
    input_grammars: dict[str, str] = field(default_factory=dict)
    custom_tools: frozenset[str] = frozenset()  # their calls answer as custom calls (chat)


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]  # OpenAI's batch: each prompt gets its own `n` choices
    options: GenerationOptions
    n: int = 1  # answers to the same prompt (choices)
    best_of: int = 1  # candidates generated, of which the n best are returned (best_of.py)
    suffix: str | None = None  # the text after the insertion: a fill-in-the-middle completion
    is_echo: bool = False  # the answer's text starts with the prompt's


def parse_json_body(data: bytes) -> dict:
    """The request body as a JSON object (NaN and Infinity, which JSON lacks, are refused)."""
    def refuse_constant(name):
        raise ValueError(f"{name} is not valid JSON")
    try:
        # as json.loads reads bytes (UTF-8, -16 or -32), but kept as text for the scan below
        text = data.decode(json.detect_encoding(data), "surrogatepass")
        body = json.loads(text, parse_constant=refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"The request body is not valid JSON ({exc}). Send a JSON object "
                       "with Content-Type: application/json.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"The request body must be a JSON object, not "
                       f"{_type_name(body)}.", code="invalid_json")
    if _SURROGATE.search(text):
        body = _without_lone_surrogates(body)
    return body


# JSON may escape half of a UTF-16 pair alone ("\ud83d"), which is no character: clients that
# cut text by UTF-16 units (JavaScript editors) send such halves; a UTF-16 or -32 body may hold
# one unescaped. They become U+FFFD (one left would fail the answer's UTF-8 encoding: a 500).
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")


def _without_lone_surrogates(body: dict) -> dict:
    """`body` (just parsed: changed in place) with its strings, keys included, made valid.
    A loop, not recursion: json.loads takes nesting the interpreter's stack would not (a
    lone surrogate under ~500 levels was a RecursionError, a 500)."""
    containers = [body]
    while containers:
        node = containers.pop()
        if isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, str):
                    node[i] = valid_text(v)
                elif isinstance(v, (list, dict)):
                    containers.append(v)
            continue
        items = [(valid_text(k), valid_text(v) if isinstance(v, str) else v)
                 for k, v in node.items()]
        node.clear()
        node.update(items)
        containers.extend(v for _, v in items if isinstance(v, (list, dict)))
    return body


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _wrong_type(param: str, value: Any, expected: str) -> ApiError:
    return ApiError(400, f"'{param}' must be {expected}, got {_type_name(value)}.",
                    param=param, code="invalid_type")


def check_strings(values: list, param: str) -> None:
    """Every item of the array `param` a string; the first that is not is named (stop[1])."""
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise _wrong_type(f"{param}[{index}]", value, "a string")


def _number(body: dict, key: str, low: float, high: float, *, low_open: bool = False,
            param: str | None = None) -> float | None:
    value = body.get(key)
    param = param or key
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(param, value, "a number")
    try:
        value = float(value)
    except OverflowError:  # an integer past float's range: refused below as not finite
        value = math.inf if value > 0 else -math.inf
    is_low_ok = value > low if low_open else value >= low
    if not (math.isfinite(value) and is_low_ok and value <= high):
        bracket = "(" if low_open else "["
        raise invalid(f"'{param}' is {value}, outside the accepted range {bracket}{low}, "
                      f"{high}].", param)
    return value


def _integer(body: dict, key: str, low: int, high: int, *,
             param: str | None = None) -> int | None:
    value = body.get(key)
    key = param or key  # the name errors give
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(key, value, "an integer")
    if not low <= value <= high:
        raise invalid(f"'{key}' is {value}, outside the accepted range [{low}, {high}].", key)
    return value


def _boolean(body: dict, key: str, default: bool = False, *, param: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong_type(param or key, value, "a boolean")
    return value


def _string(body: dict, key: str, *, param: str | None = None) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _wrong_type(param or key, value, "a string")
    return value


def _object(body: dict, key: str, *, param: str | None = None) -> dict | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _wrong_type(param or key, value, "an object")
    return value


def _objects(value: Any, param: str) -> list[tuple[str, dict]]:
    """The items of an array of objects, each with its name for errors (`param[i]`)."""
    if not isinstance(value, list):
        raise _wrong_type(param, value, "an array")
    out = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise _wrong_type(where, item, "an object")
        out.append((where, item))
    return out


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: an object of token ids (as strings, JSON's keys) to numbers in
    [-100, 100]; whether each id is in the model's vocabulary is checked at submission."""
    bias = _object(body, "logit_bias") or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' holds {len(bias)} tokens; at most {MAX_LOGIT_BIAS} may be "
                      "biased.", "logit_bias")
    out = {}
    for key, value in bias.items():
        shown = key if len(key) <= _MAX_ID_DIGITS else key[:_MAX_ID_DIGITS] + "..."
        param = f"logit_bias.{shown}"
        if not (key.isascii() and key.isdigit()):
            raise invalid(f"'logit_bias' has the key {shown!r}; its keys are token ids, written "
                          "as strings of digits (e.g. \"1734\").", param)
        if len(key.lstrip("0")) > _MAX_ID_DIGITS:  # int() refuses over 4300 digits
            raise invalid(f"'logit_bias' names the token id {shown}, outside any vocabulary.",
                          param)
        out[int(key.lstrip("0") or "0")] = _number(bias, key, -100.0, 100.0, param=param)
    return out


def parse_choice_counts(body: dict, is_stream: bool) -> tuple[int, int]:
    """`n` and `best_of` (default: n) of the chat and completions endpoints. A stream sends
    each answer as it is generated, before it is known which are the best: it takes best_of
    only equal to n."""
    n = _integer(body, "n", 1, MAX_CHOICES) or 1
    best_of = _integer(body, "best_of", 1, MAX_CHOICES)
    if best_of is None:
        return n, n
    if best_of < n:
        raise invalid(f"'best_of' is {best_of}, below 'n' ({n}): the n best of best_of "
                      f"candidates are returned, so best_of must be in [{n}, {MAX_CHOICES}].",
                      "best_of")
    if is_stream and best_of > n:
        raise invalid(f"'best_of' is {best_of} with 'n' {n} and 'stream': true; a stream "
                      "cannot send the best candidates before all have finished. Leave "
                      "'best_of' out (or equal to 'n') to stream, or do not stream.",
                      "best_of", "unsupported_value")
    return n, best_of


def check_stop_lengths(stop: list[str], param: str) -> None:
    """A 400 naming the first stop string longer than MAX_STOP_CHARS."""
    for i, text in enumerate(stop):
        if len(text) > MAX_STOP_CHARS:
            raise invalid(f"'{param}[{i}]' holds {len(text)} characters; a stop string may "
                          f"hold at most {MAX_STOP_CHARS}.", f"{param}[{i}]")


def _clipped(value: int | None, limit: int) -> int | None:
    return None if value is None else min(value, limit)


def parse_options(body: dict, max_tokens_limit: int, *,
                  is_best_of_read: bool = False) -> GenerationOptions:
    """The generation fields of every generating endpoint; `max_tokens_limit` is the context
    size. `is_best_of_read`: the caller reads `best_of` (parse_choice_counts); elsewhere only
    1 is accepted, as the endpoint answers one choice."""
    best_of = None if is_best_of_read else _integer(body, "best_of", 1, 2**31)
    if best_of not in (None, 1):
        raise invalid(f"'best_of' is {best_of}; this endpoint answers one choice, so only 1 "
                      "is supported (POST /v1/completions and /v1/chat/completions take "
                      "more).", "best_of", "unsupported_value")
    # more than the context is clipped to it, as llama-server and the Anthropic and Responses
    # endpoints do: an agent configured with a large output limit (opencode's 32K) works
    max_tokens, max_completion = (_clipped(_integer(body, name, 1, 2**31 - 1), max_tokens_limit)
                                  for name in ("max_tokens", "max_completion_tokens"))
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list):
        raise _wrong_type("stop", stop, "a string or an array of strings")
    check_strings(stop, "stop")
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise invalid(f"'stop' must hold 1 to {MAX_STOP_STRINGS} non-empty strings, got "
                      f"{len(stop)} with {sum(not s for s in stop)} empty.", "stop")
    check_stop_lengths(stop, "stop")
    top_k = _integer(body, "top_k", -1, 2**31)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0:  # OpenAI and llama.cpp take 0: the smallest set, the most likely token
        top_p, top_k = None, 1
    _check_samplers_off(body)
    stream_options = _object(body, "stream_options") or {}
    is_stream = _boolean(body, "stream")
    return GenerationOptions(
        max_tokens=max_completion if max_completion is not None else max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=top_p,
        top_k=None if top_k is None else max(top_k, 0),  # -1 means "no top-k" to some clients
        min_p=_number(body, "min_p", 0.0, 1.0),
        # -1: a random seed, as llama-server's OpenAI endpoints read it (UIs send it as "unset")
        seed=None if body.get("seed") == -1 and type(body.get("seed")) is int else _integer(
            body, "seed", 0, 2**63 - 1),
        stop=stop,
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 0.0, 10.0, low_open=True),
        repeat_last_n=_integer(body, "repeat_last_n", -1, 2**31),
        is_stream=is_stream,
        is_usage_streamed=is_stream and _boolean(stream_options, "include_usage"),
        is_eos_ignored=_boolean(body, "ignore_eos"),
        logit_bias=_logit_bias(body),
        grammar=_grammar(body),
    )


# llama.cpp's samplers this server does not have, each with the test of the values that leave
# it off (what llama.cpp front ends send when the user has not turned it on): those are
# accepted, any other value is a 400 naming the field rather than an answer sampled otherwise
_SAMPLERS_OFF = {
    "typical_p": (lambda v: v >= 1.0, "1"),
    "mirostat": (lambda v: v == 0, "0"),
    "dry_multiplier": (lambda v: v == 0.0, "0"),
    "xtc_probability": (lambda v: v == 0.0, "0"),
    "dynatemp_range": (lambda v: v == 0.0, "0"),
    "top_n_sigma": (lambda v: v <= 0.0, "-1"),
}


def _check_samplers_off(body: dict) -> None:
    for key, (is_off, off) in _SAMPLERS_OFF.items():
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _wrong_type(key, value, "a number")
        if not is_off(value):
            raise invalid(f"'{key}' is {value}: this server has no such sampler (llama.cpp's); "
                          f"send {off} or leave it out.", key, "unsupported_value")


def check_object_schema(schema: dict, param: str) -> None:
    """An answer held to a schema is a JSON object (as OpenAI's structured outputs): a 400 for
    a schema whose root type cannot be one (it was answered with an object the schema refuses)."""
    kind = schema.get("type", "object")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return
    raise invalid(f"'{param}' has the type {kind!r}; the answer is held to a JSON object: give "
                  "a schema of type 'object' (wrap other values in a property).", param)


def llama_json_schema(body: dict, options: GenerationOptions) -> dict | None:
    """llama.cpp's top-level `json_schema` (the answer is a JSON object following it), checked:
    an object's schema, and not beside a grammar."""
    schema = body.get("json_schema")
    if schema is None:
        return None
    if not isinstance(schema, dict):
        raise _wrong_type("json_schema", schema, "a JSON schema (an object)")
    check_object_schema(schema, "json_schema")
    if options.grammar is not None:
        raise invalid("'json_schema' and 'grammar' both hold the answer; send one of them.",
                      "json_schema")
    return schema


def _grammar(body: dict) -> str | None:
    """llama.cpp's `grammar` (GBNF text; "" or null: none), compiled here so that a fault is
    a 400 naming its line and column."""
    from strata.engine.gbnf import GrammarError, compiled_grammar

    text = _string(body, "grammar")
    if not text:
        return None
    try:
        compiled_grammar(text)
    except GrammarError as exc:
        raise invalid(f"'grammar': {str(exc).removeprefix('grammar: ')}", "grammar") from None
    return text


# the most answers one /v1/completions request may ask for over its batch of prompts
MAX_BATCH_ANSWERS = 128


def _prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's `prompt`: a string, an array of token ids, or a batch of either (an array of
    strings, or of arrays of token ids); each prompt a non-empty one."""
    if prompt is None:
        raise ApiError(400, "'prompt' is required: a string, an array of token ids, or an "
                       "array of either (a batch).", param="prompt",
                       code="missing_required_parameter")
    if isinstance(prompt, str):
        prompts, param = [prompt], "prompt"
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, (str, list)) for p in prompt):
        prompts, param = prompt, "prompt[{}]"
    elif isinstance(prompt, list):
        prompts, param = [prompt], "prompt"
    else:
        raise _wrong_type("prompt", prompt, "a string or an array of token ids")
    for i, one in enumerate(prompts):
        where = param.format(i)
        if isinstance(one, list) and not all(
                isinstance(t, int) and not isinstance(t, bool) for t in one):
            raise _wrong_type(where, one, "a string or an array of token ids (a batch: an "
                              "array of strings, or of arrays of token ids)")
        if not one:
            raise invalid(f"'{where}' is empty: send at least one character or token.", where)
    return prompts


def parse_completion_request(body: dict, max_tokens_limit: int) -> CompletionRequest:
    options = parse_options(body, max_tokens_limit, is_best_of_read=True)
    n, best_of = parse_choice_counts(body, options.is_stream)
    prompts = _prompts(body.get("prompt"))
    if len(prompts) * best_of > MAX_BATCH_ANSWERS:
        raise invalid(f"'prompt' holds {len(prompts)} prompts with {best_of} answers each; "
                      f"at most {MAX_BATCH_ANSWERS} answers (prompts x best_of, or n) may be "
                      "asked for in one request.", "prompt")
    suffix = _string(body, "suffix")
    if suffix is not None and not all(isinstance(p, str) for p in prompts):
        raise invalid("'suffix' needs 'prompt' as text (the code before the cursor), not token "
                      "ids.", "suffix")
    # the legacy endpoint's logprobs: how many alternatives per token (0: the token's own only)
    options.logprobs = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    is_echo = _boolean(body, "echo")
    if is_echo:  # the prompt's figures too (it is then read whole, no cached prefix reused)
        options.prompt_logprobs = options.logprobs
    if is_echo and suffix is not None:
        raise invalid("'echo' and 'suffix' exclude each other: a fill-in-the-middle answer is "
                      "the middle alone.", "echo")
    return CompletionRequest(model=_string(body, "model"), prompts=prompts, options=options,
                             suffix=suffix, is_echo=is_echo, n=n, best_of=best_of)
