"""EngineConfig: every engine option, validated once."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from strata.backends.select import check_device
from strata.engine.drafts import DEFAULT_DRAFT_MAX, DEFAULT_NGRAM_SIZE, DraftSettings
from strata.engine.recurrent import DEFAULT_CHECKPOINTS
from strata.errors import ConfigError

DEFAULT_MAX_CTX_TOKENS = 8192
MAX_PARALLEL = 8  # the slot table's limit (strata.engine.slots.MAX_SLOTS)
DEFAULT_ADAPT_EVERY = 4
KV_TYPES = ("auto", "f32", "f16", "int8")  # --kv
# --read-chunk auto: prompt windows that stream their experts from RAM (CUDA offload) read this
# many tokens while no slot decodes: one pass over the experts serves 8x the tokens of a
# 512-token window (H200, experts in RAM: pp4096 1,700 -> 10,000 tokens/s, docs/offload.md)
SOLO_STREAMED_CHUNK_TOKENS = 4096
# Size suffixes: K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size_bytes(value: str | int, what: str = "--vram-budget") -> int:
    """Bytes of a size such as 536870912, 512M, 8G, 8GiB (powers of 1024) or 8GB (of 1000)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} is {value!r}; give a size such as 512M, 8G or 8GiB")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what} is {value} bytes; give a size >= 0")
        return value
    match = _SIZE_RE.match(str(value))
    if match is None:
        raise ConfigError(f"{what} is {value!r}, not a size; give bytes or a number with K, M, "
                          "G or T (powers of 1024, also as KiB..TiB; KB..TB are powers of "
                          "1000), e.g. 512M or 8GiB")
    number, prefix, suffix = match.groups()
    base = 1000 if suffix.lower() == "b" and prefix else 1024
    num_bytes = float(number) * base ** _SIZE_POWERS[prefix.lower()]
    if not num_bytes < 2**63:  # inf, from a number of hundreds of digits: int() would raise
        raise ConfigError(f"{what} is {value!r}, more bytes than any machine has; give a size "
                          "such as 512M or 8GiB")
    return int(num_bytes)


def parse_count(value) -> int | None:
    """The integer a plain decimal count such as '512' stands for (spaces around it allowed);
    None when it is not one: a sign, a fraction, a digit int() does not read such as '²', or
    more than 18 significant digits (no count Strata takes is that large; int() refuses strings
    past 4300 digits with a ValueError)."""
    text = str(value).strip()
    if not text.isdecimal():
        return None
    significant = text.lstrip("0") or "0"
    if len(significant) > 18:
        return None
    return int(significant)


def _check_writable(path: Path, option: str) -> None:
    """ConfigError now, not a traceback once the engine is built, when `path` cannot be written
    (a folder this user may not write, a read-only or virtual file system). A file that exists
    is opened for appending and left as it is; one that does not is created and removed."""
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise ConfigError(f"{option} {str(path)!r} cannot be written ({e.strerror or e}); "
                          "give a file in a folder this user may write") from None
    if not existed:
        try:
            path.unlink()
        except OSError:
            pass


# The command-line flag of an EngineConfig field, named beside it in errors
_FLAGS = {"n_ctx": "--ctx-size", "threads": "--threads", "parallel": "--parallel",
          "seed": "--seed", "prompt_chunk_tokens": "--read-chunk",
          "solo_chunk_tokens": "--read-chunk", "ctx_checkpoints": "--ctx-checkpoints",
          "adapt_every": "--adapt-every", "adapt_swaps": "--adapt-swaps"}


