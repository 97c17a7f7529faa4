"""EngineConfig: every engine option, validated once."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from strata.errors import ConfigError

DEFAULT_MAX_CTX_TOKENS = 8192
MAX_PARALLEL = 8  # the slot table's limit (strata.engine.slots.MAX_SLOTS)


@dataclass
class EngineConfig:
    """Options of one engine. `n_ctx` None means min(the model's context length, 8192);
    `threads` None means the CPU kernels' default (all cores)."""

    model_path: str | os.PathLike
    n_ctx: int | None = None
    threads: int | None = None
    prompt_chunk_tokens: int = 512  # --read-chunk: prompt tokens per window
    seed: int | None = None
    parallel: int = 1  # --parallel: slots (sequences decoded together)
    conversation_cache_mib: float = 2048  # parked KVs in host RAM; 0 turns parking off

    def __post_init__(self):
        if self.model_path is None or str(self.model_path) == "":
            raise ConfigError("model_path is empty: give the path of a GGUF model file")
        path = Path(self.model_path)
        if not path.exists():
            raise ConfigError(f"model file {str(path)!r} does not exist; check the path "
                              "(`strata-tool synth --shape tiny model.gguf` writes a test model)")
        if not path.is_file():
            raise ConfigError(f"model path {str(path)!r} is not a file; give a .gguf file")
        self.model_path = path
        self._check_int("n_ctx", allow_none=True, minimum=1)
        self._check_int("threads", allow_none=True, minimum=1)
        self._check_int("prompt_chunk_tokens", allow_none=False, minimum=1)
        self._check_int("seed", allow_none=True, minimum=0)
        self._check_int("parallel", allow_none=False, minimum=1)
        if self.parallel > MAX_PARALLEL:
            raise ConfigError(f"parallel = {self.parallel} is more slots than Strata runs; give "
                              f"1 to {MAX_PARALLEL} (--parallel)")
        mib = self.conversation_cache_mib
        if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not mib >= 0 \
                or mib == float("inf"):
            raise ConfigError(f"conversation_cache_mib = {mib!r} must be a number >= 0 "
                              "(--conversation-cache-mib; 0 turns parking off)")

    def _check_int(self, name: str, allow_none: bool, minimum: int) -> None:
        value = getattr(self, name)
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} = {value!r} must be an integer")
        if value < minimum:
            raise ConfigError(f"{name} = {value} must be >= {minimum}")

    def resolve_n_ctx(self, model_context_tokens: int) -> int:
        """The KV size to allocate: n_ctx, or min(model context, 8192) when unset. Asking for more
        than the model was trained on is an error the user can fix."""
        if self.n_ctx is None:
            return min(int(model_context_tokens), DEFAULT_MAX_CTX_TOKENS)
        if self.n_ctx > model_context_tokens:
            raise ConfigError(f"n_ctx = {self.n_ctx} is larger than the model's context length "
                              f"{model_context_tokens}; use at most {model_context_tokens}")
        return self.n_ctx
