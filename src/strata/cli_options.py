"""Command-line options shared by `strata run`, `serve` and `bench`: the slots and prompt
reading, the expert cache and the adaptive tier, speculative decoding (run and serve)."""
from __future__ import annotations

import functools

import click

from strata.backends.select import DEVICES
from strata.config import KV_TYPES, MAX_PARALLEL, parse_count
from strata.engine.drafts import DEFAULT_DRAFT_MAX, DEFAULT_NGRAM_SIZE, SPEC_TYPES
from strata.engine.recurrent import DEFAULT_CHECKPOINTS

# --ctx-size of `strata run` and `strata serve`
ctx_size_option = click.option(
    "--ctx-size", "-c", default=None, type=click.IntRange(min=0),
    help="Context size of each slot in tokens (default: min(model context, 8192); 0: the "
         "model's whole context, as llama.cpp's -c 0); every --parallel slot holds this many "
         "(llama-server's -c, without --kv-unified, is split between its slots).")


def device_option(command):
    """Add --device auto|cpu|cuda (passed as `device`)."""
    return click.option(
        "--device", default="auto", show_default=True, type=click.Choice(DEVICES),
        help="Where the model runs: cuda (every layer and expert on one GPU), cpu, or auto "
             "(the GPU when CUDA works and the model fits, else the CPU).")(command)


