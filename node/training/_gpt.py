# The `gpt` task: a GPT-style byte-level decoder written out (pre-norm blocks, causal
# self-attention, MLP, untied head) for the comparisons of geotrain with its baselines.
# Invariants: the vocabulary is the 256 byte values; the model, the held-out slice and every
# node's view of the corpus depend only on the params and the swarm seed; evaluation is
# deterministic (no dropout, the same fixed windows every time); the metric is the held-out
# cross-entropy in bits per byte, lower is better (8 is a uniform guess).
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ._corpus import stdlib_corpus
from ._recipe import Recipe
from ._tasks import Task, TaskContext, shard_indices

VOCAB = 256  # bytes


@dataclass(frozen=True)
class GPTSize:
    """A model shape. Parameters: 12 d_model^2 per block (attention 4, MLP 8) + small terms."""

    d_model: int
    layers: int
    heads: int
    lr: float  # AdamW's peak rate for this size (smaller models take larger steps)


# Named sizes (`training.params.size`), parameters at context 128 (measured: tests/test_gpt.py and
# docs/benchmarks.md). 1m's rate was measured (2e-3 as good as 3e-3 at batch 16 after
# 150 steps and without 3e-3's loss spike at batch 64, DDP's batch with 4 peers; 6e-3 and 1e-2
# worse); the larger sizes' shrink with width, as is usual, unmeasured.
SIZES: dict[str, GPTSize] = {
    "1m": GPTSize(d_model=128, layers=5, heads=4, lr=2e-3),  # 1,067,776 parameters
    "5m": GPTSize(d_model=256, layers=6, heads=8, lr=1.5e-3),  # 4,889,088
    "10m": GPTSize(d_model=384, layers=6, heads=6, lr=1.2e-3),  # 10,872,576
    "25m": GPTSize(d_model=512, layers=8, heads=8, lr=1e-3),  # 25,510,912
}
# How every size is trained, by default (the user's training.* settings win, see Recipe):
# AdamW with decoupled weight decay as in GPT-2/nanoGPT; a short warmup because runs here are
# hundreds of steps; cosine decay to 10% of the peak rate at total_steps, then flat, so a run
# longer than planned keeps learning; gradients clipped at a total norm of 1.
GPT_RECIPE = Recipe(
    optimizer="adamw", weight_decay=0.1, warmup_steps=20, schedule="cosine", total_steps=2000,
    min_lr_ratio=0.1, clip_grad_norm=1.0,
)  # fmt: skip


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position i sees positions <= i only."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)  # each (b, t, d)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, t, d/h)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model, bias=False),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A GPT-style decoder over bytes: (batch, t <= context) int64 -> (batch, t, 256) logits.

    Learned token and position embeddings, `layers` pre-norm blocks, a final LayerNorm and an
    untied output head (tying would save only 256 x d_model parameters with a byte vocabulary,
    and untied weights keep every parameter one tensor under one name for exchanges and
    checkpoints). Initialised as GPT-2: N(0, 0.02), the residual projections scaled down by
    sqrt(2 x layers).
    """

    def __init__(self, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(VOCAB, d_model)
        self.positions = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"{t} tokens: the model's context is {self.context}")
        # (batch, t): the batch stays the first dimension into every layer, as Opacus' per-sample
        # gradients need ([privacy]); the same sums as one (t,) lookup broadcast over the batch
        pos = torch.arange(t, device=tokens.device).expand(tokens.shape[0], t)
        h = self.tokens(tokens) + self.positions(pos)  # (batch, t, d_model)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _positive(ctx: TaskContext, name: str, default: int, at_least: int = 1) -> int:
    value = ctx.param(name, default, int)
    if value < at_least:
        raise ValueError(f"training.params.{name}={value!r}: expected an integer >= {at_least}")
    return value


def task_recipe(ctx: TaskContext) -> Recipe:
    """GPT_RECIPE with the task's warmup_steps / total_steps params, if given.

    Raises:
        ValueError: naming the training.params field that is wrong.
    """
    warmup = _positive(ctx, "warmup_steps", GPT_RECIPE.warmup_steps, at_least=0)
    total = _positive(ctx, "total_steps", GPT_RECIPE.total_steps)
    if total <= warmup:
        if "total_steps" in ctx.params:
            raise ValueError(f"training.params.total_steps={total!r}: expected more than "
                             f"warmup_steps ({warmup})")  # fmt: skip
        raise ValueError(f"training.params.warmup_steps={warmup!r}: expected fewer than "
                         f"total_steps ({total}, the default)")  # fmt: skip
    return dataclasses.replace(GPT_RECIPE, warmup_steps=warmup, total_steps=total)


def model_shape(ctx: TaskContext) -> tuple[GPTSize, int]:
    """The size (a named one, changed by explicit d_model / layers / heads) and the context.

    Raises:
        ValueError: naming the training.params field that is wrong.
    """
    size = ctx.param("size", "1m", str)
    if size not in SIZES:
        raise ValueError(f"training.params.size={size!r}: expected one of {sorted(SIZES)}")
    named = SIZES[size]
    d_model = _positive(ctx, "d_model", named.d_model)
    heads = _positive(ctx, "heads", named.heads)
    layers = _positive(ctx, "layers", named.layers)
    context = _positive(ctx, "context", 128, at_least=2)
    if d_model % heads:
        raise ValueError(f"training.params.heads={heads}: expected a divisor of d_model "
                         f"({d_model})")
    # an explicit shape keeps the named size's rate unless it is much wider (scale ~ 1/width)
    lr = named.lr * min(1.0, named.d_model / d_model)
    return GPTSize(d_model, layers, heads, lr), context


def _window_batches(
    text: torch.Tensor, starts: torch.Tensor, context: int, batch_size: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled batches of (input, next bytes), each (batch, context) int64, from the windows of
    context + 1 bytes at `starts` in `text` (uint8); a fresh seeded order each epoch."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(context + 1, device=text.device)
    while True:
        order = starts[torch.randperm(len(starts), generator=gen)]
        for first in range(0, len(order), batch_size):
            seqs = text[order[first : first + batch_size, None] + offsets].long()
            yield seqs[:, :-1], seqs[:, 1:]


def bits_per_byte(model: nn.Module, seqs: torch.Tensor, chunk: int = 16) -> float:
    """Mean next-byte cross-entropy of `model` over `seqs` ((n, context + 1) uint8), in bits."""
    total, count = 0.0, 0
    with torch.no_grad():
        for first in range(0, len(seqs), chunk):
            part = seqs[first : first + chunk].long()
            logits = model(part[:, :-1])
            total += float(nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), part[:, 1:].reshape(-1), reduction="sum"
            ))  # fmt: skip
            count += part[:, 1:].numel()
    return total / count / math.log(2)


def gpt(ctx: TaskContext) -> Task:
    """A GPT-style byte-level language model; metric: held-out loss in bits per byte (lower is
    better). Trained by GPT_RECIPE (AdamW, warmup + cosine, clipping) unless the config says
    otherwise.

    Params: size ("1m" default, "5m", "10m", "25m": see SIZES), d_model / layers / heads (override
    the size's), context (bytes of context, default 128), batch_size (windows per step, default
    16), corpus (a directory, default Python's standard library), files (a glob under it,
    default "*.py"), max_bytes (of corpus read, default 4,000,000), eval_windows (held-out
    windows evaluated, default 64), warmup_steps and total_steps (GPT_RECIPE's warmup and the step
    its cosine decay ends at: the testbed's baselines train by the task's recipe too, so these
    change every system's schedule alike, where a node's training.* settings change only the
    node's). The last 5% of the corpus is held out; the evaluation reads `eval_windows` windows
    of context + 1 bytes spread evenly over it, the same every time.
    """
    shape, context = model_shape(ctx)
    recipe = task_recipe(ctx)
    batch_size = _positive(ctx, "batch_size", 16)
    eval_windows = _positive(ctx, "eval_windows", 64)
    max_bytes = _positive(ctx, "max_bytes", 4_000_000, at_least=10_000)
    corpus = ctx.param("corpus", "", str) or None
    text = stdlib_corpus(max_bytes, corpus, ctx.param("files", "*.py", str))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    n_eval = max(len(data) // 20, context + 1)
    train, held_out = data[:-n_eval], data[-n_eval:]
    windows = (len(train) - 1) // context
    if windows < ctx.num_shards:
        raise ValueError(
            f"training.params.context={context}: the corpus's {len(train)} training bytes make "
            f"{windows} windows, fewer than the {ctx.num_shards} shards"
        )
    mine = shard_indices(np.zeros(windows, dtype=np.int64), ctx)
    starts = torch.from_numpy(mine * context).to(ctx.device)
    eval_starts = np.linspace(0, len(held_out) - context - 1, eval_windows).round().astype(np.int64)
    eval_seqs = held_out[torch.from_numpy(eval_starts)[:, None] + torch.arange(context + 1)]
    eval_seqs = eval_seqs.to(ctx.device)  # (eval_windows, context + 1) uint8
    torch.manual_seed(ctx.seed)
    model = GPT(context, shape.d_model, shape.layers, shape.heads).to(ctx.device)

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = m(batch[0])  # (batch, context, 256)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))

    return Task(
        model=model,
        batches=_window_batches(
            train.to(ctx.device), starts, context, batch_size, ctx.seed * 1000 + ctx.shard_index
        ),
        loss=loss,
        evaluate=lambda m: bits_per_byte(m, eval_seqs),
        metric="bits_per_byte",
        higher_is_better=False,
        # measured with 1m (docs/benchmarks.md): one model alone is at ~4.1 after 100 steps and ~3.4
        # after 300; 4 geotrain peers on 2 shared cores (~0.7 steps/s each) were at 4.14 after
        # 94 s, so 4.0 is a couple of minutes' work for a few peers here
        default_target=4.0,
        lr=shape.lr,
        train_size=len(mine),
        recipe=recipe,
    )
