"""A GPT-style language model trained by its own loop in a swarm: AdamW, warmup + cosine decay,
gradient clipping, and a model that returns its outputs as a dataclass (as Hugging Face models
return theirs), with no dependency on transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import geotrain


@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class TinyGPT(nn.Module):
    """Byte-level: embedding, two causal self-attention blocks, a head tied to the embedding."""

    def __init__(self, width: int = 64, context: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> Output:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.blocks(self.embed(tokens) + self.position[:n], mask=mask, is_causal=True)
        logits = self.norm(h) @ self.embed.weight.T  # (batch, n, 256)
        loss = None
        if targets is not None:
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
        return Output(logits, loss)


def text_batches(seed: int, context: int = 32, batch: int = 16):
    """Batches of a small repetitive text (each node a different offset into it)."""
    text = (b"the quick brown fox jumps over the lazy dog. " * 200)
    data = torch.tensor(list(text), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        seqs = torch.stack([data[s : s + context + 1] for s in starts])
        yield seqs[:, :-1], seqs[:, 1:]


def train(swarm: geotrain.Swarm, model: TinyGPT, steps: int, seed: int) -> list[float]:
    """The script's own loop; returns its losses."""
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LinearLR(adamw, start_factor=0.05, total_iters=10)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=steps)
    schedule = torch.optim.lr_scheduler.SequentialLR(adamw, [warmup, cosine], milestones=[10])
    opt = swarm.wrap(adamw, schedule)
    losses = []
    batches = text_batches(seed)
    for _ in range(steps):
        tokens, targets = next(batches)
        out = model(tokens, targets)
        out.loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(loss=out.loss)
        opt.zero_grad()
        schedule.step()
        losses.append(float(out.loss.detach()))
    return losses
