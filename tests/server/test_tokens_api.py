"""llama.cpp's /tokenize, /detokenize and /apply-template on a live server: the engine's own
tokenizer and chat template, and errors naming the field."""
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

USER = [{"role": "user", "content": "Name a colour."}]


def post(live, path, body):
    return requests.post(live.url + path, json=body, timeout=30)


def test_tokenize_and_detokenize_round_trip(live, reference):
    text = "def f(x):\n    return x<|im_end|> é"
    ids = post(live, "/tokenize", {"content": text}).json()["tokens"]
    assert ids == reference.tokenize(text, add_special=False)
    assert reference.tokenizer.token_id("<|im_end|>") in ids  # special spellings are tokens
    assert post(live, "/detokenize", {"tokens": ids}).json() == {"content": text}


def test_parse_special_false_reads_special_spellings_as_text(live, reference):
    """llama.cpp's `parse_special` (default true): false tokenizes a control token's spelling
    as plain text (it was ignored: the text's <|im_end|> became the token)."""
    text = "a<|im_end|>b"
    ids = post(live, "/tokenize", {"content": text, "parse_special": False}).json()["tokens"]
    assert ids == reference.tokenizer.encode_plain(text)
    assert reference.tokenizer.token_id("<|im_end|>") not in ids
    assert post(live, "/detokenize", {"tokens": ids}).json() == {"content": text}
    parsed = post(live, "/tokenize", {"content": text, "parse_special": True}).json()["tokens"]
    assert parsed == reference.tokenize(text, add_special=False) != ids


def test_pieces_are_text_or_the_bytes_of_part_of_a_character(live, reference):
    pieces = post(live, "/tokenize", {"content": "a é 🙂", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == reference.tokenize("a é 🙂", add_special=False)
    data = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                    for p in pieces)
    assert data.decode() == "a é 🙂"


def test_apply_template_is_the_chat_prompt(live, reference):
    reply = post(live, "/apply-template", {"messages": USER}).json()
    assert reply == {"prompt": reference.render_chat(USER, add_generation_prompt=True)}


def test_apply_template_without_the_generation_prompt(live, reference):
    # llama.cpp honours add_generation_prompt: false; it was ignored (the header was added)
    reply = post(live, "/apply-template", {"messages": USER, "add_generation_prompt": False})
    assert reply.json() == {"prompt": reference.render_chat(USER, add_generation_prompt=False)}
    assert reply.json() != post(live, "/apply-template", {"messages": USER}).json()


def test_bad_requests_name_the_field(live):
    for path, body, param in (("/tokenize", {}, "content"),
                              ("/tokenize", {"content": 3}, "content"),
                              ("/tokenize", {"content": "a", "with_pieces": "yes"},
                               "with_pieces"),
                              ("/detokenize", {}, "tokens"),
                              ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]"),
                              ("/detokenize", {"tokens": "12"}, "tokens"),
                              ("/tokenize", {"content": "a", "parse_special": 0},
                               "parse_special"),
                              ("/detokenize", {"tokens": [1, 10**7]}, "tokens[1]"),
                              ("/apply-template", {"messages": "hi"}, "messages")):
        reply = post(live, path, body)
        assert reply.status_code == 400, (path, body, reply.text)
        assert reply.json()["error"]["param"] == param


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6),
                                     st.text(max_size=12)),
                           lambda inner: st.lists(inner, max_size=4), max_leaves=8)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/tokenize", "/detokenize", "/apply-template"]),
       body=st.fixed_dictionaries({}, optional={
           "content": json_values, "tokens": json_values, "with_pieces": json_values,
           "add_special": json_values, "parse_special": json_values,
           "messages": json_values}))
def test_random_bodies_never_get_a_5xx(live, path, body):
    reply = post(live, path, body)
    assert reply.status_code < 500, (path, body, reply.text)
