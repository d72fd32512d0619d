"""A nanoGPT-style character language model trained by its own loop in a swarm: AdamW with
weight decay on the matrices only, linear warmup then cosine decay, gradient clipping and
gradient accumulation. The lines geotrain adds are marked `# geotrain`.

    geotrain local -n 3 -- python char_lm.py --steps 2000

Each peer trains on its own part of the text (GEOTRAIN_LOCAL_INDEX, as `geotrain local` sets
it). Pass --text FILE to train on your own text instead of the built-in one.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import geotrain  # geotrain

TEXT = """It is a truth universally acknowledged, that a single man in possession of a good
fortune, must be in want of a wife. However little known the feelings or views of such a man
may be on his first entering a neighbourhood, this truth is so well fixed in the minds of the
surrounding families, that he is considered the rightful property of some one or other of their
daughters. """ * 40


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, context: int = 64, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, 4) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (batch, n) -> (batch, n, vocab)
        n = idx.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        x = self.tokens(idx) + self.positions(torch.arange(n))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak (nanoGPT's get_lr), as a factor."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--text", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    text = args.text.read_text() if args.text else TEXT
    chars = sorted(set(text))  # (every peer must read the same text: the same vocabulary)
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    peer = int(os.environ.get("GEOTRAIN_LOCAL_INDEX", "0"))
    generator = torch.Generator().manual_seed(peer)  # each peer its own batches

    torch.manual_seed(0)  # (the same start everywhere; a late joiner takes the swarm's anyway)
    model = CharGPT(len(chars))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        adamw, lambda s: lr_at(s, args.lr, warmup=args.steps // 10 + 1, total=args.steps))

    with geotrain.join(model) as swarm:  # geotrain
        opt = swarm.wrap(adamw, schedule)  # geotrain: its step is the swarm's
        while swarm.step < args.steps:  # geotrain: a restart resumes at its checkpoint's step
            for _ in range(args.accumulate):
                starts = torch.randint(len(data) - model.context - 1, (args.batch,),
                                       generator=generator)
                x = torch.stack([data[s : s + model.context] for s in starts])
                y = torch.stack([data[s + 1 : s + 1 + model.context] for s in starts])
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.accumulate
                loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(loss=loss * args.accumulate)  # geotrain: loss= shows in `geotrain status`
            opt.zero_grad(set_to_none=True)
            schedule.step()
            if swarm.step % 100 == 0:
                print(f"step {swarm.step} loss {loss.item() * args.accumulate:.3f}")
        print(f"done: step {swarm.step} loss {loss.item() * args.accumulate:.3f}")


if __name__ == "__main__":
    main()
