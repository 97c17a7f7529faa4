"""Tool calls held to JSON (engine/tool_call_constraint.py): free text outside `<tool_call>`
blocks, a call of a declared function inside one, then `</tool_call>`."""
from __future__ import annotations

import json

import numpy as np
import pytest

from strata.engine.sampling import Sampler, SamplingParams
from strata.engine.tool_call_constraint import ToolCallConstraint, call_schema
from strata.errors import RequestError
from strata.server.output_parser import OutputParser, ToolCall

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special=False)


def feed(c: ToolCallConstraint, tokens) -> bool:
    """Push every token `allows` takes; False at the first it refuses."""
    for t in tokens:
        if not c.allows(t):
            return False
        c.push(t)
    return True


def test_a_call_between_free_text(tokenizer):
    c = ToolCallConstraint(tokenizer, [WEATHER, TIME])
    stop = sorted(tokenizer.stop_ids)[0]
    assert c.is_free and c.allows(stop)
    assert feed(c, ids(tokenizer, "Let me look that up. <tool_call>"))
    assert not c.is_free and not c.allows(stop)
    assert feed(c, ids(tokenizer, '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'))
    close = ids(tokenizer, "</tool_call>")
    assert len(close) == 1 and feed(c, close)
    assert c.is_free and c.allows(stop)
    assert feed(c, ids(tokenizer, ' and <tool_call>{"name":"get_time","arguments":{}}</tool_call>'))
    assert c.is_free


@pytest.mark.parametrize("body", [
    '{"name": "get_wether", "arguments": {}}',      # not a declared function
    '{"name": "get_weather"}</tool_call>',          # no arguments
    '{"name": "get_weather", "arguments": [1]}',    # arguments not an object
    '{"name": "get_weather", "arguments": {}, "x": 1}',
    "not json",
    '{"name": "get_time", "arguments": {}} x',      # text before the closing tag
    '{"name": "get_time", "arguments": {}}\n\n\n</tool_call>',
])
def test_refused_calls(tokenizer, body):
    c = ToolCallConstraint(tokenizer, [WEATHER, TIME])
    assert feed(c, ids(tokenizer, "<tool_call>"))
    assert not feed(c, ids(tokenizer, body) + ids(tokenizer, "</tool_call>"))


def test_one_function_holds_its_parameters(tokenizer):
    c = ToolCallConstraint(tokenizer, [WEATHER])
    assert feed(c, ids(tokenizer, "<tool_call>"))
    assert not feed(c, ids(tokenizer, '{"name": "get_weather", "arguments": {"city": 5}}'))
    c = ToolCallConstraint(tokenizer, [WEATHER])
    assert feed(c, ids(tokenizer, "<tool_call>"))
    assert not feed(c, ids(tokenizer, '{"name": "get_weather", "arguments": {}}'))
    c = ToolCallConstraint(tokenizer, [WEATHER])  # only its declared parameters
    assert feed(c, ids(tokenizer, "<tool_call>"))
    assert not feed(c, ids(tokenizer, '{"name": "get_weather", "arguments": {"town": "x"'))


@pytest.mark.parametrize("body, ok", [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True),
    ('{"name": "get_time", "arguments": {}}', True),
    ('{"name": "get_time", "arguments": {"city": "Oslo"}}', False),   # get_weather's parameter
    ('{"name": "get_weather", "arguments": {}}', False),              # its required city
    ('{"name": "get_weather", "arguments": {"city": 5}}', False),
    ('{"arguments": {}, "name": "get_time"}', False),                 # the name comes first
])
def test_several_functions_hold_the_named_ones_parameters(tokenizer, body, ok):
    """With several functions the call is a union tagged by its name: the name first, then
    that function's arguments held (they were a free object whatever the function)."""
    assert "anyOf" in call_schema([WEATHER, TIME])
    c = ToolCallConstraint(tokenizer, [WEATHER, TIME])
    assert feed(c, ids(tokenizer, "<tool_call>"))
    assert feed(c, ids(tokenizer, body) + ids(tokenizer, "</tool_call>")) == ok


