"""Engine: one model, its slots (scheduler.py), the tokenizer and chat template; generate, chat,
and submit/step for a caller that runs many requests at once (the server's engine thread).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from strata.backends.select import build_model, is_cuda_model
from strata.config import EngineConfig
from strata.engine.conversation_disk import DiskSettings, model_fingerprint
from strata.engine.conversations import resolve_budget_mib
from strata.engine.expert_tier import ExpertTier
from strata.engine.generate import GenerationEvent, GenerationResult, GenerationStats, collect
from strata.engine.sampling import SamplingParams
from strata.engine.scheduler import RequestHandle, Scheduler
from strata.model.chat import ChatTemplate
from strata.model.gguf_file import GGUFModel
from strata.model.host_pages import available_bytes
from strata.model.tokenizer import Tokenizer
from strata.plugins import get_plugin_manager, resolve_choosers

log = logging.getLogger("strata.engine")


class Engine:
    """Runs requests on the CPU or one GPU (`config.device`), `parallel` at a time. Not
    thread-safe: one caller at a time."""

    def __init__(self, config: EngineConfig, plugin_manager=None):
        """`plugin_manager`: where the slot picker, read-interleave policy and observers come
        from (default: `strata.plugins.get_plugin_manager()`, built-ins plus installed
        plugins)."""
        # A copy: the engine records resolved values (expert_cache_slots) in it.
        self.config = config = replace(config)
        self.expert_tier = None
        self.gguf = GGUFModel.open(config.model_path)
        try:
            self.spec = self.gguf.spec
            self.tokenizer = Tokenizer.from_gguf_metadata(self.gguf.metadata,
                                                          source=str(config.model_path))
            self.chat_template = ChatTemplate.from_gguf_metadata(self.gguf.metadata,
                                                                 self.tokenizer)
            self.n_ctx = config.resolve_n_ctx(self.spec.context_length)
            self.model = build_model(self.gguf, config.device, config.threads,
                                     needs_cpu_experts=config.has_expert_tier, config=config)
            # Sets config.expert_cache_slots (read by the tier policy hook) before the choosers.
            self.expert_tier = ExpertTier.build(config, self.gguf, self.model)
            streams = bool(self.expert_tier is not None
                           and self.expert_tier.streams_prompt_experts)
            solo = config.resolve_solo_chunk(streams)
            if solo != config.prompt_chunk_tokens:
                log.info("prompt windows stream their experts from RAM: prompts read %d "
                         "tokens per window while no other slot decodes, else %d "
                         "(--read-chunk auto)", solo, config.prompt_chunk_tokens)
            pm = plugin_manager if plugin_manager is not None else get_plugin_manager()
            choosers = resolve_choosers(pm, config=config, spec=self.spec,
                                        num_slots=config.parallel)
            if self.expert_tier is not None:
                self.expert_tier.start(choosers.tier_policy)
            cache_mib = resolve_budget_mib(config.conversation_cache_mib, available_bytes())
            files = None
            if config.conversation_cache_dir is not None:
                files = DiskSettings(config.resolve_conversation_dir(),
                                     config.conversation_cache_disk_mib,
                                     model_fingerprint(self.gguf))
            self.scheduler = Scheduler(self.model, self.tokenizer, self.n_ctx, config.parallel,
                                       choosers, cache_mib,
                                       expert_tier=self.expert_tier,
                                       kv_dtype=config.kv_dtype(is_cuda_model(self.model)),
                                       drafts=config.drafts,
                                       ctx_checkpoints=config.ctx_checkpoints,
                                       conversation_files=files)
            self.n_ctx = self._admitted_context(self.n_ctx)
            if config.drafts.is_on:
                log.info("%s", config.drafts.describe())
            log.info("%s", self._describe(cache_mib))
        except BaseException:
            if self.expert_tier is not None:
                self.expert_tier.close()
            self.gguf.close()
            raise
        self.last_stats: GenerationStats | None = None

    def _describe(self, cache_mib: float) -> str:
        """The start-up line: what runs where, and how much of it."""
        spec, kvs = self.spec, self.scheduler.kvs
        if is_cuda_model(self.model):
            where = "cuda"
        else:
            from strata._native import kernels
            where = f"cpu, {kernels.get_num_threads()} threads"
        kv_mib = sum(kv.nbytes for kv in kvs) / 2**20
        return (f"model {self.config.model_path.name}: {spec.arch}, {spec.n_layers} layers, "
                f"{spec.n_experts} experts (top {spec.n_experts_used}) on {where}; "
                f"{len(kvs)} slots x {self.n_ctx} tokens of context, KV "
                f"{np.dtype(kvs[0].dtype).name} {kv_mib:.1f} MiB; conversation cache "
                f"{cache_mib:.0f} MiB of RAM")

    def _admitted_context(self, n_ctx: int) -> int:
        """The context a request may fill: n_ctx, or less where --kv-grow's slots can never
        grow that far (the expert cache lends too few cells). The server refuses longer prompts
        with that figure, and tells it to clients (/v1/models, /props), rather than accepting
        them only for the placement to fail."""
        lender = self.scheduler.kv_lender
        if lender is None or lender.max_cells >= n_ctx:
            return n_ctx
        log.warning("the context is %d tokens, not the %d of --ctx-size: with --kv-grow a "
                    "slot's KV grows to at most %d cells (the expert cache's %d lendable slots "
                    "of %d cells); give a larger --expert-cache for more", lender.max_cells,
                    n_ctx, lender.max_cells, lender.num_lendable_slots, lender.cells_per_slot)
        return lender.max_cells

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
        reason ("stop" or "length") and the stats (cached tokens, speeds). The prompt and
        parameters are checked now; the request is queued when the stream is first read, and
        runs (with any other submitted requests) as the stream is read. Closing the stream
        cancels it."""
        prompt = self.scheduler.check_request(prompt_tokens, params)
        return self._generate(prompt, params)

    def _generate(self, prompt: list[int], params: SamplingParams
                  ) -> Iterator[GenerationEvent]:
        handle = self.submit(prompt, params)
        try:
            while True:
                for event in handle.pop_events():
                    self.last_stats = handle.stats
                    yield event
                    if event.finish_reason is not None:
                        return
                if handle.error is not None:
                    raise handle.error
                if handle.is_finished:
                    return  # cancelled
                if not self.scheduler.step():
                    if handle.error is not None:  # it ended in this step (not placed)
                        raise handle.error
                    raise RuntimeError("the scheduler stopped with a request unfinished")  # bug
        finally:
            if not handle.is_finished:
                handle.cancel()
                self.scheduler.drop_cancelled()

    def submit(self, prompt_tokens: list[int], params: SamplingParams,
               name: str | None = None) -> RequestHandle:
        """Place a request in a slot (or queue it while all are busy) without running it;
        `step()` runs it with the others (the server's engine thread). `name`: what the log
        lines call it (the server's request id; default: its number)."""
        if params.seed is None and self.config.seed is not None:
            params = _with_seed(params, self.config.seed)
        return self.scheduler.submit(prompt_tokens, params, name)

    def step(self) -> bool:
        """Run one window over every running request; False when nothing is queued or running."""
        return self.scheduler.step()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_queued(self) -> int:
        return self.scheduler.num_queued

    @property
    def num_reading(self) -> int:
        return self.scheduler.num_reading

    def generate_text(self, prompt: str | list[int], params: SamplingParams
                      ) -> GenerationResult:
        """Generate to the end and return the whole text (prompt: text or token ids)."""
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else prompt
        return collect(self.generate(tokens, params))

    def chat(self, messages: list[dict], params: SamplingParams,
             tools: list[dict] | None = None, **template_kwargs) -> Iterator[GenerationEvent]:
        """Render `messages` with the model's chat template and generate the reply."""
        return self.generate(self.chat_prompt(messages, tools, **template_kwargs), params)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                    **template_kwargs) -> list[int]:
        """The prompt of `messages` in the model's chat template, the assistant's turn opened."""
        template_kwargs.setdefault("add_generation_prompt", True)
        text = self.render_chat(messages, tools=tools, **template_kwargs)
        # The template writes BOS itself where the model wants one.
        return self.tokenize(text, add_special=False)

    def reset(self) -> None:
        """Forget the cached KVs of idle slots and the parked conversations (the next prompt is
        read in full)."""
        self.scheduler.reset()

    @property
    def num_cached_tokens(self) -> int:
        """Tokens in the KV of the slot used last."""
        return len(self.scheduler.table.tokens(self.scheduler.last_slot_index))

    @property
    def kv(self):
        """The KV of the slot used last."""
        return self.scheduler.kvs[self.scheduler.last_slot_index]

    def close(self) -> None:
        try:
            self.scheduler.drain()  # pipelined windows still in flight
            # --conversation-cache-dir: every conversation to its file, for the next start
            self.scheduler.save_conversations()
        finally:
            if self.expert_tier is not None:
                self.expert_tier.close()
        self.gguf.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)
