"""Live servers for the server tests: a tiny synth model behind waitress on a free port."""
import pytest

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.sampling import SamplingParams
from strata.model.chat import ChatTemplate, default_template
from strata.server.app import ServerConfig
from strata.engine.json_constraint import opens_reasoning
from strata.server.output_parser import parse_complete

from live_server import start_live_server

N_CTX_TOKENS = 512
API_KEY = "sk-test-key-0123456789"


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("models") / "tiny-server.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=7)
    return path


def new_engine(model_path) -> Engine:
    return Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2))


@pytest.fixture(scope="module")
def live(model_path):
    server = start_live_server(new_engine(model_path),
                               ServerConfig(model_id="tiny-server", max_body_kib=64,
                                            keepalive_s=0.2))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def live_keyed(model_path):
    server = start_live_server(lambda: new_engine(model_path),
                               ServerConfig(model_id="tiny-server", api_key=API_KEY))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def live_long(model_path):
    """A long context and a short poll: generations that outlast a disconnect's detection."""
    engine = Engine(EngineConfig(model_path, n_ctx=4096, threads=2))
    server = start_live_server(engine, ServerConfig(model_id="tiny-server", keepalive_s=0.02))
    yield server
    server.stop()


LATER_SYSTEM = ("{%- if not loop.first -%}{{ '<|im_start|>system\\n' ~ text(message.content) ~ "
                "'<|im_end|>\\n' }}{%- endif -%}")


@pytest.fixture(scope="module")
def live_one_system(model_path):
    """A server whose template takes one system message, first (as many models' do): the
    shipped template with its later system turn made a refusal."""
    source = default_template()
    assert LATER_SYSTEM in source
    engine = new_engine(model_path)
    engine.chat_template = ChatTemplate(source.replace(LATER_SYSTEM, (
        "{{ raise_exception('a system message may only come first') "
        "if not loop.first else '' }}")))
    server = start_live_server(engine, ServerConfig(model_id="tiny-server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(model_path):
    """A second engine on the same file: what the server must reproduce."""
    engine = new_engine(model_path)
    yield engine
    engine.close()


def reference_chat(engine, messages, max_tokens, tools=None, *, prefill="",
                   template_kwargs=None, **params):
    """What a server must answer: the template's rendering (plus `prefill`), generated greedy
    (and with `params`) by the engine itself: (tokens, content, reasoning, number of tokens
    generated, finish reason)."""
    engine.reset()
    text = engine.render_chat(messages, tools=tools, add_generation_prompt=True,
                              **(template_kwargs or {})) + prefill
    tokens = engine.tokenize(text, add_special=False)
    events = list(engine.generate(tokens, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                         **params)))
    content, reasoning, calls, _ = parse_complete("".join(e.text for e in events),
                                                  parse_tools=bool(tools),
                                                  starts_in_reasoning=opens_reasoning(
                                                      engine.tokenizer, tokens))
    return tokens, content, reasoning, len(events), events[-1].finish_reason
