"""Checkpoints: atomic files, verified loading, fallback to the previous one."""

from __future__ import annotations

import torch

from geotrain.node.state._checkpoint import (
    Checkpoint,
    CheckpointStore,
    decode_checkpoint,
    encode_checkpoint,
)


def _ckpt(step: int) -> Checkpoint:
    return Checkpoint(
        step=step,
        algorithm="adpsgd",
        tensors={"model/w": torch.full((3, 2), float(step)), "ef/w": torch.zeros(4)},
        meta={"links": {"peer-a": {"rtt": 0.1}}},
    )


def test_round_trip_keeps_everything():
    back = decode_checkpoint(encode_checkpoint(_ckpt(7)))
    assert back.step == 7 and back.algorithm == "adpsgd"
    assert torch.equal(back.tensors["model/w"], torch.full((3, 2), 7.0))
    assert back.meta == {"links": {"peer-a": {"rtt": 0.1}}}


def test_latest_is_loaded_and_old_ones_pruned(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.save(_ckpt(step))
    assert [p.name for p in store.paths()] == [
        "ckpt-0000000030.safetensors",
        "ckpt-0000000020.safetensors",
    ]
    latest, skipped = store.load_latest()
    assert latest is not None and latest.step == 30 and skipped == []


def test_truncated_checkpoint_falls_back_to_previous(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(_ckpt(10))
    newest = store.save(_ckpt(20))
    newest.write_bytes(newest.read_bytes()[:-5])
    latest, skipped = store.load_latest()
    assert latest is not None and latest.step == 10
    assert len(skipped) == 1 and "ckpt-0000000020" in skipped[0]


def test_flipped_byte_is_detected(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(_ckpt(10))
    newest = store.save(_ckpt(20))
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0x40  # inside the tensor bytes
    newest.write_bytes(bytes(data))
    latest, skipped = store.load_latest()
    assert latest is not None and latest.step == 10 and "SHA-256" in skipped[0]


def test_unreadable_newer_checkpoints_never_cost_the_new_ones(tmp_path):
    """A run that resumed below `keep` unreadable checkpoints (the newer ones did not verify)
    keeps every checkpoint it writes: counting the unreadable ones had each new checkpoint
    deleted right after it was written, so every restart began at step 0 again."""
    store = CheckpointStore(tmp_path, keep=3)
    for step in (100, 125, 150):
        store.save(_ckpt(step)).write_bytes(b"\xff" * 40)  # corrupt
    assert store.load_latest()[0] is None
    for step in (25, 50, 60):
        store.save(_ckpt(step))
    latest, skipped = store.load_latest()
    assert latest is not None and latest.step == 60 and len(skipped) == 3
    names = [p.name for p in store.paths()]
    assert names[3:] == [f"ckpt-{s:010d}.safetensors" for s in (60, 50, 25)]
    store.save(_ckpt(75))  # the oldest at or below the new step goes; the higher ones stay
    assert [p.name for p in store.paths()][3:] == [
        f"ckpt-{s:010d}.safetensors" for s in (75, 60, 50)]
    store.save(_ckpt(125))  # reaching a corrupt one's step replaces it with a good one
    assert store.load_latest()[0].step == 125


def test_no_checkpoint_and_garbage(tmp_path):
    store = CheckpointStore(tmp_path)
    assert store.load_latest() == (None, [])
    (tmp_path / "ckpt-0000000001.safetensors").write_bytes(b"\xff" * 40)
    latest, skipped = store.load_latest()
    assert latest is None and len(skipped) == 1


def test_no_temp_files_are_left(tmp_path):
    CheckpointStore(tmp_path).save(_ckpt(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000001.safetensors"]


def test_zero_dim_tensors_and_adam_state_round_trip(tmp_path):
    from geotrain.node.training._tasks import TaskContext, resolve_task
    from geotrain.node.training._trainer import Trainer

    a = Trainer(resolve_task("synthetic-linreg")(TaskContext(seed=1)), optimizer="adam")
    for _ in range(5):
        a.train_step()
    tensors, meta = a.state_tensors()
    assert any(t.dim() == 0 for t in tensors.values())  # Adam's step counter
    store = CheckpointStore(tmp_path)
    store.save(Checkpoint(a.step, "adpsgd", tensors, meta))
    back, skipped = store.load_latest()
    assert skipped == [] and back is not None
    b = Trainer(resolve_task("synthetic-linreg")(TaskContext(seed=1)), optimizer="adam")
    b.restore(back.tensors, back.meta, back.step)
    for name, t in b.optimizer.state_dict()["state"][0].items():
        assert torch.equal(t, a.optimizer.state_dict()["state"][0][name]), name
    for name, p in b.params().items():
        assert torch.equal(p, a.params()[name])


def test_a_checkpoint_is_streamed_to_disk_and_read_back_from_the_file(tmp_path):
    # the file is written tensor by tensor from the tensors' own memory and is plain safetensors
    import safetensors.torch

    from geotrain.node.state._checkpoint import read_checkpoint

    store = CheckpointStore(tmp_path)
    ckpt = _ckpt(3)
    ckpt.tensors["half"] = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    path = store.save(ckpt)
    back = read_checkpoint(path)
    assert back.step == 3 and set(back.tensors) == set(ckpt.tensors)
    assert all(torch.equal(back.tensors[k], v) for k, v in ckpt.tensors.items())
    assert torch.equal(safetensors.torch.load_file(str(path))["half"], ckpt.tensors["half"])


def test_tensors_read_back_are_not_views_of_the_file(tmp_path):
    """safetensors' load_file gave views of the mapped file, which an optimizer's load_state_dict
    kept: a resumed 10^8 node peaked 19-32% above its memory estimate, and a checkpoint rotated
    out stayed on disk (deleted, still mapped) until the process ended."""
    from geotrain.node.state._checkpoint import read_checkpoint

    ckpt = _ckpt(5)
    ckpt.tensors.update({"flag": torch.tensor([True, False]), "step": torch.tensor(3.0),
                         "empty": torch.zeros(0, 4), "i8": torch.arange(-3, 3, dtype=torch.int8)})
    path = CheckpointStore(tmp_path).save(ckpt)
    back = read_checkpoint(path)
    assert all(torch.equal(back.tensors[k], v) and back.tensors[k].dtype == v.dtype
               for k, v in ckpt.tensors.items())  # fmt: skip
    path.unlink()
    with open("/proc/self/maps") as f:
        assert path.name not in f.read()  # nothing of it stays mapped
    back.tensors["model/w"].add_(1)  # memory of their own: writable


def test_a_header_that_lies_about_a_tensor_is_refused(tmp_path):
    import json
    import struct

    import pytest

    from geotrain.node.state._checkpoint import CheckpointError, read_checkpoint

    path = CheckpointStore(tmp_path).save(_ckpt(5))
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    for lie in ({"shape": [300, 2]}, {"dtype": "Q9"}, {"data_offsets": [0, 10**12]},
                {"shape": [-3, -2]}, {"shape": "32"}, {"shape": [3.0, 2]},
                {"shape": [0, 10**20]}, {"shape": [10**9, 10**9], "data_offsets": [0, 4 * 10**18]},
                {"data_offsets": [8, 32]}):  # fmt: skip
        bad = json.loads(json.dumps(header))
        bad["model/w"].update(lie)
        raw = json.dumps(bad).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
        with pytest.raises(CheckpointError, match="model/w"):
            read_checkpoint(path)
