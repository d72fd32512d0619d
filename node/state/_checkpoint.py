# Checkpoints. Invariants: a checkpoint file is written whole or not at all (temp file, fsync,
# rename, fsync of the directory); loading never unpickles anything (safetensors for tensors, JSON
# for the rest); a file whose bytes do not match the SHA-256 recorded inside it is skipped, and the
# previous checkpoint is used instead.
from __future__ import annotations

import hashlib
import io
import json
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import safetensors.torch
import torch

from ._files import write_atomically

FORMAT = "geotrain-checkpoint/1"
_NAME = re.compile(r"^ckpt-(\d{10})\.safetensors$")
MAX_HEADER_BYTES = 64 * 1024 * 1024


class CheckpointError(Exception):
    """A checkpoint file is partial, corrupt or of another format; the message says which."""


@dataclass
class Checkpoint:
    """What a node saves: tensors by name plus JSON-able metadata.

    Attributes:
        step: the local training step the checkpoint was taken at.
        algorithm: the gossip algorithm the state belongs to (restarting with another is an error).
        tensors: name -> CPU tensor, e.g. "model/0.weight", "optim/3/momentum_buffer", "ef/...".
        meta: anything JSON can hold: optimizer scalars, link estimates, counters.
    """

    step: int
    algorithm: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


PIECE_BYTES = 8 * 2**20  # a tensor on a device comes to the host this much at a time


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous() or flat.device.type != "cpu":
        flat = flat.cpu().contiguous()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _pieces(t: torch.Tensor, host: list[torch.Tensor]) -> Iterator[memoryview]:
    """A tensor's bytes in order: a CPU tensor's own memory (one view), a device tensor's through
    one host buffer of PIECE_BYTES (`host`: [] or that buffer, made on first use and reused),
    so a checkpoint of a model on a GPU never holds a host copy of a whole tensor. Each piece
    is valid until the next is asked for."""
    if t.device.type == "cpu":
        yield _raw(t)
        return
    flat = t.detach().reshape(-1).contiguous().view(torch.uint8)  # (on the device)
    if not host:
        host.append(torch.empty(PIECE_BYTES, dtype=torch.uint8,
                                pin_memory=torch.cuda.is_available()))  # fmt: skip
    buffer = host[0]
    for start in range(0, flat.numel(), PIECE_BYTES):
        part = flat[start : start + PIECE_BYTES]
        buffer[: part.numel()].copy_(part)
        yield memoryview(buffer[: part.numel()].numpy())


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    host: list[torch.Tensor] = []
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
        for piece in _pieces(t, host):
            h.update(piece)
    return h.hexdigest()


def _header(ckpt: Checkpoint) -> tuple[bytes, list[str]]:
    """The safetensors header (8-byte length, JSON padded to 8) and the tensors' order."""
    names = sorted(ckpt.tensors)
    info = {
        "format": FORMAT, "step": ckpt.step, "algorithm": ckpt.algorithm,
        "sha256": _digest(ckpt.tensors), "meta": ckpt.meta,
    }  # fmt: skip
    header: dict[str, Any] = {"__metadata__": {"geotrain": json.dumps(info)}}
    offset = 0
    for name in names:
        t = ckpt.tensors[name]
        if t.dtype not in _DTYPES:
            raise ValueError(f"checkpoint tensor {name!r}: dtype {t.dtype} is not supported")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, names


def write_checkpoint(f: BinaryIO, ckpt: Checkpoint) -> None:
    """Write `ckpt` as a safetensors file to `f`, tensor by tensor from their own memory (no copy
    of the whole is made; the caller keeps the tensors unchanged meanwhile)."""
    header, names = _header(ckpt)
    f.write(header)
    host: list[torch.Tensor] = []
    for name in names:
        for piece in _pieces(ckpt.tensors[name], host):
            f.write(piece)