class ReadChunk(click.ParamType):
    """--read-chunk auto|N (N >= 1)."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        count = parse_count(text)
        if count is not None and count >= 1:
            return count
        self.fail(f"{value!r}: give auto or a number of tokens >= 1", param, ctx)


class PcieFrac(click.ParamType):
    """--pcie-frac F|auto (0 <= F <= 1)."""

    name = "F|auto"

    def convert(self, value, param, ctx):
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        try:
            frac = float(text)
        except ValueError:
            frac = -1.0
        if 0.0 <= frac <= 1.0:
            return frac
        self.fail(f"{value!r}: give a fraction from 0 to 1, or auto", param, ctx)


class CommaInts(click.ParamType):
    """N[,M...]: integers >= `minimum`, kept in order, each once."""

    name = "N[,M...]"
    minimum, what, example = 0, "integers >= 0", "0,1"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        counts = [parse_count(p) for p in str(value).split(",")]
        if not all(count is not None and count >= self.minimum for count in counts):
            self.fail(f"{value!r}: give {self.what} separated by commas, e.g. {self.example}",
                      param, ctx)
        return tuple(dict.fromkeys(counts))


class SlotCounts(CommaInts):
    """Slot counts >= 1 (strata bench --parallel)."""

    minimum, what, example = 1, "slot counts >= 1", "1,4"


class Depths(CommaInts):
    """Context depths >= 0 in tokens (strata bench -d, as llama-bench's)."""

    minimum, what, example = 0, "context depths >= 0 in tokens", "0,16384"


def read_chunk_fields(read_chunk) -> dict:
    """EngineConfig fields for --read-chunk: auto lets the engine pick the solo chunk; N reads
    every prompt window in at most N tokens."""
    if read_chunk == "auto":
        from strata.config import EngineConfig

        return dict(prompt_chunk_tokens=EngineConfig.prompt_chunk_tokens,
                    solo_chunk_tokens="auto")
    return dict(prompt_chunk_tokens=int(read_chunk), solo_chunk_tokens=None)


def slot_options(command):
    """Add --parallel, --read-chunk, --conversation-cache-mib, --ctx-checkpoints (passed as
    `parallel`, `read_chunk`, `conversation_cache_mib` and `ctx_checkpoints`) and the
    conversation files' --conversation-cache-dir and --conversation-cache-disk-mib (passed as
    one dict of EngineConfig keyword arguments, `conversation_files`)."""

    inner = command

    @functools.wraps(inner)
    def with_conversation_files(*args, **kwargs):
        files = {name: kwargs.pop(name)
                 for name in ("conversation_cache_dir", "conversation_cache_disk_mib")}
        return inner(*args, conversation_files=files, **kwargs)

    command = with_conversation_files
    command = click.option(
        "--conversation-cache-disk-mib", default=65536.0, show_default=True,
        type=click.FloatRange(min=0, min_open=True),
        help="Disk space (MiB) the conversation files may take, at most half the space free "
             "at start; the least recently used go first.")(command)
    command = click.option(
        "--conversation-cache-dir", default=None, metavar="DIR|auto",
        help="Write parked conversations that leave the RAM cache, and at a graceful stop "
             "every conversation, to files in DIR; a later server of the same model restores "
             "them, so a conversation's next turn reads only its new tokens (auto: Strata's "
             "cache folder). Default: no files.")(command)
    command = click.option(
        "--ctx-checkpoints", default=DEFAULT_CHECKPOINTS, show_default=True,
        type=click.IntRange(min=0),
        help="Recurrent states kept per slot (qwen3next), one after each prompt read, so a "
             "later prompt sharing that prompt starts there (0: only at the slot's end).")(command)
    command = click.option(
        "--conversation-cache-mib", "--cache-ram", "conversation_cache_mib", default=8192.0,
        show_default=True, type=click.FloatRange(min=-1),
        help="Host RAM (MiB) for the KV of conversations moved out of their slot, at most half "
             "the RAM available at start (0: none kept; -1: no limit but that). A "
             "conversation larger than it keeps its longest prefix that fits.")(command)
    command = click.option(
        "--read-chunk", default="auto", show_default=True, type=ReadChunk(),
        help="Prompt tokens read per window; other slots decode between chunks. auto: 512, "
             "and 4096 while no other slot decodes when prompt windows stream their experts "
             "from RAM (GPU with an expert cache).")(command)
    command = click.option(
        "--parallel", "-np", default=1, show_default=True,
        type=click.IntRange(1, MAX_PARALLEL),
        help="Slots: requests decoded together in one forward pass.")(command)
    return command


# ---- the expert cache and the adaptive tier (docs/expert-cache.md), the KV cells, the layer
# split and where the CPU's weights live (--mmap) ----------------------------------------------
# click parameter name -> EngineConfig field
EXPERT_OPTION_FIELDS = {
    "expert_cache": "expert_cache",
    "vram_budget": "vram_budget_bytes",
    "expert_pack": "expert_pack_path",
    "expert_profile": "expert_profile_path",
    "dump_routing": "dump_routing_path",
    "adapt_every": "adapt_every",
    "adapt_min_gain": "adapt_min_gain",
    "adapt_swaps": "adapt_swaps",
    "adapt_async": "adapt_async",
    "pcie_frac": "pcie_frac",
    "kv": "kv_type",
    "kv_grow": "kv_grow",
    "split_device": "split_devices",
    "layer_split": "layer_split",
    "batch_groups": "batch_groups",
    "mmap": "mmap",
}


def expert_options(command):
    """Add the expert-cache and tier options; the command receives them as one dict,
    `expert_config`, of EngineConfig keyword arguments (EngineConfig validates them)."""

    @functools.wraps(command)
    def with_expert_config(*args, **kwargs):
        config = {field: kwargs.pop(name) for name, field in EXPERT_OPTION_FIELDS.items()}
        config["adapt_async"] = bool(config["adapt_async"])
        return command(*args, expert_config=config, **kwargs)

    options = [
        click.option("--expert-cache", default=None, metavar="auto|N",
                     help="Expert cache slots (one routed expert each): N, or auto to fill "
                          "--vram-budget. Absent: no cache, experts are read from the model "
                          "(or --expert-pack) directly."),
        click.option("--vram-budget", default=None, metavar="SIZE",
                     help="Bytes the expert cache may use, e.g. 512M, 8G, 8GiB (powers of "
                          "1024; 8GB = 8*10^9)."),
        click.option("--expert-pack", default=None, metavar="PATH",
                     help="Serve the experts from this `strata-tool pack` file (refused when "
                          "it was written for another model)."),
        click.option("--expert-profile", default=None, metavar="FILE|auto",
                     help="Fill the cache at start-up from this routing profile "
                          "(`strata-tool profile`), hottest first; default: layer order. On "
                          "the GPU, prompt windows also leave the experts it shows as rarely "
                          "routed in RAM from the first prompt. auto: the profile Strata "
                          "stores for this model in its cache folder, updated from the "
                          "routing each run sees (written when the run ends)."),
        click.option("--dump-routing", default=None, metavar="FILE",
                     help="Record every window's routing (window, layer, expert, rows) to FILE "
                          "for `strata-tool profile`, `replay` and `inspect --routing`."),
        click.option("--adapt-every", default=4, show_default=True,
                     type=click.IntRange(min=0),
                     help="Windows between tier rounds (0 freezes the cache as filled)."),
        click.option("--adapt-min-gain", default=0.0, show_default=True,
                     type=click.FloatRange(min=0),
                     help="A swap's expected gain (routed rows per round for the default "
                          "policy) must exceed this."),
        click.option("--adapt-swaps", default=None, type=click.IntRange(min=1),
                     help="Most swaps per round (default: the tier policy's own, 64 for "
                          "decayed-count)."),
        click.option("--adapt-async", default=1, show_default=True, type=click.IntRange(0, 1),
                     help="1: a round's copies land while the next windows run; 0: they run "
                          "before the next window (blocking)."),
        click.option("--kv", default="auto", show_default=True, type=click.Choice(KV_TYPES),
                     help="KV cell type: auto (CPU f32, CUDA f16), f32, f16, or int8 (CUDA: "
                          "a scale per token and head, half of f16's memory)."),
        click.option("--kv-grow", default=None, metavar="auto|N",
                     help="Slots start with N KV cells (auto: --read-chunk's) and borrow "
                          "expert-cache slots for more while a request needs them, returned "
                          "and refilled when it ends (needs --expert-cache)."),
        click.option("--pcie-frac", default=None, type=PcieFrac(),
                     help="GPU with an expert cache: the share of each layer's missing "
                          "experts the GPU reads over PCIe in a decode window (the CPU pool "
                          "computes the rest); F fixes it. Default auto: start from the "
                          "`strata-tool calibrate` result for this model, GPU and threads, else "
                          "0.3, and move it while serving, from each window's timing (kept "
                          "with --adapt-every 0)."),
        click.option("--split-device", default=None, metavar="I,J",
                     help="Split the layers over these GPUs (stages in this order), each with "
                          "its own expert cache and tier; --vram-budget applies per card. "
                          "Without an expert option the experts stay in VRAM when the cards "
                          "hold them, else in RAM behind each card's cache (--expert-cache "
                          "auto)."),
        click.option("--layer-split", default=None, metavar="auto|K1,K2",
                     help="Layers per GPU of the split (auto: the split with the smallest "
                          "predicted decode time, printed at start); implies every visible "
                          "GPU when --split-device is not given."),
        click.option("--batch-groups", default="auto", show_default=True, metavar="auto|N",
                     help="Slot groups of a layer split whose decode windows are in flight "
                          "at once, pipelined over the stages (slot i in group i % N; auto: "
                          "min(GPUs, slots), one when pipelining would switch off a blocking "
                          "tier, a CPU pool asked for with --pcie-frac, or --spec-type "
                          "drafts)."),
        click.option("--mmap/--no-mmap", default=True, show_default=True,
                     help="On the CPU: compute from the model file's memory map, or (--no-mmap) "
                          "from a copy read into RAM in huge pages at start: decode ~7% faster "
                          "on an AMD EPYC, the same on a Xeon; refused when the memory is not "
                          "free. On a GPU the weights go to VRAM and pinned RAM anyway."),
    ]
    for option in reversed(options):
        with_expert_config = option(with_expert_config)
    return with_expert_config


# ---- speculative decoding without a draft model (strata.engine.drafts) ----------------------
def draft_options(command):
    """Add --spec-type, --draft-max, --draft-min and --spec-ngram-size-n (llama-server's
    names); the command receives them as one dict, `draft_config`, of EngineConfig keyword
    arguments."""

    @functools.wraps(command)
    def with_draft_config(*args, **kwargs):
        config = {name: kwargs.pop(name) for name in ("spec_type", "draft_max", "draft_min",
                                                      "spec_ngram_size_n")}
        return command(*args, draft_config=config, **kwargs)

    options = [
        click.option("--spec-type", default="none", show_default=True,
                     type=click.Choice(SPEC_TYPES),
                     help="Speculative decoding without a draft model. ngram-simple: each "
                          "decode window also reads the tokens that followed the last "
                          "earlier occurrence of the sequence's last --spec-ngram-size-n "
                          "tokens, and keeps those the sampler would have drawn anyway (the "
                          "output does not change). Pays where text repeats: code edits, "
                          "quoting, summaries."),
        click.option("--draft-max", "--draft", "--draft-n", "draft_max",
                     default=DEFAULT_DRAFT_MAX, show_default=True, type=click.IntRange(1),
                     help="Most draft tokens per slot and window (each request drafts as "
                          "many as its recent acceptance rate pays for, up to this)."),
        click.option("--draft-min", "--draft-n-min", "draft_min", default=0,
                     show_default=True, type=click.IntRange(0),
                     help="No draft shorter than this."),
        click.option("--spec-ngram-size-n", default=DEFAULT_NGRAM_SIZE, show_default=True,
                     type=click.IntRange(1),
                     help="Tokens of the lookup key (smaller: more drafts, fewer accepted)."),
    ]
    for option in reversed(options):
        with_draft_config = option(with_draft_config)
    return with_draft_config
