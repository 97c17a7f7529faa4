"""How well can a prompt window's experts be known one layer ahead? (docs/offload.md, what is
left against pp512's goal, after "Heavily routed rare experts are pulled into staging").

Runs transformers (CPU) on a MoE GGUF over windows of random tokens, as `strata bench` prompts
are, and compares, per window and layer l + 1, the experts the window routes to (A, with their
rows) against two guesses that a streamed window could act on before layer l + 1's routing:

- counts: the streamer's rule (stream.rare_experts at a reach cost) on the decayed counts of the
  windows before;
- ahead-k: the union over the window's rows of the top-k experts of layer l + 1's router applied
  to layer l's residual after its attention, normed with layer l + 1's norm (known right after
  layer l's attention, while layer l's copies still run); with a floor of m rows: only experts
  at least m rows name.

For each guess G it prints, averaged over windows and layers: |G|, |G & A|, the share of routed
pairs whose expert is in G, and how many routed experts outside G have more than 4 / 16 / 64
rows. Usage: python tools/predict_routing.py MODEL.gguf --windows 6 --rows 512.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch


def load(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from strata.model.gguf_file import GGUFModel

    spec = GGUFModel.open(path).spec
    cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    cfg.moe_intermediate_size = spec.expert_ffn
    cfg.norm_topk_prob = spec.norm_topk
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=cfg,
                                                 dtype=torch.bfloat16)
    return model.eval(), spec


def residuals(model, tokens: np.ndarray) -> list[torch.Tensor]:
    """[L] of [T, H]: each layer's residual after its attention (the input of its FFN norm)."""
    out: list[torch.Tensor] = []
    hooks = [layer.post_attention_layernorm.register_forward_pre_hook(
        lambda _m, args: out.append(args[0][0].float())) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.from_numpy(tokens[None].astype(np.int64)), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out


def router_logits(model, layer: int, resid: torch.Tensor) -> torch.Tensor:
    """[T, E] layer `layer`'s router on its FFN norm of `resid` [T, H]."""
    block = model.model.layers[layer]
    with torch.no_grad():
        x = block.post_attention_layernorm(resid.to(torch.bfloat16)).float()
        return x @ block.mlp.gate.weight.float().T


def rows_of(logits: torch.Tensor, k: int, num_experts: int) -> np.ndarray:
    """[E] rows per expert of the top-k of `logits` [T, E]."""
    top = torch.topk(logits, k, dim=1).indices.numpy().ravel()
    return np.bincount(top, minlength=num_experts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ahead", default="8:1,8:2,12:1,12:2,16:2",
                    help="guesses k:m (top-k of the next router, experts at least m rows name)")
    ap.add_argument("--reach-cost", type=float, default=1.05)
    args = ap.parse_args()

    from strata.backends.cuda.stream import decay_counts, rare_experts

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, spec = load(args.model)
    L, E, K = spec.n_layers, spec.n_experts, spec.n_experts_used
    rng = np.random.default_rng(args.seed)
    guesses = [tuple(int(v) for v in g.split(":")) for g in args.ahead.split(",")]
    names = ["counts"] + [f"ahead-{k} (>= {m} rows)" for k, m in guesses]
    # per (window, layer): |G|, |G & A|, covered pairs, missed experts of > 4 / 16 / 64 rows
    stats = {n: [] for n in names}
    routed_sets, counts = [], np.zeros((L, E))
    for w in range(args.windows):
        tokens = rng.integers(0, spec.vocab, args.rows, dtype=np.int32)
        resid = residuals(model, tokens)
        actual = np.stack([rows_of(router_logits(model, ly, resid[ly]), K, E) for ly in range(L)])
        routed_sets.append((actual > 0).sum(axis=1).mean())
        copied = ~rare_experts(np.full((L, E), -1), counts, args.rows, K, args.reach_cost)
        for ly in range(L - 1):
            a = actual[ly + 1]
            guess = {"counts": copied[ly + 1]}
            for (k, m), name in zip(guesses, names[1:]):
                guess[name] = rows_of(router_logits(model, ly + 1, resid[ly]), k, E) >= m
            for name, g in guess.items():
                missed = a * ~g
                stats[name].append((g.sum(), (g & (a > 0)).sum(), (a * g).sum() / a.sum(),
                                    (missed > 4).sum(), (missed > 16).sum(), (missed > 64).sum()))
        decay_counts(counts, actual.astype(np.float64), K)
        print(f"window {w}: routed experts per layer {routed_sets[-1]:.1f} of {E}", flush=True)
    print(f"\n{args.windows} windows of {args.rows} random tokens, layers 1..{L - 1}; "
          "the counts' first window has no counts (copies every expert)")
    print(f"{'guess':<22} {'|G|':>6} {'|G&A|':>6} {'pairs in G':>10} "
          f"{'missed >4':>9} {'>16':>5} {'>64':>5}")
    for name in names:
        s = np.array(stats[name], dtype=np.float64)
        if name == "counts":
            s = s[L - 1:]  # from the second window
        m = s.mean(axis=0)
        print(f"{name:<22} {m[0]:6.1f} {m[1]:6.1f} {m[2]:10.3f} {m[3]:9.2f} {m[4]:5.2f} "
              f"{m[5]:5.2f}")


if __name__ == "__main__":
    main()