def encode_checkpoint(ckpt: Checkpoint) -> bytes:
    buffer = io.BytesIO()
    write_checkpoint(buffer, ckpt)
    return buffer.getvalue()


def _verified(info: Any, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"format is not {FORMAT}")
    try:
        digest = _digest(tensors)
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(f"unreadable tensor: {exc}") from exc
    if digest != info.get("sha256"):
        raise CheckpointError("tensor bytes do not match the recorded SHA-256")
    step, algorithm = info.get("step"), info.get("algorithm")
    if not isinstance(step, int) or not isinstance(algorithm, str):
        raise CheckpointError("step or algorithm missing")
    meta = info.get("meta")
    return Checkpoint(step, algorithm, tensors, meta if isinstance(meta, dict) else {})


def _info(head: bytes, size: int) -> Any:
    if len(head) < 8:
        raise CheckpointError("file shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > min(MAX_HEADER_BYTES, size - 8):
        raise CheckpointError(f"header length {header_len} exceeds the file")
    return header_len


def decode_checkpoint(data: bytes) -> Checkpoint:
    """Parse and verify a checkpoint file's bytes.

    Raises:
        CheckpointError: truncated, corrupt, or not a geotrain checkpoint.
    """
    header_len = _info(data[:8], len(data))
    try:
        st_header = json.loads(data[8 : 8 + header_len])
        info = json.loads(st_header["__metadata__"]["geotrain"])
        tensors = safetensors.torch.load(data)
    except Exception as exc:  # safetensors raises its own error types; JSON ours; any is "corrupt"
        raise CheckpointError(f"unreadable: {exc}") from exc
    return _verified(info, tensors)


_FROM_NAME = {name: dtype for dtype, name in _DTYPES.items()}
_ITEM_BYTES = {dtype: torch.empty(0, dtype=dtype).element_size() for dtype in _DTYPES}


def read_checkpoint(path: Path) -> Checkpoint:
    """Read and verify a checkpoint file tensor by tensor into memory of their own, never holding
    its bytes and its tensors at once. (Not safetensors' load_file: its tensors are views of the
    mapped file, and an optimizer's load_state_dict keeps them as they are: a resumed 10^8 node
    peaked 19-32% above its memory estimate, and a checkpoint rotated out stayed on disk, deleted
    but mapped, until the process ended.)

    Raises:
        CheckpointError, OSError: truncated, corrupt, not a geotrain checkpoint, unreadable.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        header_len = _info(f.read(8), size)
        try:
            header = json.loads(f.read(header_len))
            info = json.loads(header.pop("__metadata__")["geotrain"])
            entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        except Exception as exc:  # JSON, or a header of another shape: any is "corrupt"
            raise CheckpointError(f"unreadable header: {exc}") from exc
        start, tensors, end = 8 + header_len, {}, 0
        for name, entry in entries:
            t = _empty_for(name, entry, end, size - start)  # (each where the last one ended)
            end = entry["data_offsets"][1]
            if t.numel():
                f.seek(start + entry["data_offsets"][0])
                f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy()))
            tensors[name] = t
        if end != size - start:
            raise CheckpointError(f"{size - start - end} bytes after the last tensor")
    return _verified(info, tensors)


def _empty_for(name: str, entry: Any, lo_expected: int, data_bytes: int) -> torch.Tensor:
    """An uninitialised tensor for header `entry`, whose data must begin at `lo_expected` and
    end within the file's `data_bytes` (checked before anything is allocated)."""
    try:
        dtype = _FROM_NAME[entry["dtype"]]
        shape, (lo, hi) = entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"tensor {name!r}: bad header entry ({exc!r})") from None
    ints = [*shape, lo, hi] if isinstance(shape, list) else None
    if ints is None or not all(type(n) is int and 0 <= n < 2**62 for n in ints):
        raise CheckpointError(f"tensor {name!r}: shape {shape} and offsets {[lo, hi]} must be "
                              "non-negative integers")  # fmt: skip
    if lo != lo_expected or hi - lo != math.prod(shape) * _ITEM_BYTES[dtype]:
        raise CheckpointError(f"tensor {name!r}: shape {shape} does not fit offsets {lo}..{hi}")
    if hi > data_bytes:
        raise CheckpointError(f"tensor {name!r}: the file ends inside it")
    try:
        return torch.empty(shape, dtype=dtype)
    except (RuntimeError, MemoryError) as exc:  # (a zero-element shape torch cannot make)
        raise CheckpointError(f"tensor {name!r}: shape {shape}: {exc}") from None