def test_a_tag_spelled_over_several_tokens_opens_a_block(tokenizer):
    pieces = [t for part in ("<", "tool", "_", "call", ">") for t in ids(tokenizer, part)]
    assert tokenizer.decode(pieces) == "<tool_call>" and len(pieces) > 1
    c = ToolCallConstraint(tokenizer, [TIME])
    assert feed(c, ids(tokenizer, "see ") + pieces)
    assert not c.is_free
    assert not c.allows(ids(tokenizer, "hello")[0])


def test_a_token_that_completes_the_tag_is_checked(tokenizer):
    c = ToolCallConstraint(tokenizer, [TIME])
    assert feed(c, ids(tokenizer, "text <tool_"))
    assert not c.is_free  # the next token may complete the tag: ask the constraint
    call, bad = ids(tokenizer, "call"), ids(tokenizer, "call>x")
    assert c.allows(call[0])
    if len(bad) == 1:  # one token "call>x" would open the block with a refused byte
        assert not c.allows(bad[0])
    c.push(call[0])
    end = ids(tokenizer, ">")
    assert c.allows(end[0])
    c.push(end[0])
    assert c.call is not None and not c.is_free


def test_candidates_hold_every_allowed_token(tokenizer):
    V = tokenizer.vocab_size
    c = ToolCallConstraint(tokenizer, [WEATHER, TIME])
    assert c.candidates().shape == (V,)
    for text in ("<tool_call>", '\n{"name": "get_', '"arguments": {', '{}}',
                 '\n</tool_'):
        feed(c, ids(tokenizer, text))
        allowed = {t for t in range(V) if c.allows(t)}
        assert allowed and allowed <= set(c.candidates().tolist()), text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_calls_parse(tokenizer, temperature):
    """Random logits with the opening tag favoured: each closed block is a call the server's
    parser reads, of a declared function, and the text between blocks is free."""
    V = tokenizer.vocab_size
    open_tag = tokenizer.token_id("<tool_call>")
    closers = [t for t in range(V) if tokenizer.token_bytes(t) in (b"}", b'"', b",")]
    calls = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        sampler = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0,
                                         min_p=0.0, seed=seed, held_tool_calls=[WEATHER, TIME]),
                          constraint=ToolCallConstraint(tokenizer, [WEATHER, TIME]))
        tokens = []
        for step in range(300):
            logits = rng.standard_normal(V).astype(np.float32) * 2
            logits[open_tag] += 6
            logits[closers] += min(step % 60 / 6, 8)
            tokens.append(sampler.sample(logits))
        parser = OutputParser(parse_tools=True)  # what the server reads calls with
        events = parser.feed(tokenizer.decode(tokens))
        found = [e for e in events if isinstance(e, ToolCall)]  # the last may be cut off
        assert parser.num_invalid_tool_calls == 0
        for call in found:
            assert call.name in ("get_weather", "get_time")
            assert isinstance(json.loads(call.arguments), dict)
        calls += len(found)
    assert calls >= 3


def test_params_check_the_functions():
    with pytest.raises(RequestError, match="held_tool_calls"):
        SamplingParams(held_tool_calls=[{"parameters": {}}])
    with pytest.raises(RequestError, match="exclude each other"):
        SamplingParams(json_object=True, held_tool_calls=[TIME])
    assert call_schema([TIME])["properties"]["arguments"] == dict(TIME["parameters"],
                                                                  additionalProperties=False)
    open_params = {"type": "object", "properties": {}, "additionalProperties": True}
    assert call_schema([{"name": "f", "parameters": open_params}])["properties"][
        "arguments"] == open_params
    union = json.loads(json.dumps(call_schema([WEATHER, TIME])))["anyOf"]
    assert [u["required"] for u in union] == [["name", "arguments"]] * 2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_device_rows_give_the_host_rows_tokens(tokenizer, temperature):
    """A row left on the device (HostLogitRow stands in for it) takes the candidates outside a
    block and the whole row inside one; the tokens are the host path's either way."""
    from sampling_ref import HostLogitRow

    V = tokenizer.vocab_size
    open_tag, close_tag = tokenizer.token_id("<tool_call>"), tokenizer.token_id("</tool_call>")
    nudged = [tokenizer.token_id(t) for t in ("{", "}", '"', ":")] + [close_tag]
    params = SamplingParams(temperature=temperature, top_k=40, top_p=0.95, min_p=0.0, seed=3,
                            held_tool_calls=[TIME])  # its arguments: {} only
    host, device = (Sampler(params, constraint=ToolCallConstraint(tokenizer, [TIME]))
                    for _ in range(2))
    rng = np.random.default_rng(5)
    whole_rows = blocks = 0
    for step in range(150):
        logits = rng.standard_normal(V).astype(np.float32) * 3
        logits[open_tag] += 30 if step % 30 == 0 else -30
        logits[nudged] += 6
        row = HostLogitRow(logits)
        token = device.sample_candidates(row, V)
        assert token == host.sample(logits.copy())
        whole_rows += row.num_whole_copies
        blocks += token == close_tag
    assert blocks >= 3 and 10 < whole_rows < 140  # the whole row inside blocks only


