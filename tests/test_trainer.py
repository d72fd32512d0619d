"""The trainer: steps, slowdown, mixing with checks, checkpoint state."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from geotrain.gossip._averaging import RejectedUpdate
from geotrain.node.training._tasks import TaskContext, resolve_task
from geotrain.node.training._trainer import Trainer


def _trainer(**kwargs) -> Trainer:
    return Trainer(resolve_task("synthetic-linreg")(TaskContext(seed=2)), **kwargs)


def test_training_lowers_the_error():
    trainer = _trainer()
    before = trainer.evaluate()
    for _ in range(300):
        trainer.train_step()
    assert trainer.step == 300 and trainer.evaluate() < before / 10


def test_slowdown_waits_in_proportion_to_compute():
    waits: list[float] = []
    trainer = _trainer(slowdown=4.0, sleep=waits.append)
    result = trainer.train_step()  # the fake sleep returns at once: result.seconds ~ compute
    assert len(waits) == 1
    assert 2.5 * result.seconds <= waits[0] <= 3.0 * result.seconds


def test_a_pinned_step_time_pads_each_step_to_it_times_the_slowdown():
    waits: list[float] = []
    trainer = _trainer(step_time_s=0.5, slowdown=2.0, sleep=waits.append)
    result = trainer.train_step()  # the fake sleep returns at once: result.seconds ~ compute
    assert len(waits) == 1 and waits[0] + result.seconds == pytest.approx(1.0, abs=0.01)
    assert trainer.overran_steps == 0
    tight = _trainer(step_time_s=1e-9, sleep=waits.append)  # no step computes in a nanosecond
    tight.train_step()
    assert tight.overran_steps == 1 and len(waits) == 1  # counted, and no wait added
    with pytest.raises(ValueError, match="step_time_s"):
        _trainer(step_time_s=-1.0)


def test_mix_averages_and_keeps_local_progress():
    trainer = _trainer()
    snap = trainer.snapshot()
    trainer.train_step()  # local progress after the snapshot
    progressed = trainer.snapshot()
    remote = {k: v + 2.0 for k, v in snap.items()}
    trainer.mix(snap, remote, max_norm_ratio=1e9)
    for name, now in trainer.params().items():
        torch.testing.assert_close(now, progressed[name] + 1.0)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda r: r.update(weight=torch.full_like(r["weight"], float("nan"))), "nonfinite"),
        (lambda r: r.update(weight=r["weight"] * 1e6), "norm"),
        (lambda r: r.pop("bias"), "names"),
        (lambda r: r.update(bias=torch.zeros(3)), "shape"),
    ],
)
def test_bad_peer_params_are_rejected_and_change_nothing(mutate, reason):
    trainer = _trainer()
    for _ in range(20):
        trainer.train_step()
    snap = trainer.snapshot()
    remote = {k: v.clone() + 0.1 for k, v in snap.items()}
    mutate(remote)
    with pytest.raises(RejectedUpdate) as info:
        trainer.mix(snap, remote)
    assert info.value.reason == reason
    for name, now in trainer.params().items():
        assert torch.equal(now, snap[name])


def test_clip_bounds_how_far_a_peer_moves_us():
    trainer = _trainer()
    snap = trainer.snapshot()
    remote = {k: v + 5.0 for k, v in snap.items()}
    distance = trainer.mix(snap, remote, clip=0.5, max_norm_ratio=1e9)
    moved = sum(float((trainer.params()[k] - snap[k]).pow(2).sum()) for k in snap) ** 0.5
    assert distance > 10 and moved == pytest.approx(0.25, rel=1e-4)  # weight 0.5 x clip 0.5


def test_state_restores_model_optimizer_and_step():
    a = _trainer()
    for _ in range(30):
        a.train_step()
    tensors, meta = a.state_tensors()
    b = _trainer()
    b.restore(tensors, meta, step=a.step)
    assert b.step == 30
    a.train_step()
    b.train_step()  # the same next batch is not guaranteed, but momentum state must match shape
    assert set(b.optimizer.state_dict()["state"]) == set(a.optimizer.state_dict()["state"])


def test_bad_trainer_settings_are_refused():
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        _trainer(optimizer="lamb")
    with pytest.raises(ValueError, match="slowdown=0.5"):
        _trainer(slowdown=0.5)


def test_bf16_autocast_trains_and_keeps_float32_weights():
    from geotrain.node import TaskContext, resolve_task

    task = resolve_task("synthetic-linreg")(TaskContext())
    trainer = Trainer(task, precision="bf16")
    first = task.evaluate(task.model)
    for _ in range(200):
        trainer.train_step()
    assert task.evaluate(task.model) < 0.2 * first
    assert all(p.dtype == torch.float32 for p in trainer.params().values())
    with pytest.raises(ValueError, match="precision='fp8'"):
        Trainer(task, precision="fp8")


def test_warmup_then_cosine_or_linear_decay():
    from geotrain.node.training._trainer import schedule_factor

    assert [schedule_factor(s, 4, 0, "constant") for s in range(6)] == [0.25, 0.5, 0.75, 1, 1, 1]
    assert schedule_factor(4, 4, 14, "cosine") == pytest.approx(1.0)
    assert schedule_factor(9, 4, 14, "cosine") == pytest.approx(0.5)
    assert schedule_factor(14, 4, 14, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert schedule_factor(9, 4, 14, "linear") == pytest.approx(0.5)
    assert schedule_factor(99, 4, 14, "linear") == 0.0


def test_adamw_schedule_clipping_and_accumulation_train_and_survive_a_checkpoint():
    from geotrain.node import TaskContext, resolve_task

    def make():
        task = resolve_task("synthetic-linreg")(TaskContext())
        return task, Trainer(task, optimizer="adamw", lr=0.05, weight_decay=0.01,
                             warmup_steps=10, schedule="cosine", total_steps=200,
                             clip_grad_norm=1.0, accumulate=2)  # fmt: skip

    task, trainer = make()
    first = task.evaluate(task.model)
    norms = []
    for _ in range(100):
        trainer.train_step()
        norms.append(float(torch.nn.utils.clip_grad_norm_(task.model.parameters(), float("inf"))))
    assert task.evaluate(task.model) < 0.2 * first
    assert max(norms) <= 1.0 + 1e-4  # the gradients that stepped were clipped
    lr = trainer.optimizer.param_groups[0]["lr"]
    assert 0 < lr < 0.05  # past the warmup, decaying
    tensors, meta = trainer.state_tensors()
    _, again = make()
    again.restore(tensors, meta, trainer.step)
    assert again.optimizer.param_groups[0]["lr"] == pytest.approx(lr)
    again.train_step()
    trainer.train_step()
    assert again.optimizer.param_groups[0]["lr"] == pytest.approx(
        trainer.optimizer.param_groups[0]["lr"]
    )


def test_a_tasks_frozen_parameter_stays_as_built_and_only_the_rest_is_mixed():
    """A task plugin may freeze part of its model (a pretrained base): the daemon's trainer
    (the library's) neither steps nor exchanges it, and a peer's mix carries the rest only."""
    task = resolve_task("synthetic-linreg")(TaskContext(seed=2))
    task.model.bias.requires_grad_(False)
    bias = task.model.bias.detach().clone()
    trainer = Trainer(task, optimizer="adamw", lr=0.05, weight_decay=0.1)
    assert sorted(trainer.params()) == ["weight"] and trainer.frozen_numel == 1
    for _ in range(50):
        trainer.train_step()
    snapshot = trainer.snapshot()
    trainer.mix(snapshot, {"weight": torch.zeros_like(snapshot["weight"])})
    assert torch.equal(task.model.bias, bias)  # weight decay and the mix left it alone
    assert torch.allclose(task.model.weight, snapshot["weight"] / 2)


def test_a_read_of_the_model_goes_on_beside_a_steps_passes_and_a_change_waits_for_the_step():
    """An exchange's or a state sync's chunk reads must not wait for a whole step of a big model
    (the step's forward and backward change no parameter); a change (a mix) must."""
    task = resolve_task("synthetic-linreg")(TaskContext(seed=2))
    in_forward, finish = threading.Event(), threading.Event()
    loss = task.loss

    def slow_loss(model, batch):  # a step whose passes take as long as the test says
        in_forward.set()
        assert finish.wait(30)
        return loss(model, batch)

    trainer = Trainer(dataclasses.replace(task, loss=slow_loss))
    before = trainer.snapshot()
    stepping = threading.Thread(target=trainer.train_step)
    stepping.start()
    try:
        assert in_forward.wait(30)
        read = {}
        reader = threading.Thread(target=lambda: read.update(trainer.read(
            lambda live: {k: v.clone() for k, v in live.items()})))  # fmt: skip
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "a read waited for the step's passes"
        assert all(torch.equal(read[k], before[k]) for k in before)
        assert all(torch.equal(v, before[k]) for k, v in trainer.snapshot().items())
        changed = threading.Event()
        writer = threading.Thread(target=lambda: trainer.update(lambda _live: changed.set()))
        writer.start()
        writer.join(0.5)
        assert not changed.is_set(), "a change of the model ran inside a step"
    finally:
        finish.set()
        stepping.join(30)
    writer.join(30)
    assert changed.is_set() and trainer.step == 1
    assert any(not torch.equal(v, before[k]) for k, v in trainer.snapshot().items())


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # (its optimizer swapped)
def test_a_read_waits_for_the_optimizer_step_and_goes_on_beside_an_evaluation():
    """A read sees the parameters between two optimizer steps, never half-stepped; an evaluation
    (the daemon's, which must not meet a step's passes) changes nothing and does not hold
    reads back."""
    task = resolve_task("synthetic-linreg")(TaskContext(seed=2))
    in_step, finish = threading.Event(), threading.Event()

    class Slow(torch.optim.SGD):
        def step(self, closure=None):  # an optimizer step that takes as long as the test says
            in_step.set()
            assert finish.wait(30)
            return super().step(closure)

    trainer = Trainer(task)
    trainer.optimizer = Slow(trainer.model.parameters(), lr=0.1)
    stepping = threading.Thread(target=trainer.train_step)
    stepping.start()
    assert in_step.wait(30)
    reader = threading.Thread(target=lambda: trainer.read(lambda live: None))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive(), "a read ran inside the optimizer's step"
    finish.set()
    stepping.join(30)
    reader.join(30)
    assert not reader.is_alive() and trainer.step == 1

    evaluating, done = threading.Event(), threading.Event()

    def slow_evaluation(_live):
        evaluating.set()
        assert done.wait(30)

    evaluator = threading.Thread(target=lambda: trainer.apply(slow_evaluation, changes=False))
    evaluator.start()
    assert evaluating.wait(30)
    reader = threading.Thread(target=lambda: trainer.read(lambda live: None))
    reader.start()
    reader.join(5)
    alive = reader.is_alive()
    done.set()
    evaluator.join(30)
    assert not alive, "a read waited for an evaluation"