class CheckpointStore:
    """The checkpoint files of one node, in a directory it owns.

    Args:
        directory: where `ckpt-<step>.safetensors` files live (created if missing).
        keep: how many of the newest checkpoints to keep; older ones are deleted after a save.
    """

    def __init__(self, directory: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: expected >= 1")
        self.directory = Path(directory)
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)

    def paths(self) -> list[Path]:
        """Checkpoint files, newest (highest step) first."""
        found = [p for p in self.directory.iterdir() if _NAME.match(p.name)]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def save(self, ckpt: Checkpoint) -> Path:
        """Write `ckpt`, then delete the oldest of those at or below its step beyond `keep`.
        Files of higher steps are neither counted nor deleted: they are there because the run
        resumed from below them (they did not verify), and counting them had every new
        checkpoint deleted as soon as it was written when `keep` of them were unreadable."""
        path = self.directory / f"ckpt-{ckpt.step:010d}.safetensors"
        write_atomically(path, lambda f: write_checkpoint(f, ckpt))
        older = [p for p in self.paths() if p.name <= path.name]
        for old in older[self.keep :]:
            old.unlink(missing_ok=True)
        return path

    def load_latest(self) -> tuple[Checkpoint | None, list[str]]:
        """The newest checkpoint that verifies, and a reason for each newer one that did not."""
        skipped: list[str] = []
        for path in self.paths():
            try:
                return read_checkpoint(path), skipped
            except (CheckpointError, OSError) as exc:
                skipped.append(f"{path.name}: {exc}")
        return None, skipped


def optimizer_to_checkpoint(opt: torch.optim.Optimizer, names: list[str] | None = None
                            ) -> tuple[dict[str, torch.Tensor], dict]:  # fmt: skip
    """Split an optimizer's state dict into tensors ("optim/<param>/<key>") and JSON scalars;
    `names`: its parameters' names in that order (see renumber_by_name), kept in the meta."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{index}/{key}"] = value
            else:
                _check_json(value, f"the optimizer's state {key!r} of parameter {index}")
                scalars.setdefault(str(index), {})[key] = value
    groups = []
    for i, group in enumerate(sd["param_groups"]):
        kept = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor):  # a tensor lr (a documented torch option)
                value = {_TENSOR: value.detach().cpu().tolist(),
                         "dtype": str(value.dtype).removeprefix("torch.")}  # fmt: skip
            else:
                _check_json(value, f"param_groups[{i}][{key!r}]")
            kept[key] = value
        groups.append(kept)
    meta = {"param_groups": groups, "scalars": scalars, "cls": type(opt).__name__}
    if names is not None:
        meta["params"] = list(names)
    return tensors, meta


def renumber_by_name(theirs: list[str] | None, ours: list[str] | None) -> dict[str, str] | None:
    """Optimizer state is kept by parameter position ("optim/<position>/<key>", as torch's own
    state_dict does). Positions differ between two processes whose optimizers list the same
    parameters in another order (param groups built from a set of parameters: ordered by id,
    so by process), and moments of one [d, d] weight went to another, silently. Given the
    parameter names of both orders, the map from their positions to ours (str: str); None when
    there is nothing to renumber (the same order, or a side that did not say its names).

    Raises:
        ValueError: the two optimizers hold other parameters (names differ).
    """
    if theirs is None or ours is None or list(theirs) == list(ours):
        return None
    if sorted(theirs) != sorted(ours) or len(set(ours)) != len(ours):
        extra, missing = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
        raise ValueError(f"the saved optimizer state is of other parameters (not ours: "
                         f"{extra[:3]}, not there: {missing[:3]})")  # fmt: skip
    where = {name: i for i, name in enumerate(ours)}
    return {str(i): str(where[name]) for i, name in enumerate(theirs)}


def _renumbered(moves: dict[str, str] | None, by_name: dict[str, Any], scalars: dict
                ) -> tuple[dict[str, Any], dict]:  # fmt: skip
    """`by_name` ("optim/<position>/<key>" -> anything) and `scalars` (position -> ...) with
    their positions moved by `moves` (renumber_by_name)."""
    if moves is None:
        return by_name, scalars
    moved = {}
    for name, value in by_name.items():
        head, index, key = name.split("/", 2)
        if index not in moves:
            raise ValueError(f"state tensor {name!r}: no such parameter position")
        moved[f"{head}/{moves[index]}/{key}"] = value
    if any(i not in moves for i in scalars):
        raise ValueError(f"scalars of parameter positions {sorted(set(scalars) - set(moves))}")
    return moved, {moves[i]: v for i, v in scalars.items()}


_TENSOR = "__tensor__"  # marks a param group's tensor value in a checkpoint's JSON


def _check_json(value: Any, what: str) -> None:
    """Raise OptimizerStateError unless JSON holds `value` as it is (numbers, strings, lists,
    dicts of them): LBFGS's history (lists of tensors) or a set cannot be checkpointed."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        raise OptimizerStateError(
            f"{what} is a {type(value).__name__}: a checkpoint holds an optimizer's tensors and "
            "numbers only") from None


