"""Engine: one model, one sequence's KV, the tokenizer and chat template; generate and chat.

A new prompt that extends the tokens already in the KV reuses them (longest common prefix).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from strata.backends.cpu import CpuModel
from strata.config import EngineConfig
from strata.engine.generate import (GenerationEvent, GenerationResult, GenerationStats, collect,
                                    decode_loop)
from strata.engine.sampling import SamplingParams
from strata.errors import RequestError
from strata.model.chat import ChatTemplate
from strata.model.gguf_file import GGUFModel
from strata.model.tokenizer import Tokenizer


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Engine:
    """Runs requests one at a time on the CPU. Not thread-safe: one caller at a time."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.gguf = GGUFModel.open(config.model_path)
        try:
            self.spec = self.gguf.spec
            self.tokenizer = Tokenizer.from_gguf_metadata(self.gguf.metadata,
                                                          source=str(config.model_path))
            self.chat_template = ChatTemplate.from_gguf_metadata(self.gguf.metadata,
                                                                 self.tokenizer)
            self.n_ctx = config.resolve_n_ctx(self.spec.context_length)
            self.model = CpuModel(self.gguf, num_threads=config.threads)
            self.kv = self.model.new_kv(self.n_ctx)
        except BaseException:
            self.gguf.close()
            raise
        self._kv_tokens: list[int] = []  # the tokens whose K/V cells are in self.kv, in order
        self.last_stats: GenerationStats | None = None

    # ---- text helpers ---------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special=skip_special)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    **template_kwargs) -> str:
        return self.chat_template.render(messages, tools=tools, **template_kwargs)

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompt_tokens: list[int], params: SamplingParams
                 ) -> Iterator[GenerationEvent]:
        """Stream the tokens generated after `prompt_tokens`; the last event has the finish
        reason ("stop" or "length") and the stats (cached tokens, speeds)."""
        prompt = self._check_prompt(prompt_tokens)
        if params.seed is None and self.config.seed is not None:
            params = _with_seed(params, self.config.seed)
        return self._generate(prompt, params)

    def _generate(self, prompt: list[int], params: SamplingParams
                  ) -> Iterator[GenerationEvent]:
        stats = GenerationStats(num_prompt_tokens=len(prompt))
        t0 = time.perf_counter()
        # Reuse the cached prefix, but always recompute the last prompt token: its logits are
        # what the first new token is sampled from, and the KV does not keep logits.
        num_cached = min(common_prefix_len(self._kv_tokens, prompt), len(prompt) - 1)
        self._truncate(num_cached)
        stats.num_cached_tokens = num_cached
        logits = None
        chunk = self.config.prompt_chunk_tokens
        for start in range(num_cached, len(prompt), chunk):
            logits = self._forward(prompt[start:start + chunk])
        stats.prompt_seconds = time.perf_counter() - t0
        self.last_stats = stats

        def step(token: int) -> np.ndarray | None:
            if self.kv.num_tokens >= self.kv.capacity:
                return None
            return self._forward([token])

        yield from decode_loop(logits, step, self.tokenizer, params, prompt, stats)

    def generate_text(self, prompt: str | list[int], params: SamplingParams
                      ) -> GenerationResult:
        """Generate to the end and return the whole text (prompt: text or token ids)."""
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else prompt
        return collect(self.generate(tokens, params))

    def chat(self, messages: list[dict], params: SamplingParams,
             tools: list[dict] | None = None, **template_kwargs) -> Iterator[GenerationEvent]:
        """Render `messages` with the model's chat template and generate the reply."""
        template_kwargs.setdefault("add_generation_prompt", True)
        text = self.render_chat(messages, tools=tools, **template_kwargs)
        # The template writes BOS itself where the model wants one.
        return self.generate(self.tokenize(text, add_special=False), params)

    def reset(self) -> None:
        """Forget the cached KV (the next prompt is read in full)."""
        self._truncate(0)

    @property
    def num_cached_tokens(self) -> int:
        return len(self._kv_tokens)

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------
    def _check_prompt(self, prompt_tokens) -> list[int]:
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token")
        if len(prompt) > self.n_ctx:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.n_ctx}; "
                "shorten the prompt or raise the context size (n_ctx / --ctx-size)")
        vocab = min(self.tokenizer.vocab_size, self.spec.vocab)
        for t in prompt:
            if not 0 <= t < vocab:
                raise RequestError(f"prompt token id {t} is outside the vocabulary [0, {vocab})")
        return prompt

    def _truncate(self, num_tokens: int) -> None:
        self.kv.truncate(num_tokens)
        del self._kv_tokens[num_tokens:]

    def _forward(self, tokens: list[int]) -> np.ndarray:
        try:
            logits = self.model.forward(np.asarray(tokens, dtype=np.int32), self.kv)
        except BaseException:
            # An interrupted pass leaves nothing we can trust in the KV: start clean next time.
            self.kv.truncate(0)
            self._kv_tokens.clear()
            raise
        self._kv_tokens.extend(tokens)
        return logits[-1]  # [V]


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)