@dataclass
class EngineConfig:
    """Options of one engine. `n_ctx` None means min(the model's context length, 8192);
    `threads` None means the CPU kernels' default (all cores)."""

    model_path: str | os.PathLike
    n_ctx: int | None = None
    threads: int | None = None
    prompt_chunk_tokens: int = 512  # --read-chunk: prompt tokens per window
    # Prompt tokens per window while no slot decodes: None is prompt_chunk_tokens; "auto" (the
    # CLI's --read-chunk auto) lets the engine take SOLO_STREAMED_CHUNK_TOKENS when prompt
    # windows stream their experts from RAM (CUDA offload), else prompt_chunk_tokens
    solo_chunk_tokens: int | str | None = None
    seed: int | None = None
    parallel: int = 1  # --parallel: slots (sequences decoded together)
    # parked KVs in host RAM (at most half the RAM available); 0 turns parking off, -1: no
    # limit but the RAM's
    conversation_cache_mib: float = 8192
    # --conversation-cache-dir DIR|auto: parked conversations evicted from RAM, and all of them
    # at a graceful stop, are written there and restored by a later server of this model
    # (engine/conversation_disk.py); None: no files. auto: the user cache folder's
    # conversations/. --conversation-cache-disk-mib: what they may take (at most half the
    # disk space free at start)
    conversation_cache_dir: str | os.PathLike | None = None
    conversation_cache_disk_mib: float = 65536
    # --ctx-checkpoints: recurrent states a hybrid model's slot keeps (strata.engine.recurrent)
    ctx_checkpoints: int = DEFAULT_CHECKPOINTS
    device: str = "auto"  # --device auto|cpu|cuda (strata.backends.select)
    # --mmap / --no-mmap: the CPU backend computes from the file's memory map (True) or from a
    # copy read into RAM in huge pages at start (False; backends/select.py)
    mmap: bool = True
    # ---- the expert cache and the adaptive tier (docs/expert-cache.md) ----
    expert_cache: str | int | None = None  # --expert-cache auto|N; None: no cache
    vram_budget_bytes: int | str | None = None  # --vram-budget (bytes, or "8G"-style text)
    expert_pack_path: str | os.PathLike | None = None  # --expert-pack: experts from a pack
    expert_profile_path: str | os.PathLike | None = None  # --expert-profile: start-up fill
    # --expert-profile auto sets this: where the run's routing is stored at close (the user
    # cache folder, experts/profile.py); expert_profile_path is then that file if it exists
    expert_profile_save: str | os.PathLike | None = None
    dump_routing_path: str | os.PathLike | None = None  # --dump-routing: routing trace file
    adapt_every: int = DEFAULT_ADAPT_EVERY  # windows per tier round; 0 freezes the cache
    adapt_min_gain: float = 0.0  # a swap's expected gain (routed rows) must exceed this
    adapt_swaps: int | None = None  # most swaps per round; None: the policy's default
    adapt_async: bool = True  # copies land while the next windows run
    # --pcie-frac: share of the cache misses' routed rows the GPU reads over PCIe, the rest go to
    # the CPU pool; None: the stored `strata-tool calibrate` result, else 0.3; "auto": that
    # share to start from, then measured while serving (backends/cuda/share_tuner.py)
    pcie_frac: float | str | None = None
    # --kv: KV cell type; auto is the backend's own (CPU float32, CUDA float16), int8 (a scale
    # per token and head) is CUDA's
    kv_type: str = "auto"
    # --kv-grow auto|N: slots start with N KV cells (auto: --read-chunk's) and borrow expert-cache
    # slots for more while a request needs them (experts/kv_grow.py); None: n_ctx cells up front
    kv_grow: str | int | None = None
    # ---- two or more GPUs: a layer split (strata.backends.split, docs/cuda.md) ----
    split_devices: str | None = None  # --split-device 0,1: the GPUs of the stages
    layer_split: str | None = None  # --layer-split auto|K1,K2: layers per stage
    batch_groups: str | int = "auto"  # --batch-groups auto|N: slot groups pipelined
    # ---- speculative decoding without a draft model (strata.engine.drafts) ----
    spec_type: str = "none"  # --spec-type none|ngram-simple
    draft_max: int = DEFAULT_DRAFT_MAX  # --draft-max: most draft tokens per slot and window
    draft_min: int = 0  # --draft-min: no draft shorter than this
    spec_ngram_size_n: int = DEFAULT_NGRAM_SIZE  # --spec-ngram-size-n: the lookup key's tokens
    # The resolved number of cache slots, set by the engine once the model's expert size is
    # known (the tier policy hook reads it); None while unresolved or without a cache.
    expert_cache_slots: int | None = field(default=None, init=False)

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
        self._check_int("n_ctx", allow_none=True, minimum=0)  # 0: the model's whole context
        self._check_int("threads", allow_none=True, minimum=1)
        from strata._native.kernels import MAX_THREADS
        if self.threads is not None and self.threads > MAX_THREADS:
            raise ConfigError(f"threads (--threads) = {self.threads} is more than the "
                              f"{MAX_THREADS} the CPU kernels run; give the number of cores or "
                              "fewer")
        self.device = check_device(self.device)
        self._check_int("prompt_chunk_tokens", allow_none=False, minimum=1)
        if self.solo_chunk_tokens != "auto":
            self._check_int("solo_chunk_tokens", allow_none=True, minimum=1)
        self._check_int("seed", allow_none=True, minimum=0)
        self._check_int("parallel", allow_none=False, minimum=1)
        if self.parallel > MAX_PARALLEL:
            raise ConfigError(f"parallel = {self.parallel} is more slots than Strata runs; give "
                              f"1 to {MAX_PARALLEL} (--parallel)")
        mib = self.conversation_cache_mib
        if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not (
                mib >= 0 or mib == -1) or mib == float("inf"):
            raise ConfigError(f"conversation_cache_mib = {mib!r} must be a number >= 0, or -1 "
                              "(--conversation-cache-mib / --cache-ram; 0 turns parking off, "
                              "-1 sets no limit but half the RAM available)")
        self._check_conversation_files()
        self._check_int("ctx_checkpoints", allow_none=False, minimum=0)
        self._check_expert_options()
        self._check_split_options()
        self.spec_type = str(self.spec_type).strip().lower()
        _ = self.drafts  # ConfigError now when one of the four draft options is bad

    @property
    def drafts(self) -> DraftSettings:
        """The speculative-decoding options as one value (ConfigError when one is bad)."""
        return DraftSettings(self.spec_type, self.draft_max, self.draft_min,
                             self.spec_ngram_size_n)

    def _check_conversation_files(self) -> None:
        if self.conversation_cache_dir is None:
            return
        if str(self.conversation_cache_dir).strip() == "":
            raise ConfigError("--conversation-cache-dir is empty; give a folder, or auto")
        mib = self.conversation_cache_disk_mib
        if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not mib > 0 \
                or mib == float("inf"):
            raise ConfigError(f"conversation_cache_disk_mib = {mib!r} must be a number > 0 "
                              "(--conversation-cache-disk-mib)")
        if self.conversation_cache_mib == 0:
            raise ConfigError("--conversation-cache-dir needs parked conversations in RAM "
                              "first: drop --conversation-cache-mib 0 (--cache-ram 0)")
        folder = self.resolve_conversation_dir()
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--conversation-cache-dir {str(folder)!r} is a file; give a "
                              "folder")

    def resolve_conversation_dir(self) -> Path:
        """The folder of the conversation files (auto: the user cache folder's)."""
        if str(self.conversation_cache_dir).strip().lower() == "auto":
            from strata.user_cache import cache_dir

            return cache_dir() / "conversations"
        return Path(self.conversation_cache_dir).expanduser()

    def _check_split_options(self) -> None:
        groups = str(self.batch_groups).strip().lower()
        count = parse_count(groups)
        is_count = count is not None and count >= 1
        if isinstance(self.batch_groups, bool) or not (groups == "auto" or is_count):
            raise ConfigError(f"--batch-groups {self.batch_groups!r}: give auto or a number of "
                              "slot groups >= 1")
        self.batch_groups = groups if groups == "auto" else count
        # the form of the lists now, before a backend is built; counts and GPUs when it is
        # (backends/split.py knows the model's layers and the visible GPUs)
        if self.split_devices is not None:
            indices = [parse_count(p) for p in str(self.split_devices).split(",")]
            if None in indices or len(set(indices)) != len(indices):
                raise ConfigError(f"--split-device {self.split_devices!r}: give distinct GPU "
                                  "indices such as 0,1")
        if self.layer_split is not None and str(self.layer_split).strip().lower() != "auto":
            counts = [parse_count(p) for p in str(self.layer_split).split(",")]
            if not all(count is not None and count > 0 for count in counts):
                raise ConfigError(f"--layer-split {self.layer_split!r}: give auto or a number "
                                  "of layers (>= 1) per GPU, such as 24,24")
        if self.batch_groups != "auto" and self.batch_groups > 1 and not self.is_split:
            raise ConfigError(f"--batch-groups {self.batch_groups} pipelines slot groups over "
                              "the GPUs of a layer split; give --split-device / --layer-split "
                              "with it, or drop it")
        if self.is_split and self.device == "cpu":
            raise ConfigError("--split-device / --layer-split split the layers over GPUs; "
                              "drop them or use --device cuda (or auto)")

    @property
    def is_split(self) -> bool:
        """True when the layers are to be split over GPUs (--split-device / --layer-split)."""
        return self.split_devices is not None or self.layer_split is not None

    def _check_expert_options(self) -> None:
        cache = self.expert_cache
        if cache is not None:
            if isinstance(cache, bool) or not isinstance(cache, (str, int)):
                raise ConfigError(f"expert_cache = {cache!r}; give 'auto' or a number of slots "
                                  "(--expert-cache auto|N)")
            if isinstance(cache, str):
                text = cache.strip().lower()
                if text != "auto" and parse_count(text) is None:
                    raise ConfigError(f"--expert-cache is {cache!r}; give 'auto' or a number "
                                      "of slots >= 0")
                cache = "auto" if text == "auto" else parse_count(text)
            elif cache < 0:
                raise ConfigError(f"--expert-cache is {cache}; give 'auto' or a number of "
                                  "slots >= 0")
            self.expert_cache = cache
        if self.vram_budget_bytes is not None:
            self.vram_budget_bytes = parse_size_bytes(self.vram_budget_bytes)
            if cache is None:
                raise ConfigError("--vram-budget sizes the expert cache; give --expert-cache "
                                  "auto (or a slot count) with it")
        if cache == "auto" and self.vram_budget_bytes is None and str(
                self.device).strip().lower() == "cpu":  # on the GPU: what free VRAM holds
            raise ConfigError("--expert-cache auto needs --vram-budget (the bytes the cache may "
                              "use), e.g. --vram-budget 8G; or give a slot count, e.g. "
                              "--expert-cache 64")
        if str(self.expert_profile_path).strip().lower() == "auto":
            from strata.experts.profile import stored_profile_path

            stored = stored_profile_path(self.model_path)
            self.expert_profile_save = stored
            self.expert_profile_path = stored if stored.is_file() else None
        for name, option in (("expert_pack_path", "--expert-pack"),
                             ("expert_profile_path", "--expert-profile")):
            value = getattr(self, name)
            if value is None:
                continue
            path = Path(value)
            if not path.is_file():
                raise ConfigError(f"{option} {str(path)!r} is not a file; check the path")
            setattr(self, name, path)
        if (self.expert_profile_path is not None or self.expert_profile_save is not None) \
                and cache is None:
            raise ConfigError("--expert-profile fills the expert cache at start-up; give "
                              "--expert-cache auto|N with it")
        if self.dump_routing_path is not None:
            path = Path(self.dump_routing_path)
            is_odd = path.exists() and not path.is_file()  # a pipe would block the open
            if path.is_dir() or not path.parent.is_dir() or is_odd:
                raise ConfigError(f"--dump-routing {str(path)!r} must name a file in an "
                                  "existing folder")
            _check_writable(path, "--dump-routing")
            self.dump_routing_path = path
        self._check_int("adapt_every", allow_none=False, minimum=0)
        self._check_int("adapt_swaps", allow_none=True, minimum=1)
        gain = self.adapt_min_gain
        if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not gain >= 0 \
                or gain == float("inf"):
            raise ConfigError(f"adapt_min_gain = {gain!r} must be a number >= 0 "
                              "(--adapt-min-gain, in routed rows per round)")
        if not isinstance(self.adapt_async, bool):
            if self.adapt_async in (0, 1):
                self.adapt_async = bool(self.adapt_async)
            else:
                raise ConfigError(f"adapt_async = {self.adapt_async!r}; give 0 (blocking) or "
                                  "1 (copies land while the next windows run)")
        self._check_kv_grow()
        if not isinstance(self.mmap, bool):
            raise ConfigError(f"mmap must be True (--mmap) or False (--no-mmap), not "
                              f"{self.mmap!r}")
        if self.kv_type not in KV_TYPES:
            raise ConfigError(f"--kv {self.kv_type!r} is not one of {', '.join(KV_TYPES)}")
        frac = self.pcie_frac
        if frac is not None:
            if frac != "auto" and (isinstance(frac, bool) or not isinstance(frac, (int, float))
                                   or not 0.0 <= frac <= 1.0):
                raise ConfigError(f"--pcie-frac is {frac!r}; give a fraction from 0 (every cache "
                                  "miss computed by the CPU pool) to 1 (every one read by the GPU "
                                  "over PCIe), or auto (measured while serving)")
            if cache is None or self.device == "cpu":
                raise ConfigError("--pcie-frac splits the GPU expert cache's misses between "
                                  "PCIe and the CPU pool; give it with --expert-cache auto|N "
                                  "and --device cuda (or auto)")
            self.pcie_frac = frac if frac == "auto" else float(frac)

    def _check_kv_grow(self) -> None:
        grow = self.kv_grow
        if grow is None:
            return
        text = str(grow).strip().lower()
        count = parse_count(text)
        if isinstance(grow, bool) or not (text == "auto" or count is not None and count >= 1):
            raise ConfigError(f"--kv-grow is {grow!r}; give auto (a --read-chunk of cells per "
                              "slot to start with) or a number of cells >= 1")
        if self.expert_cache is None:
            raise ConfigError("--kv-grow lends expert-cache slots to the KV; give --expert-cache "
                              "auto|N with it")
        self.kv_grow = "auto" if text == "auto" else count

    def kv_base_cells(self, n_ctx: int) -> int:
        """KV cells each slot starts with: n_ctx without --kv-grow, else its value (auto: the
        --read-chunk size), at most n_ctx."""
        if self.kv_grow is None:
            return int(n_ctx)
        base = self.prompt_chunk_tokens if self.kv_grow == "auto" else self.kv_grow
        return min(int(base), int(n_ctx))

    def max_prompt_window_tokens(self) -> int:
        """The most prompt tokens one window may read (what buffers sized for windows, such as
        the CPU pool's exchange, must hold): the solo chunk when set ("auto": its largest)."""
        solo = self.solo_chunk_tokens
        if solo == "auto":
            solo = SOLO_STREAMED_CHUNK_TOKENS
        return max(self.prompt_chunk_tokens, solo or 0)

    def resolve_solo_chunk(self, streams_prompt_experts: bool) -> int:
        """Resolve solo_chunk_tokens (engine start, once the model is built) and return it."""
        if self.solo_chunk_tokens == "auto":
            self.solo_chunk_tokens = (max(self.prompt_chunk_tokens, SOLO_STREAMED_CHUNK_TOKENS)
                                      if streams_prompt_experts else self.prompt_chunk_tokens)
        elif self.solo_chunk_tokens is None:
            self.solo_chunk_tokens = self.prompt_chunk_tokens
        return int(self.solo_chunk_tokens)

    def kv_dtype(self, is_cuda: bool):
        """The dtype to make KV caches with (None: the backend's default); ConfigError when the
        backend does not keep cells of that type."""
        if self.kv_type == "auto":
            return None
        if self.kv_type == "int8" and not is_cuda:
            raise ConfigError("--kv int8 is the CUDA backend's (the CPU keeps f32 or f16 "
                              "cells); use --kv f16 or --device cuda")
        if self.kv_type == "f32" and is_cuda:
            raise ConfigError("--kv f32: the CUDA backend keeps f16 or int8 cells; use --kv "
                              "f16 or int8")
        return {"f32": np.float32, "f16": np.float16, "int8": np.int8}[self.kv_type]

    @property
    def has_expert_tier(self) -> bool:
        """True when the engine needs the expert tier runtime (a cache, a pack or a trace)."""
        return (self.expert_cache is not None or self.expert_pack_path is not None
                or self.dump_routing_path is not None)

    def _check_int(self, name: str, allow_none: bool, minimum: int) -> None:
        value = getattr(self, name)
        if value is None and allow_none:
            return
        said = f"{name} ({_FLAGS[name]})" if name in _FLAGS else name  # the user gave the flag
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{said} = {value!r} must be an integer")
        if value < minimum:
            raise ConfigError(f"{said} = {value} must be >= {minimum}")

    def resolve_n_ctx(self, model_context_tokens: int) -> int:
        """The KV size to allocate: n_ctx, min(model context, 8192) when unset, the model's
        whole context at 0 (llama.cpp's `-c 0`). Asking for more than the model was trained on
        is an error the user can fix."""
        if self.n_ctx is None:
            return min(int(model_context_tokens), DEFAULT_MAX_CTX_TOKENS)
        if self.n_ctx == 0:
            return int(model_context_tokens)
        if self.n_ctx > model_context_tokens:
            raise ConfigError(f"n_ctx (--ctx-size) = {self.n_ctx} is larger than the model's "
                              f"context length {model_context_tokens}; use at most "
                              f"{model_context_tokens}, or 0 for all of it")
        return self.n_ctx
