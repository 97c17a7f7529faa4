"""Train Strata's default model (`strata/data/default-model.gguf`): a small qwen3moe that answers
questions about Python in plain English, trained on Python's own documentation (PSF licence).

1. Here (the corpus depends on the Python version; the shipped model used CPython 3.11.7):
   `python tools/train_default_model.py prepare --data-dir .train` (corpus, BPE, token ids; ~1 min).
2. On the GPU machine (device tool, carry [".device", ".train"]), the shipped run:
   `export STRATA_DEVICE_NO_BUILD=1; source .device/setup.sh; PYTHONPATH=src:$PYTHONPATH python3
   tools/train_default_model.py train --data-dir .train --device cuda --budget-s 120
   --out $OUT/default-model.gguf --checkpoint $OUT/ckpt.pt` took 171 s of device time on an H200
   (machine start included): 94 ms per step, 1276 steps in 120 s. `--budget-s` times the first
   steps and picks the step count (printed and stored in the GGUF); `--steps 1276` repeats it
   exactly (seeded, deterministic kernels; same hardware and versions give the same weights).
   `--device cpu` works too (hours; `--shape smoke --steps 20` is a quick check).
3. `write --checkpoint ckpt.pt --out model.gguf` rewrites the GGUF from a saved checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import LlamaFileType  # noqa: E402
from gguf.quants import quantize  # noqa: E402
from torch import nn  # noqa: E402

from strata.model.arch import ModelSpec, expected_tensors  # noqa: E402
from strata.model.writer import write_gguf  # noqa: E402

SHAPES = {
    # 6 layers, 16 experts top-4 of width 128: ~15.7 MB with F16 attention/embeddings and Q8_0
    # experts and head.
    "default": ModelSpec(arch="qwen3moe", n_layers=6, hidden=256, n_heads=4, n_kv_heads=2,
                         head_dim=64, n_experts=16, n_experts_used=4, expert_ffn=128,
                         vocab=4096, context_length=1024, rope_theta=10000.0),
    "smoke": ModelSpec(arch="qwen3moe", n_layers=2, hidden=64, n_heads=2, n_kv_heads=1,
                       head_dim=32, n_experts=8, n_experts_used=2, expert_ffn=32, vocab=4096,
                       context_length=256, rope_theta=10000.0),
}
AUX_LOSS_COEF = 0.01  # Switch-style load balancing, so no expert is left unused
SAMPLE_QUESTION = "What is the for statement?"


# ---------------------------------------------------------------- the model (HF Qwen3-MoE math)
# B = batch, T = tokens, H = hidden, E = experts, F = expert width, D = head dim

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.s = s
        self.wq = nn.Linear(s.hidden, s.q_dim, bias=False)
        self.wk = nn.Linear(s.hidden, s.kv_dim, bias=False)
        self.wv = nn.Linear(s.hidden, s.kv_dim, bias=False)
        self.wo = nn.Linear(s.q_dim, s.hidden, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_eps)
        self.k_norm = RMSNorm(s.head_dim, s.rms_eps)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        s = self.s
        q = self.q_norm(self.wq(x).view(B, T, s.n_heads, s.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(B, T, s.n_kv_heads, s.head_dim)).transpose(1, 2)
        v = self.wv(x).view(B, T, s.n_kv_heads, s.head_dim).transpose(1, 2)  # [B, h, T, D]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = s.n_heads // s.n_kv_heads  # each KV head serves `rep` consecutive query heads
        k = k[:, :, None].expand(B, s.n_kv_heads, rep, T, s.head_dim).reshape(q.shape)
        v = v[:, :, None].expand(B, s.n_kv_heads, rep, T, s.head_dim).reshape(q.shape)
        # Plain softmax attention, not a fused kernel: its backward is deterministic.
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(s.head_dim)  # [B, h, T, T]
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1).to(v.dtype)
        out = (probs @ v).transpose(1, 2).reshape(B, T, s.q_dim)
        return self.wo(out)


class MoE(nn.Module):
    """Top-k routed experts. Every expert runs on every row and the unchosen ones get weight 0:
    the same values and gradients as sparse dispatch, with no scatter (deterministic) and
    dense batched products (fast for experts this small)."""

    def __init__(self, s: ModelSpec):
        super().__init__()
        self.s = s
        self.router = nn.Linear(s.hidden, s.n_experts, bias=False)
        self.gate = nn.Parameter(torch.empty(s.n_experts, s.expert_ffn, s.hidden))
        self.up = nn.Parameter(torch.empty(s.n_experts, s.expert_ffn, s.hidden))
        self.down = nn.Parameter(torch.empty(s.n_experts, s.hidden, s.expert_ffn))

    def forward(self, x):
        B, T, H = x.shape
        rows = x.reshape(B * T, H)  # [N, H]
        probs = F.linear(rows.float(), self.router.weight.float()).softmax(-1)  # [N, E]
        kth = probs.topk(self.s.n_experts_used, dim=-1).values[:, -1:]  # [N, 1]
        chosen = probs >= kth
        weights = probs * chosen
        weights = weights / weights.sum(-1, keepdim=True)  # normalised top-k
        g = torch.matmul(rows, self.gate.to(rows.dtype).transpose(1, 2))  # [E, N, F]
        u = torch.matmul(rows, self.up.to(rows.dtype).transpose(1, 2))
        y = torch.matmul(F.silu(g) * u, self.down.to(rows.dtype).transpose(1, 2))  # [E, N, H]
        out = torch.einsum("enh,ne->nh", y, weights.to(y.dtype))
        # Switch aux loss: E * sum_e (share of routed entries to e) * (mean probability of e).
        share = chosen.float().mean(0) / self.s.n_experts_used
        aux = self.s.n_experts * (share * probs.mean(0)).sum()
        return out.view(B, T, H), aux


class Block(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(s.hidden, s.rms_eps), Attention(s)
        self.ffn_norm, self.moe = RMSNorm(s.hidden, s.rms_eps), MoE(s)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        moe_out, aux = self.moe(self.ffn_norm(x))
        return x + moe_out, aux


class TinyQwen3Moe(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.n_layers))
        self.norm = RMSNorm(s.hidden, s.rms_eps)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        std, out_std = 0.02, 0.02 / math.sqrt(2 * s.n_layers)
        for name, p in self.named_parameters():
            if "norm" in name:
                continue
            is_output = name.endswith(("wo.weight", "down"))
            nn.init.normal_(p, std=out_std if is_output else std)

    def forward(self, tokens):  # tokens [B, T] -> logits [B, T, V], aux loss
        T = tokens.shape[1]
        freqs = torch.outer(torch.arange(T, device=tokens.device).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.embed(tokens)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        aux_total = 0.0
        for block in self.blocks:
            x, aux = block(x, cos, sin, mask)
            aux_total = aux_total + aux
        return self.head(self.norm(x)), aux_total / len(self.blocks)


# ---------------------------------------------------------------- data

def prepare(data_dir: Path) -> dict:
    """Build the corpus and tokenizer of this Python; save them and the token ids in data_dir."""
    from default_model_corpus import build_corpus, train_tokenizer

    data_dir.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus()
    tok = train_tokenizer(corpus)
    eot = tok.token_to_id("<|endoftext|>")
    ids, starts = [], []
    for enc in tok.encode_batch(corpus.documents, add_special_tokens=False):
        starts.append(sum(len(x) for x in ids))
        ids.append(np.array(enc.ids + [eot], dtype=np.uint16))
    tokens = np.concatenate(ids)
    np.savez(data_dir / "tokens.npz", tokens=tokens, doc_starts=np.array(starts, np.int64),
             num_plain_docs=len(corpus.plain))
    (data_dir / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    info = {"python_version": corpus.python_version, "sha256": corpus.sha256,
            "num_plain_docs": len(corpus.plain), "num_chat_docs": len(corpus.chat),
            "num_chars": sum(len(d) for d in corpus.documents), "num_tokens": int(len(tokens))}
    (data_dir / "corpus.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    print(f"corpus: {info}", flush=True)
    return info


def batches(tokens: torch.Tensor, doc_starts: torch.Tensor, batch: int, seq: int, seed: int):
    """Endless [B, seq + 1] windows: half start at a document's first token (as a prompt does
    at inference), half at any token. One seeded CPU generator: the same batches everywhere."""
    gen = torch.Generator().manual_seed(seed)
    num_doc = batch // 2
    limit = len(tokens) - seq - 1
    while True:
        docs = doc_starts[torch.randint(len(doc_starts), (num_doc,), generator=gen)]
        anywhere = torch.randint(limit, (batch - num_doc,), generator=gen)
        starts = torch.cat([docs.clamp(max=limit), anywhere])
        yield torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])


# ---------------------------------------------------------------- training

def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(args) -> None:
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)  # a warning names any exception
    device = torch.device(args.device)
    if not (args.data_dir / "tokens.npz").is_file():
        prepare(args.data_dir)
    corpus = json.loads((args.data_dir / "corpus.json").read_text())
    data = np.load(args.data_dir / "tokens.npz")
    tokens = torch.from_numpy(data["tokens"].astype(np.int64))
    doc_starts = torch.from_numpy(data["doc_starts"])
    spec = SHAPES[args.shape]
    seq = min(args.seq, spec.context_length)
    model = TinyQwen3Moe(spec).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f} M parameters, corpus {len(tokens)} tokens, "
          f"device {device}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    stream = batches(tokens, doc_starts, args.batch, seq, args.seed)
    total = args.steps or 10**9
    num_timed, t_timed = 10, 0.0
    bar = tqdm(total=args.steps or None, mininterval=5.0, desc="training")
    t_start = time.perf_counter()
    step = 0
    while step < total:
        batch = next(stream).to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.lr)
        with autocast:
            logits, aux = model(batch[:, :-1])
            # Cross-entropy by hand: CUDA's NLLLoss has no deterministic mode.
            logp = logits.float().log_softmax(-1)  # [B, T, V]
            lm_loss = -logp.gather(-1, batch[:, 1:, None]).mean()
        loss = lm_loss + AUX_LOSS_COEF * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 3 or step == 3 + num_timed:  # steps 3..12 time the steady state
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_timed = time.perf_counter() - t_timed
        if step == 3 + num_timed and not args.steps:
            per_step = t_timed / num_timed
            total = max(step, int(args.budget_s / per_step))
            bar.total = total
            print(f"\n{per_step * 1e3:.1f} ms per step: {total} steps fit {args.budget_s} s "
                  f"(reproduce with --steps {total})", flush=True)
        bar.update(1)
        if not args.steps and time.perf_counter() - t_start > 1.5 * args.budget_s:
            print(f"\nstopped at step {step}: over 1.5x the budget", flush=True)
            total = step  # the GGUF records the steps actually run
        if step % 100 == 0 or step == total:
            bar.set_postfix(loss=f"{lm_loss.item():.3f}", aux=f"{aux.item():.3f}")
    bar.close()
    seconds = time.perf_counter() - t_start
    print(f"trained {total} steps ({total * args.batch * seq / 1e6:.1f} M tokens) in "
          f"{seconds:.0f} s; final loss {lm_loss.item():.3f}", flush=True)
    if device.type == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    model = model.float().cpu().eval()
    if args.checkpoint:
        torch.save({"spec": spec.as_dict(), "corpus": corpus, "seed": args.seed, "steps": total,
                    "state": {k: v.half() for k, v in model.state_dict().items()}},
                   args.checkpoint)
    tok_json = (args.data_dir / "tokenizer.json").read_text(encoding="utf-8")
    print("sample:", greedy_answer(model, tok_json, SAMPLE_QUESTION), flush=True)
    size = write_model(args.out, model, spec, tok_json, corpus,
                       {"strata.train.seed": args.seed, "strata.train.steps": total,
                        "strata.train.batch_tokens": args.batch * seq})
    print(f"wrote {args.out}: {size} bytes", flush=True)


@torch.no_grad()
def greedy_answer(model: TinyQwen3Moe, tok_json: str, question: str, max_tokens: int = 60):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt, add_special_tokens=False).ids
    end = tok.token_to_id("<|im_end|>")
    out = []
    for _ in range(max_tokens):
        logits, _ = model(torch.tensor([ids + out]))
        out.append(int(logits[0, -1].argmax()))
        if out[-1] == end:
            break
    return tok.decode(out, skip_special_tokens=False)


# ---------------------------------------------------------------- the GGUF

def gguf_tensors(model: TinyQwen3Moe, spec: ModelSpec):
    """(name, type, data) in llama.cpp's order: F32 norms and routers, F16 embeddings and
    attention, Q8_0 experts and head."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
             "output.weight": "head.weight"}
    per_layer = {"attn_norm.weight": "attn_norm.weight", "attn_q.weight": "attn.wq.weight",
                 "attn_k.weight": "attn.wk.weight", "attn_v.weight": "attn.wv.weight",
                 "attn_output.weight": "attn.wo.weight", "attn_q_norm.weight": "attn.q_norm.weight",
                 "attn_k_norm.weight": "attn.k_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
                 "ffn_gate_inp.weight": "moe.router.weight", "ffn_gate_exps.weight": "moe.gate",
                 "ffn_up_exps.weight": "moe.up", "ffn_down_exps.weight": "moe.down"}
    for i in range(spec.n_layers):
        names.update({f"blk.{i}.{g}": f"blocks.{i}.{t}" for g, t in per_layer.items()})
    order = [n for n in expected_tensors(spec) if n not in ("output_norm.weight", "output.weight")]
    out = []
    for name in order + ["output_norm.weight", "output.weight"]:
        value = np.ascontiguousarray(sd[names[name]], dtype=np.float32)
        if "norm" in name or name.endswith("ffn_gate_inp.weight"):
            out.append((name, QT.F32, value))
        elif name.endswith("_exps.weight") or name == "output.weight":
            out.append((name, QT.Q8_0, quantize(value, QT.Q8_0)))
        else:
            out.append((name, QT.F16, value.astype(np.float16)))
    return out


