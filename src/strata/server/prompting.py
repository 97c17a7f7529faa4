"""From a validated request to prompt tokens and sampling parameters: a response format becomes
an instruction in the system message, a forced tool choice the hold on the calls; the chat
template renders the rest."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace

from strata.engine.json_constraint import opens_reasoning
from strata.engine.json_schema import GRAMMAR_KEY
from strata.engine.sampling import SamplingParams
from strata.errors import RequestError
from strata.model.fim import FimTokens, InfillText, build_infill
from strata.server.api_error import ApiError, invalid
from strata.server.output_parser import TOOL_OPEN
from strata.server.custom_tools import CUSTOM_INPUT
from strata.server.schema import ChatRequest, GenerationOptions

log = logging.getLogger("strata.server")

_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")
MIN_TEMPERATURE = 1e-5


@dataclass
class ChatPrompt:
    tokens: list[int]
    text: str
    is_tool_parsing: bool
    starts_in_reasoning: bool
    param_types: dict[str, dict[str, str]]
    held_tool_calls: list[dict] | None = None  # the functions whose calls are held
    tool_call_form: str = "json"  # "json" (Qwen) or "xml" (Qwen3-Coder's <function=...>)


def _instructions(req: ChatRequest) -> list[str]:
    """Notes for the system message. A forced tool choice ("required", a named function) adds
    none: the sampler holds the answer to a call (of the named function) whatever the prompt
    says, as vLLM and llama.cpp do. A note in the first system message would change the
    conversation's first tokens, so the agent's next turn (tool_choice "auto") would match
    its parked KV only up to there; a note after the last message would keep the conversation
    but not the reply (the next turn has the reply where the note stood, so the call and its
    reasoning are read again), and templates that take one system message, first, refuse it.
    Without it the forced prompt is token for token the "auto" one."""
    out = []
    fmt = req.response_format
    if fmt is not None and fmt["type"] == "json_object":
        out.append("Answer with one valid JSON object and nothing else.")
    elif fmt is not None:
        schema = fmt["json_schema"].get("schema", fmt["json_schema"])
        out.append("Answer with one valid JSON object that follows this JSON schema, and "
                   "nothing else: " + json.dumps(schema, ensure_ascii=False))
    return out


def _with_system_note(messages: list[dict], notes: list[str]) -> list[dict]:
    if not notes:
        return messages
    note = "\n\n".join(notes)
    if messages[0]["role"] == "system":
        first = dict(messages[0], content=(messages[0]["content"] + "\n\n" + note).strip())
        return [first] + messages[1:]
    return [{"role": "system", "content": note}] + messages


def _param_types(tools: list[dict]) -> dict[str, dict[str, str | tuple]]:
    """Declared JSON types of each tool's parameters (to type XML-form tool-call values): a
    name, or a tuple of names for a type list such as ["string", "null"]."""
    out: dict[str, dict[str, str | tuple]] = {}
    for tool in tools:
        function = tool["function"]
        props = (function.get("parameters") or {}).get("properties")
        if not isinstance(props, dict):
            continue
        types = out[function["name"]] = {}
        for name, spec in props.items():
            kind = spec.get("type") if isinstance(spec, dict) else None
            if isinstance(kind, str):
                types[name] = kind
            elif isinstance(kind, list) and all(isinstance(k, str) for k in kind):
                types[name] = tuple(kind)
    return out


def build_chat_prompt(engine, req: ChatRequest, param: str = "messages",
                      add_generation_prompt: bool = True) -> ChatPrompt:
    """`param` names the request field that holds the conversation ("messages", or the
    Responses API's "input"): a template that refuses it is a 400 naming that field.
    `add_generation_prompt` False (llama.cpp's /apply-template may ask it): the prompt ends
    with the last message, without the assistant's header."""
    clash = [k for k in _RESERVED_TEMPLATE_KWARGS if k in req.chat_template_kwargs]
    if clash:
        raise invalid(f"'chat_template_kwargs' may not set {clash[0]!r}: the server sets it "
                      "from the request.", "chat_template_kwargs")
    # A named function's calls are held to it alone, but the template lists every tool, as
    # "auto" does: the system prompt (the conversation's parked KV) stays the same.
    tools = req.tools if req.tool_choice != "none" else None
    held_tools = tools
    if tools and isinstance(req.tool_choice, dict):
        name = req.tool_choice["function"]["name"]
        held_tools = [t for t in tools if t["function"]["name"] == name]
    messages = _with_system_note(req.messages, _instructions(req))
    try:
        text = _render(engine, messages, tools, add_generation_prompt,
                       req.chat_template_kwargs) + req.assistant_prefill
    except RequestError as exc:
        raise invalid(str(exc), param, "template_error") from None
    except Exception as exc:  # noqa: BLE001 - a template that breaks on some input is a 400
        raise invalid(f"The chat template failed on these messages ({type(exc).__name__}: "
                      f"{exc}).", param, "template_error") from None
    # The template writes BOS itself where the model wants one.
    tokens = engine.tokenize(text, add_special=False)
    form = tool_call_form(text) if tools else None
    return ChatPrompt(tokens=tokens, text=text, is_tool_parsing=bool(tools),
                      starts_in_reasoning=opens_reasoning(engine.tokenizer, tokens),
                      param_types=_param_types(tools or []),
                      held_tool_calls=[_held_function(t["function"], req.input_grammars)
                                       for t in held_tools] if form else None,
                      tool_call_form=form or "json")


def _held_function(function: dict, grammars: dict[str, str]) -> dict:
    """`function` as its calls are held: a custom tool's input with its grammar (a copy: the
    template shows the function as the client sent it)."""
    grammar = grammars.get(function["name"])
    if grammar is None:
        return function
    parameters = function["parameters"]
    held = {**parameters["properties"][CUSTOM_INPUT], GRAMMAR_KEY: grammar}
    return {**function, "parameters": {**parameters, "properties": {CUSTOM_INPUT: held}}}


def _render(engine, messages: list[dict], tools: list[dict] | None,
            add_generation_prompt: bool, template_kwargs: dict) -> str:
    """The template's rendering. Agents send their system prompt as several system messages
    (opencode: a header and the rest); a template that takes one only (it raises on a second)
    gets them joined into one, as the Responses endpoint joins its instructions."""
    def render(chat):
        return engine.render_chat(chat, tools=tools, add_generation_prompt=add_generation_prompt,
                                  **template_kwargs)
    try:
        return render(messages)
    except RequestError:
        num_leading = next((i for i, m in enumerate(messages) if m["role"] != "system"),
                           len(messages))
        if num_leading < 2:
            raise
        log.debug("the chat template refused %d system messages; rendering them as one",
                  num_leading)
        joined = "\n\n".join(m["content"] for m in messages[:num_leading] if m["content"])
        return render([{"role": "system", "content": joined}] + messages[num_leading:])


def tool_call_form(prompt_text: str) -> str | None:
    """How the rendered prompt (its template's tool instructions) asks for calls: "xml" where
    it shows Qwen3-Coder's `<function=...>` form, "json" where it names `<tool_call>` only, None
    where it names neither (calls are then not held)."""
    if TOOL_OPEN not in prompt_text:
        return None
    return "xml" if "<function=" in prompt_text else "json"


def completion_prompt_tokens(engine, prompt: str | list[int],
                             param: str = "prompt") -> list[int]:
    """`param`: the field that holds the prompt (one of a batch: `prompt[i]`)."""
    if isinstance(prompt, str):
        return engine.tokenize(prompt, add_special=True)
    vocab = min(engine.tokenizer.vocab_size, engine.spec.vocab)
    for token in prompt:
        if not 0 <= token < vocab:
            raise invalid(f"'{param}' holds the token id {token}, outside the vocabulary "
                          f"[0, {vocab}).", param)
    return list(prompt)


def fim_tokens(engine, param: str) -> FimTokens:
    """The model's FIM tokens, or a 400 naming `param` (the field that asked for them)."""
    fim = engine.tokenizer.fim
    if fim is None:
        raise ApiError(400, f"'{param}' asks for a fill-in-the-middle completion, but this "
                       "model has no FIM tokens (<|fim_prefix|>, <|fim_suffix|>, "
                       "<|fim_middle|> or llama.cpp's tokenizer.ggml.fim_*_token_id keys); "
                       "serve a model trained for code completion, e.g. Qwen3-Coder or "
                       "Qwen2.5-Coder.", param=param, code="model_not_supported")
    return fim


def fim_prompt_tokens(engine, prefix: str, suffix: str) -> list[int]:
    """OpenAI's `prompt` + `suffix`: the whole FIM prompt (a prompt too long is refused by the
    caller, as any completion's)."""
    fim = fim_tokens(engine, "suffix")
    return build_infill(engine.tokenizer, fim, InfillText(prefix, suffix)).tokens


def check_prompt_fits(num_prompt_tokens: int, n_ctx: int, param: str = "messages") -> None:
    """`param` names the request field that holds the prompt ("messages", "input", "prompt"
    or "prompt[i]"). A prompt over the context is refused in OpenAI's words, which agents
    (LiteLLM, opencode, pi, ...) match to compact a conversation, with llama-server's
    ("exceeds the available context size"), which clients written for it match."""
    if num_prompt_tokens == 0:
        raise invalid("The prompt is empty after tokenization; send some text.", param)
    if num_prompt_tokens > n_ctx:
        field = param.split("[")[0]
        raise ApiError(400, f"This model's maximum context length is {n_ctx} tokens. However, "
                       f"your {field} resulted in {num_prompt_tokens} tokens, more than the "
                       "context holds (the request exceeds the available context size). "
                       f"Please reduce the length of the {field}, or start the server with a "
                       "larger --ctx-size.", param=param, code="context_length_exceeded")


def sampling_params(options: GenerationOptions, num_prompt_tokens: int, n_ctx: int,
                    vocab: int, reasoning_lead: bool = True) -> SamplingParams:
    """The engine's parameters; max_tokens defaults to (and is clipped to) the room left in the
    context, as OpenAI's API does. `vocab`: the token ids [0, vocab) logit_bias may name;
    `reasoning_lead`: SamplingParams'."""
    if options.grammar is not None and (options.json_object or options.held_tool_calls):
        raise invalid("'grammar' holds the answer to a grammar, and so does a JSON response "
                      "format or 'tools': send one of them (tools with tool_choice 'none' "
                      "may come with a grammar).", "grammar")
    room = max(n_ctx - num_prompt_tokens, 1)
    max_tokens = room if options.max_tokens is None else min(options.max_tokens, room)
    for token in options.logit_bias:
        if token >= vocab:
            raise invalid(f"'logit_bias' names the token id {token}, outside the vocabulary "
                          f"[0, {vocab}).", f"logit_bias.{token}")
    fields = {"max_tokens": max_tokens, "stop": list(options.stop), "seed": options.seed,
              "ignore_eos": options.is_eos_ignored, "logit_bias": dict(options.logit_bias),
              "json_object": options.json_object, "json_schema": options.json_schema,
              "grammar": options.grammar, "reasoning_lead": reasoning_lead,
              "held_tool_calls": options.held_tool_calls,
              "tool_call_form": options.tool_call_form,
              "tool_call_required": options.tool_call_required,
              "max_tool_calls": (None if options.is_parallel_tool_calls or
                                 options.held_tool_calls is None else 1),
              "thinking_budget": options.thinking_budget,
              "stop_token_ids": list(options.stop_token_ids), "logprobs": options.logprobs,
              "prompt_logprobs": options.prompt_logprobs,
              "post_sampling_probs": options.post_sampling_probs}
    if options.temperature is not None and options.temperature < MIN_TEMPERATURE:
        # As vLLM does: a temperature this close to 0 is greedy (dividing logits by a tiny or
        # denormal value overflows to inf and the draw has nothing left to pick from).
        options = replace(options, temperature=0.0)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "repeat_last_n"):
        value = getattr(options, name)
        if value is not None:
            fields[name] = value
    try:
        return SamplingParams(**fields)
    except RequestError as exc:
        raise invalid(str(exc), None) from None
