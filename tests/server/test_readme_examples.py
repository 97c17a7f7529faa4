"""The README's client examples, as written, against a live server on the packaged default
model (what `strata serve` serves without --model): the OpenAI and Anthropic Python snippets and
the `/completion` curl bodies (the URL and the model name swapped for the test server's)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from strata.config import EngineConfig
from strata.data import default_model_path
from strata.engine.engine import Engine
from strata.server.app import ServerConfig

from live_server import start_live_server

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
MODEL_ID = "default-model"


@pytest.fixture(scope="module")
def live():
    engine = Engine(EngineConfig(default_model_path(), threads=2))
    server = start_live_server(engine, ServerConfig(model_id=MODEL_ID))
    yield server
    server.stop()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def run_snippet(code: str, live) -> None:
    code = code.replace("http://127.0.0.1:8080", live.url)
    code = code.replace('model="model"', f'model="{MODEL_ID}"')
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own text


@pytest.mark.parametrize("client", ["from openai import OpenAI", "import anthropic"])
def test_python_example_runs(live, client, capsys):
    [code] = [b for b in python_blocks() if b.startswith(client)]
    # the OpenAI example is what a new user runs against `strata serve`: the packaged model's
    # name as it is, with no substitution; the Anthropic one follows a serve of another model
    name = f'model="{MODEL_ID}"' if client.startswith("from openai") else 'model="model"'
    assert name in code and "http://127.0.0.1:8080" in code
    run_snippet(code, live)
    assert capsys.readouterr().out.strip(), "the example printed nothing"


def curl_bodies(path: str) -> list[dict]:
    """The JSON bodies of the README's `curl ... /path -d '...'` commands."""
    found = re.findall(r"curl -s (?:http://127\.0\.0\.1|localhost):8080" + re.escape(path)
                       + r" -d '(.*?)'", README, re.S)
    return [json.loads(body) for body in found]


def test_completion_grammar_example(live):
    [body] = [b for b in curl_bodies("/completion") if "grammar" in b]
    # the default model's vocabulary has a <think>: on a raw prompt it opens no unheld block
    for seed in range(4):
        reply = requests.post(live.url + "/completion", json=dict(body, seed=seed), timeout=60)
        assert reply.status_code == 200, reply.text
        assert re.fullmatch(r" [0-9]{1,3}%", reply.json()["content"]), reply.json()["content"]


def test_completion_example(live):
    [body] = [b for b in curl_bodies("/completion") if "grammar" not in b]
    reply = requests.post(live.url + "/completion", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["prompt"] == body["prompt"] and answer["tokens_predicted"] >= 1