def write_model(path, model: TinyQwen3Moe, spec: ModelSpec, tok_json: str, corpus: dict,
                train_meta: dict) -> int:
    from tokenizers import Tokenizer

    from default_model_corpus import tokenizer_meta

    extra = {
        "general.file_type": int(LlamaFileType.MOSTLY_Q8_0), "general.quantization_version": 2,
        "general.description": "Strata's default model: a small qwen3moe trained on Python's "
                               "own documentation (tools/train_default_model.py)",
        "general.license": "MIT",
        "general.corpus.name": "pydoc_data.topics and stdlib docstrings of CPython",
        "general.corpus.license": "PSF-2.0",
        "general.corpus.python_version": corpus["python_version"],
        "general.corpus.sha256": corpus["sha256"],
        "general.corpus.num_tokens": int(corpus["num_tokens"]),
        **train_meta,
    }
    meta = tokenizer_meta(Tokenizer.from_str(tok_json))
    return write_gguf(path, spec, gguf_tensors(model, spec), meta, extra_meta=extra,
                      name="strata-default-model")


def write_from_checkpoint(args) -> None:
    ckpt = torch.load(args.checkpoint, map_location="cpu")
    spec = ModelSpec(**ckpt["spec"])
    model = TinyQwen3Moe(spec)
    model.load_state_dict({k: v.float() for k, v in ckpt["state"].items()})
    tok_json = (args.data_dir / "tokenizer.json").read_text(encoding="utf-8")
    size = write_model(args.out, model.eval(), spec, tok_json, ckpt["corpus"],
                       {"strata.train.seed": ckpt["seed"], "strata.train.steps": ckpt["steps"]})
    print(f"wrote {args.out}: {size} bytes", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=("prepare", "train", "write"))
    p.add_argument("--data-dir", type=Path, default=Path(".train"))
    p.add_argument("--out", type=Path, default=Path("default-model.gguf"))
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="train: save the fp16 weights here; write: read them from here")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--shape", default="default", choices=sorted(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="0: as many as --budget-s allows")
    p.add_argument("--budget-s", type=float, default=130.0)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args(argv)
    if args.stage == "prepare":
        prepare(args.data_dir)
    elif args.stage == "train":
        train(args)
    else:
        write_from_checkpoint(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