XML_CALL = ("\n<function=get_weather>\n<parameter=city>\nParis < Rome\n</parameter>\n"
            "</function>\n</tool_call>")


def test_an_xml_call_between_free_text(tokenizer):
    c = ToolCallConstraint(tokenizer, [WEATHER, TIME], xml=True)
    assert feed(c, ids(tokenizer, "Checking. <tool_call>"))
    assert not c.is_free
    assert feed(c, ids(tokenizer, XML_CALL))
    assert c.is_free
    assert feed(c, ids(tokenizer, " then <tool_call><function=get_time></function></tool_call>"))
    assert c.is_free


@pytest.mark.parametrize("body", [
    "<function=get_wether>",                                           # not declared
    "<function=get_weather>\n</function>",                             # city is required
    "<function=get_weather><parameter=town>x</parameter>",             # not a parameter of it
    "<function=get_weather><parameter=city>a</parameter><parameter=city>",  # twice
    "<function=get_weather> text",
    '{"name": "get_time", "arguments": {}}',                           # the other form
    "<function=get_time></function> x</tool_call>",
])
def test_refused_xml_calls(tokenizer, body):
    c = ToolCallConstraint(tokenizer, [WEATHER, TIME], xml=True)
    assert feed(c, ids(tokenizer, "<tool_call>"))
    assert not feed(c, ids(tokenizer, body) + ids(tokenizer, "</tool_call>"))