def _group_tensor(saved: dict) -> torch.Tensor:
    dtype = getattr(torch, str(saved.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a param group's tensor of dtype {saved.get('dtype')!r}")
    return torch.tensor(saved[_TENSOR], dtype=dtype)


class OptimizerStateError(ValueError):
    """An optimizer's state holds something a checkpoint cannot (see optimizer_to_checkpoint)."""


def optimizer_from_checkpoint(
    opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict,
    names: list[str] | None = None,
) -> None:
    """Restore what `optimizer_to_checkpoint` split, onto the optimizer's own device; with
    `names` (our parameters' names in the optimizer's order) and the checkpoint's, by name.

    Raises:
        ValueError: it was written by another optimizer class (a checkpoint names its class;
            an Adam's state in an SGD would fail only at its first step, KeyError 'momentum'),
            or torch refused it (another number of parameter groups).
    """
    saved = meta.get("cls")
    if saved is not None and saved != type(opt).__name__:
        raise ValueError(f"the checkpoint holds the state of optimizer {saved}, this one is "
                         f"{type(opt).__name__}")  # fmt: skip
    moves = renumber_by_name(meta.get("params"), names)
    tensors, saved_scalars = _renumbered(moves, tensors, meta.get("scalars", {}))
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        _, index, key = name.split("/", 2)
        state.setdefault(int(index), {})[key] = value
    for index, scalars in saved_scalars.items():
        state.setdefault(int(index), {}).update(scalars)
    groups = [{key: _group_tensor(v) if isinstance(v, dict) and _TENSOR in v else v
               for key, v in group.items()} for group in meta["param_groups"]]  # fmt: skip
    if moves is not None:  # state now at our positions: each group lists its own (the saved
        # groups' settings apply to ours in order; torch checks their sizes)
        ours = opt.state_dict()["param_groups"]
        if len(ours) != len(groups):
            raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups, "
                             f"this one {len(ours)}")  # fmt: skip
        groups = [{**g, "params": o["params"]} for g, o in zip(groups, ours, strict=True)]
    try:
        opt.load_state_dict({"state": state, "param_groups": groups})
    except (KeyError, TypeError, ValueError) as exc:  # (torch checks before it changes)
        raise ValueError(f"{type(opt).__name__} refused the checkpoint's state: {exc}") from None


def optimizer_layout(opt: torch.optim.Optimizer, names: list[str] | None = None) -> dict[str, Any]:
    """What a joiner needs to fetch `opt`'s state from us (state sync): the optimizer's class,
    its state tensors ("optim/<param>/<key>": shape, dtype), their scalars and (`names`) its
    parameters' names in order. No copies."""
    tensors, meta = optimizer_to_checkpoint(opt)
    return {
        "cls": type(opt).__name__,
        "tensors": [[name, list(t.shape), str(t.dtype).removeprefix("torch.")]
                    for name, t in sorted(tensors.items())],
        "scalars": meta["scalars"],
        **({"params": list(names)} if names is not None else {}),
    }  # fmt: skip


def check_optimizer_state(opt: torch.optim.Optimizer, cls: str, shapes: dict[str, tuple[int, ...]],
                          scalars: dict[str, dict[str, Any]], theirs: list[str] | None = None,
                          ours: list[str] | None = None) -> None:  # fmt: skip
    """Whether a peer's optimizer state (its class, state tensors' shapes, per-parameter
    scalars; by name when both sides' parameter names are given) fits `opt`.

    Raises:
        ValueError: another optimizer class, a parameter index `opt` does not have, a state
            tensor that is neither the parameter's shape nor a scalar, or a scalar that is not a
            finite number; the message says which.
    """
    if cls != type(opt).__name__:
        raise ValueError(f"the peer's optimizer is {cls}, ours {type(opt).__name__}")
    shapes, scalars = _renumbered(renumber_by_name(theirs, ours), shapes, scalars)
    params = [p for group in opt.param_groups for p in group["params"]]
    for name, shape in shapes.items():
        parts = name.split("/")
        if len(parts) != 3 or parts[0] != "optim" or not parts[1].isdigit():
            raise ValueError(f"state tensor {name!r}: expected optim/<parameter>/<key>")
        index = int(parts[1])
        if index >= len(params):
            raise ValueError(f"state tensor {name!r}: our optimizer has {len(params)} parameters")
        if tuple(shape) not in ((), tuple(params[index].shape)):
            raise ValueError(f"state tensor {name!r} has shape {tuple(shape)}, its parameter "
                             f"{tuple(params[index].shape)}")  # fmt: skip
    count = len(params)
    for index, values in scalars.items():
        if not index.isdigit() or int(index) >= count:
            raise ValueError(f"scalars of parameter {index!r}: our optimizer has {count}")
        for key, value in values.items():
            if not isinstance(value, int | float) or not math.isfinite(value):  # (bools pass)
                raise ValueError(f"scalar {index}/{key} = {value!r}: expected a finite number")


def adopt_optimizer_state(opt: torch.optim.Optimizer, cls: str, tensors: dict[str, torch.Tensor],
                          scalars: dict[str, dict[str, Any]], theirs: list[str] | None = None,
                          ours: list[str] | None = None) -> None:  # fmt: skip
    """Load a peer's optimizer state (of class `cls`) into `opt`, keeping `opt`'s own
    hyperparameters (learning rate, weight decay, ...: the param groups are ours); by name
    when both sides' parameter names (`theirs`, `ours`) are given.

    Raises:
        ValueError: it does not fit `opt` (see check_optimizer_state), or torch refused it.
    """
    tensors, scalars = _renumbered(renumber_by_name(theirs, ours), tensors, scalars)
    check_optimizer_state(opt, cls, {n: tuple(t.shape) for n, t in tensors.items()}, scalars)
    try:
        optimizer_from_checkpoint(opt, tensors, {
            "scalars": scalars, "param_groups": opt.state_dict()["param_groups"]})
    except (KeyError, TypeError, RuntimeError) as exc:  # (torch validates before it changes)
        raise ValueError(f"{type(opt).__name__} refused the state: {exc!r}") from None
