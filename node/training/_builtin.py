# The built-in tasks. Invariants: data is generated or shipped (nothing is downloaded); the held-out
# evaluation set and the model initialisation depend only on the swarm seed, never on the node.
from __future__ import annotations

import gzip
import math
from collections.abc import Iterator
from importlib import resources

import numpy as np
import torch
from torch import nn

from ._corpus import stdlib_corpus
from ._gpt import gpt
from ._tasks import Task, TaskContext, TaskFunction, endless_batches, shard_indices

DIGITS_ROWS, DIGITS_COLS = 1797, 65  # label + 8x8 pixels, see data/DIGITS-LICENSE.txt


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The shipped 8x8 digits: (images (1797, 64) float32 in [0, 1], labels (1797,) int64)."""
    raw = gzip.decompress(resources.files(__package__).joinpath("data/digits.u8.gz").read_bytes())
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(DIGITS_ROWS, DIGITS_COLS)
    return rows[:, 1:].astype(np.float32) / 16.0, rows[:, 0].astype(np.int64)


def _split_eval(n: int, seed: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed + 7919).permutation(n)
    n_eval = int(n * fraction)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=-1) == y).float().mean())


Batch = tuple[torch.Tensor, torch.Tensor]


def _classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def digits_mlp(ctx: TaskContext) -> Task:
    """An MLP on the 8x8 digits; 20% held out for evaluation (same on every node).

    Params: hidden (width, default 64), layers (hidden layers, default 1), batch_size (default 32).
    `hidden=1024, layers=2` gives a model of about 1.1M parameters, where communication matters.
    """
    hidden = ctx.param("hidden", 64, int, at_least=1)
    layers = ctx.param("layers", 1, int, at_least=0)  # 0: a linear model
    batch_size = ctx.param("batch_size", 32, int, at_least=1)
    images, labels = load_digits()
    train, held_out = _split_eval(len(labels), ctx.seed, 0.2)
    mine = train[shard_indices(labels[train], ctx)]
    torch.manual_seed(ctx.seed)
    widths = [64] + [hidden] * layers
    blocks: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        blocks += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(widths[-1], 10)).to(ctx.device)
    x = torch.from_numpy(images).to(ctx.device)
    y = torch.from_numpy(labels).to(ctx.device)
    x_eval, y_eval = x[held_out], y[held_out]
    return Task(
        model=model,
        batches=endless_batches(x[mine], y[mine], batch_size, ctx.seed * 1000 + ctx.shard_index),
        loss=_classification_loss,
        evaluate=lambda m: _accuracy(m, x_eval, y_eval),
        metric="accuracy",
        default_target=0.9,
        lr=0.05,
        train_size=len(mine),
    )


def synthetic_linreg(ctx: TaskContext) -> Task:
    """Linear regression on generated data, y = x·w* + noise (std 0.1). Fast, for tests.

    Params: features (default 32), samples (default 4096), batch_size (default 32). The metric is
    the held-out mean squared error; the noise floor is 0.01.
    """
    features = ctx.param("features", 32, int, at_least=1)
    samples = ctx.param("samples", 4096, int, at_least=1)
    batch_size = ctx.param("batch_size", 32, int, at_least=1)
    gen = torch.Generator().manual_seed(ctx.seed)
    w_star = torch.randn(features, 1, generator=gen)
    x = torch.randn(samples, features, generator=gen)
    y = x @ w_star + 0.1 * torch.randn(samples, 1, generator=gen)
    train, held_out = _split_eval(samples, ctx.seed, 0.2)
    mine = train[shard_indices(np.zeros(len(train), dtype=np.int64), ctx)]
    torch.manual_seed(ctx.seed)
    model = nn.Linear(features, 1).to(ctx.device)
    x, y = x.to(ctx.device), y.to(ctx.device)
    x_eval, y_eval = x[held_out], y[held_out]

    def mse(m: nn.Module) -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(m(x_eval), y_eval))

    return Task(
        model=model,
        batches=endless_batches(x[mine], y[mine], batch_size, ctx.seed * 1000 + ctx.shard_index),
        loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
        evaluate=mse,
        metric="mse",
        higher_is_better=False,
        default_target=0.02,
        lr=0.05,
        train_size=len(mine),
    )


class CharTransformer(nn.Module):
    """A small causal transformer over bytes: (batch, context) int64 -> (batch, context, 256)."""

    def __init__(self, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        self.position = nn.Parameter(torch.zeros(context, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 256)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.position[:t]  # (batch, t, d_model)
        h = self.blocks(h, mask=self.causal[:t, :t], is_causal=True)
        return self.head(h)


def charlm(ctx: TaskContext) -> Task:
    """A small byte-level transformer language model; metric: next-byte accuracy on held-out text.

    Params: corpus (a directory of .py files, default the stdlib), max_bytes (default 2,000,000),
    context (default 64), d_model (default 128), layers (default 2), heads (default 4),
    batch_size (default 32). The last 5% of the corpus is held out for evaluation.
    """
    context = ctx.param("context", 64, int, at_least=1)
    batch_size = ctx.param("batch_size", 32, int, at_least=1)
    corpus = ctx.param("corpus", "", str) or None
    text = stdlib_corpus(ctx.param("max_bytes", 2_000_000, int, at_least=1), corpus)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n_eval = max(len(data) // 20, context + 1)
    train, held_out = data[:-n_eval], data[-n_eval:]
    windows = (len(train) - 1) // context
    starts = np.arange(windows) * context
    mine = torch.from_numpy(starts[shard_indices(np.zeros(windows, dtype=np.int64), ctx)])
    offsets = torch.arange(context + 1)
    seqs = train[mine[:, None] + offsets].to(ctx.device)  # (my windows, context + 1)
    eval_starts = torch.arange(0, len(held_out) - context - 1, context)[:256]
    eval_seqs = held_out[eval_starts[:, None] + offsets].to(ctx.device)
    torch.manual_seed(ctx.seed)
    d_model = ctx.param("d_model", 128, int, at_least=1)
    heads = ctx.param("heads", 4, int, at_least=1)
    layers = ctx.param("layers", 2, int, at_least=0)
    model = CharTransformer(context, d_model, layers, heads).to(ctx.device)

    shard_seed = ctx.seed * 1000 + ctx.shard_index

    def loss(m: nn.Module, batch: Batch) -> torch.Tensor:
        logits = m(batch[0])
        return nn.functional.cross_entropy(logits.reshape(-1, 256), batch[1].reshape(-1))

    def evaluate(m: nn.Module) -> float:
        with torch.no_grad():
            pred = m(eval_seqs[:, :-1]).argmax(dim=-1)
            return float((pred == eval_seqs[:, 1:]).float().mean())

    return Task(
        model=model,
        batches=endless_batches(seqs[:, :-1], seqs[:, 1:], batch_size, shard_seed),
        loss=loss,
        evaluate=evaluate,
        metric="next_byte_accuracy",
        default_target=0.5,
        lr=0.003,
    )


def _random_batches(
    width: int, batch_size: int, seed: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(batch_size, width, generator=gen).to(device)
        yield x, x


def wide_linear(ctx: TaskContext) -> Task:
    """A model of real size for memory and streaming checks: one square linear layer (no bias)
    learning the identity on random inputs, generated batch by batch (no data is held).

    Params: millions (parameters, in millions; default 100: a 10,000 x 10,000 weight of 400 MB in
    float32), batch_size (default 8). The metric is the held-out mean squared error (1.33 at the
    start, 0 when learned); one step costs about 6 x batch_size x parameters floating-point ops.
    """
    millions = ctx.param("millions", 100.0, float)
    batch_size = ctx.param("batch_size", 8, int, at_least=1)
    if not 1e-6 <= millions <= 1e5:
        raise ValueError(f"training.params.millions={millions!r}: expected 1e-6..1e5")
    width = max(1, round(math.sqrt(millions * 1e6)))
    torch.manual_seed(ctx.seed)
    model = nn.Linear(width, width, bias=False).to(ctx.device)
    x_eval = torch.randn(64, width, generator=torch.Generator().manual_seed(ctx.seed + 1))
    x_eval = x_eval.to(ctx.device)

    def mse(m: nn.Module) -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(m(x_eval), x_eval))

    return Task(
        model=model,
        batches=_random_batches(width, batch_size, ctx.seed * 1000 + ctx.shard_index, ctx.device),
        loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
        evaluate=mse,
        metric="mse",
        higher_is_better=False,
        default_target=0.5,
        lr=0.5,  # a step moves W along each input x by about 2 lr / batch_size: stable below 1
    )


BUILTIN_TASKS: dict[str, TaskFunction] = {
    "digits-mlp": digits_mlp,
    "synthetic-linreg": synthetic_linreg,
    "charlm": charlm,
    "wide-linear": wide_linear,
    "gpt": gpt,
}