def test_xml_candidates_and_a_scripted_call(tokenizer):
    """candidates() holds every allowed token inside an XML block; logits that favour a valid
    call's tokens one by one give exactly that call (the constraint never blocks it)."""
    V = tokenizer.vocab_size
    c = ToolCallConstraint(tokenizer, [WEATHER, TIME], xml=True)
    for text in ("<tool_call>", "\n<function=get_", "weather>\n<param", "eter=city>Oslo",
                 "</parameter>\n"):
        feed(c, ids(tokenizer, text))
        allowed = {t for t in range(V) if c.allows(t)}
        assert allowed and allowed <= set(c.candidates().tolist()), text
    script = ids(tokenizer, "Sure. <tool_call>" + XML_CALL + " Done.")
    sampler = Sampler(SamplingParams(temperature=0.0, held_tool_calls=[WEATHER, TIME],
                                     tool_call_form="xml"),
                      constraint=ToolCallConstraint(tokenizer, [WEATHER, TIME], xml=True))
    rng = np.random.default_rng(0)
    for want in script:
        logits = rng.standard_normal(V).astype(np.float32)
        logits[want] += 10
        assert sampler.sample(logits) == want
    parser = OutputParser(parse_tools=True, param_types={"get_weather": {"city": "string"}})
    calls = [e for e in parser.feed(tokenizer.decode(script)) if isinstance(e, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris < Rome"})]


def test_the_prompt_decides_the_form():
    from strata.server.prompting import tool_call_form

    assert tool_call_form("no tools here") is None
    assert tool_call_form('...<tool_call>\n{"name": <function name>, ...}') == "json"
    assert tool_call_form("...<tool_call>\n<function=example>\n<parameter=x>") == "xml"
    with pytest.raises(RequestError, match="tool_call_form"):
        SamplingParams(held_tool_calls=[TIME], tool_call_form="yaml")


READ = {"name": "read", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "limit": {"type": "integer"}, "ratio": {"type": "number"},
    "flag": {"type": "boolean"}, "mode": {"enum": ["fast", "slow"]},
    "opt": {"type": ["integer", "null"]}, "note": {"type": ["string", "null"]},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["path"]}}
TYPED_CALL = ("\n<function=read>\n<parameter=path>\na.py\n</parameter>\n<parameter=limit>\n10\n"
              "</parameter>\n<parameter=ratio>-1.5e3</parameter><parameter=flag>true</parameter>"
              "<parameter=mode>\nslow\n</parameter><parameter=opt>null</parameter>"
              "<parameter=note>any text</parameter><parameter=tags>\n[\"a\", \"b\"]  "
              "</parameter>\n</function>\n</tool_call>")


def test_xml_values_are_held_by_their_declared_type(tokenizer):
    c = ToolCallConstraint(tokenizer, [READ], xml=True)
    assert feed(c, ids(tokenizer, "<tool_call>" + TYPED_CALL)) and c.is_free
    parser = OutputParser(parse_tools=True, param_types={"read": {
        k: v["type"] for k, v in READ["parameters"]["properties"].items()
        if isinstance(v.get("type"), str)}})
    calls = [e for e in parser.feed("<tool_call>" + TYPED_CALL) if isinstance(e, ToolCall)]
    assert json.loads(calls[0].arguments) == {
        "path": "a.py", "limit": 10, "ratio": -1500.0, "flag": True, "mode": "slow",
        "opt": None, "note": "any text", "tags": ["a", "b"]}


@pytest.mark.parametrize("key,value", [
    ("limit", "ten"), ("limit", "1.5"), ("limit", "\n\n1"), ("limit", "1 2"), ("limit", ""),
    ("ratio", "1."), ("flag", "True"), ("flag", "yes"), ("mode", "medium"), ("mode", "fas"),
    ("opt", "nul"), ("tags", "[1]"), ("tags", '["a"'), ("tags", "a, b"),
])
def test_refused_xml_values(tokenizer, key, value):
    c = ToolCallConstraint(tokenizer, [READ], xml=True)
    body = (f"<tool_call><function=read><parameter=path>a</parameter><parameter={key}>{value}"
            "</parameter></function></tool_call>")
    assert not feed(c, ids(tokenizer, body))


@pytest.mark.parametrize("prefix", ["<parameter=limit>", "<parameter=limit>\n1",
                                    "<parameter=limit>12 ", "<parameter=mode>",
                                    "<parameter=mode>fa", "<parameter=tags>[\"x\""])
def test_xml_value_candidates_hold_every_allowed_token(tokenizer, prefix):
    c = ToolCallConstraint(tokenizer, [READ], xml=True)
    assert feed(c, ids(tokenizer, "<tool_call><function=read><parameter=path>a</parameter>"))
    assert feed(c, ids(tokenizer, prefix))
    allowed = {t for t in range(tokenizer.vocab_size) if c.allows(t)}
    assert allowed and allowed <= set(c.candidates().tolist())


@pytest.mark.parametrize("xml", [False, True])
def test_max_calls_refuses_a_further_block(tokenizer, xml):
    """max_calls 1 (parallel_tool_calls false): once one block closed no other opens, whether
    its tag comes alone, after text, or in the token that closes the first."""
    call = XML_CALL if xml else '\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    c = ToolCallConstraint(tokenizer, [WEATHER, TIME], xml=xml, max_calls=1)
    assert c.is_free and feed(c, ids(tokenizer, "First <tool_call>" + call))
    assert c.num_closed == 1 and c.is_full and not c.is_free
    tag = ids(tokenizer, "<tool_call>")
    assert len(tag) == 1 and not c.allows(tag[0])
    assert feed(c, ids(tokenizer, " then text, < and <tool but no tag"))
    two = ToolCallConstraint(tokenizer, [WEATHER, TIME], xml=xml, max_calls=2)
    assert feed(two, ids(tokenizer, "<tool_call>" + call + "<tool_call>" + call))
    assert not two.allows(tag[0])
    free = ToolCallConstraint(tokenizer, [WEATHER, TIME], xml=xml)
    assert feed(free, ids(tokenizer, ("<tool_call>" + call) * 3)) and free.allows(tag[0])


def test_a_token_that_closes_one_block_and_opens_another_counts_both(tokenizer):
    """A token whose text closes the first block and opens a second (one id past the
    vocabulary here, spelled so) is refused under max_calls 1, taken without it."""
    extra = tokenizer.vocab_size

    class WithExtraToken:
        special_ids, added_ids = tokenizer.special_ids, tokenizer.added_ids

        @staticmethod
        def token_bytes(t):
            return b"}</tool_call><tool_call>" if t == extra else tokenizer.token_bytes(t)

    opened = '<tool_call>{"name": "get_time", "arguments": {}'
    for max_calls, expected in ((1, False), (2, True), (None, True)):
        c = ToolCallConstraint(tokenizer, [TIME], max_calls=max_calls)
        assert feed(c, ids(tokenizer, opened))
        c._tokenizer = WithExtraToken
        assert c.allows(extra) is expected


@pytest.mark.parametrize("xml,body", [
    (False, '{"name": "find", "arguments": {"path": "a", "limit": 3}}'),
    (True, "<function=find><parameter=path>a</parameter><parameter=limit>3</parameter>"
           "</function>"),
])
def test_a_required_parameter_left_undeclared_can_be_written(tokenizer, xml, body):
    """A tool that requires a parameter its properties leave out (a sloppy definition): the
    call can write it and close (it could neither, and the sampler then drew any token)."""
    find = {"name": "find", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}}, "required": ["path", "limit"]}}
    c = ToolCallConstraint(tokenizer, [find], xml=xml)
    assert feed(c, ids(tokenizer, "<tool_call>" + body + "</tool_call>"))
    assert c.is_free


# Pydantic writes a model's parameters with `$defs` and local `$ref`s, as a document of its own
MOVE = {"name": "move", "parameters": {
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}},
                        "required": ["x"]}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"]}}


@pytest.mark.parametrize("functions", [[MOVE], [MOVE, TIME], [TIME, MOVE]])
@pytest.mark.parametrize("body, ok", [
    ('{"name": "move", "arguments": {"to": {"x": 3}}}', True),
    ('{"name": "move", "arguments": {"to": {"x": "far"}}}', False),
    ('{"name": "move", "arguments": {"to": 7}}', False),
])
def test_local_refs_in_parameters_resolve_in_the_functions_own_document(tokenizer, functions,
                                                                        body, ok):
    """A `$ref` of a tool's parameters resolved against the call schema around them, so the
    arguments were held to nothing (any value went)."""
    c = ToolCallConstraint(tokenizer, functions)
    assert feed(c, ids(tokenizer, "<tool_call>"))
    assert feed(c, ids(tokenizer, body) + ids(tokenizer, "</tool_call>")) == ok


@pytest.mark.parametrize("name, ok", [("ab", True), ("abc", True), ("abd", False), ("a", False),
                                      ("b", True), ("ba", False), ("c", False)])
def test_xml_names_checked_by_their_prefixes(tokenizer, name, ok):
    """A name is read byte by byte against the sorted names (one the prefix of another, a
    prefix between two neighbours): only a declared one closes."""
    functions = [{"name": n, "parameters": {"type": "object", "properties": {}}}
                 for n in ("b", "abc", "ab", "x_" * 40)]
    c = ToolCallConstraint(tokenizer, functions, xml=True)
    text = f"<tool_call>\n<function={name}>\n</function>\n</tool_call>"
    assert feed(c, ids(tokenizer, text)) is ok


@pytest.mark.parametrize("xml", [False, True])
def test_the_closing_tag_is_refused_inside_a_call(tokenizer, xml):
    """The reader ends a block at the first `</tool_call>` in its text: a string value that
    spelled one (the tag's own token, or its bytes in pieces) cut the call short, so the text
    of an open call may not hold it; at the call's end it closes the block as before."""
    if xml:
        head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
        tail = "is\n</parameter>\n</function>\n</tool_call>"
    else:
        head = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
        tail = 'is"}}</tool_call>'
    for inside in ("</tool_call>", "</tool_" + "call>"):
        c = ToolCallConstraint(tokenizer, [WEATHER, TIME], xml=xml)
        assert feed(c, ids(tokenizer, head))
        pieces = [tokenizer.token_id("</tool_call>")] if inside == "</tool_call>" else \
            ids(tokenizer, "</tool_") + ids(tokenizer, "call>")
        assert not feed(c, pieces), inside
    c = ToolCallConstraint(tokenizer, [WEATHER, TIME], xml=xml)
    assert feed(c, ids(tokenizer, head + tail)) and c.is_free and c.num_closed == 1
