"""geotrain as a library: nodes beside the user's own training loop (geotrain.join), in-process."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import geotrain
from geotrain.node import Admission, Identity, config_from_toml

CONFIG = """
[identity]
open_swarm = true
[training]
eval_every = 20
[gossip]
probe_interval_s = 0.2
exchange_every = 2
[state]
status_every_s = 0.2
checkpoint_every = 50
"""


def config(tmp_path: Path, name: str, *overrides: str):
    return config_from_toml(
        CONFIG, base=tmp_path, overrides=[f'state.dir="{tmp_path / name}"', *overrides]
    )


def joined(tmp_path: Path, name: str, model: nn.Module, *overrides: str) -> geotrain.Swarm:
    """geotrain.join with a throwaway identity in an open swarm (the key file of the config
    would do the same)."""
    return geotrain.join(config(tmp_path, name, *overrides), model,
                         identity=Identity.generate(), admission=Admission.open_swarm("geotrain"))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


# A real loop's step takes time (its data, its model): so do these tiny ones, or on a loaded box
# one thread could run most of its steps while the exchanges wait for the GIL and the core, and
# two models "trained together" would hardly meet (seen once in CI: the frozen test's heads 0.75x
# as far apart as two loops alone, where the usual 40-70 exchanges make it 0.05-0.25x)
PACE_S = 0.003


def train(swarm, model, steps: int, seed: int, pace_s: float = 0.0) -> None:
    """A user's own loop: AdamW with a cosine schedule and gradient clipping; each step takes
    at least `pace_s` (see PACE_S)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(99))
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=steps)
    opt = swarm.wrap(adamw, scheduler)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=gen)
        loss = nn.functional.mse_loss(model(x), x @ w)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(loss=loss)
        opt.zero_grad()
        scheduler.step()
        if pace_s:
            time.sleep(pace_s)


def test_two_loops_of_their_own_train_together_and_close_cleanly(tmp_path):
    a_model, b_model = make_model(), make_model()
    with joined(tmp_path, "a", a_model) as a:
        with joined(tmp_path, "b", b_model, f'network.bootstrap=["{a.address}"]') as b:
            threads = [threading.Thread(target=train, args=(s, m, 300, i, PACE_S))
                       for i, (s, m) in enumerate([(a, a_model), (b, b_model)])]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            status = b.status()
            assert status.step == 300 and status.exchanges_ok >= 3, status
            assert status.metric_name == "loss" and status.loss is not None
    # both closed cleanly: a final checkpoint holds the user's optimizer and scheduler state
    from geotrain.node.state import CheckpointStore

    ckpt, _ = CheckpointStore(tmp_path / "a" / "checkpoints").load_latest()
    assert ckpt is not None and ckpt.step == 300
    assert any(k.startswith("optim/") for k in ckpt.tensors) and "scheduler" in ckpt.meta
    # the two models were averaged along the way: far closer than two loops alone would be
    gap = distance(a_model, b_model)
    alone = [make_model(), make_model()]
    for i, m in enumerate(alone):
        _train_alone(m, 300, i)
    alone_gap = distance(*alone)
    assert gap < 0.5 * alone_gap, (gap, alone_gap)


def distance(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return sum(float((p - q).detach().norm()) for p, q in pairs)


def _train_alone(model, steps, seed):
    class Solo:  # the same loop without geotrain
        def wrap(self, opt, scheduler=None):
            class Plain:
                def step(self, loss=None):
                    opt.step()

                def zero_grad(self):
                    opt.zero_grad()

            return Plain()

    train(Solo(), model, steps, seed)


def test_a_restarted_loop_resumes_its_model_optimizer_and_scheduler(tmp_path):
    model = make_model()
    with joined(tmp_path, "r", model) as swarm:
        train(swarm, model, 60, 0)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    again = make_model(seed=5)  # another initialisation: the checkpoint wins
    with joined(tmp_path, "r", again) as swarm:
        assert swarm.step == 60
        assert all(torch.equal(again.state_dict()[k], v) for k, v in saved.items())
        adamw = torch.optim.AdamW(again.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=60)
        swarm.wrap(adamw, scheduler)
        assert adamw.state and scheduler.last_epoch == 60


def test_a_resume_says_the_checkpoints_optimizer_settings_replace_the_loops_own(tmp_path):
    """A home user restarted their script with --lr 1e-3 after a run at 3e-3: the checkpoint's
    optimizer state (its settings in it, as torch's load_state_dict has them) trained on at
    3e-3, and nothing said so."""
    from structlog.testing import capture_logs

    model = make_model()
    with joined(tmp_path, "r", model) as swarm:
        train(swarm, model, 20, 0)  # AdamW, lr 0.01, weight decay 0.01, a cosine schedule
    with joined(tmp_path, "r", model) as swarm:
        adamw = torch.optim.AdamW(model.parameters(), lr=0.001, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=20)
        with capture_logs() as logs:
            swarm.wrap(adamw, scheduler)
    [said] = [e for e in logs if e["event"] == "optimizer_settings_from_checkpoint"]
    assert said["changed"] == {"group 0: lr": {"given": 0.001, "checkpoint": 0.01}}, said
    assert adamw.param_groups[0]["initial_lr"] == 0.01  # (what torch does: said, not changed)
    with joined(tmp_path, "r", model) as swarm:  # the same settings again: nothing to say
        adamw = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
        with capture_logs() as logs:
            swarm.wrap(adamw, torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=20))
    assert not [e for e in logs if e["event"] == "optimizer_settings_from_checkpoint"]


def test_every_checkpoint_holds_the_schedule_of_its_own_step(tmp_path):
    """The loop steps its schedule after opt.step(), as the README's does: a checkpoint taken
    as soon as the step was reported held the scheduler one step behind whenever it won the race
    with schedule.step() (every time with a moment between the two calls), and a resume ran the
    schedule one step late."""
    import time

    from geotrain.node.state._checkpoint import read_checkpoint

    model = make_model()
    cfg = ("state.checkpoint_every=3", "state.keep=100")
    with joined(tmp_path, "s", model, *cfg) as swarm:
        adamw = torch.optim.AdamW(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=40)
        opt = swarm.wrap(adamw, scheduler)
        for _ in range(30):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.005)  # the user's work between the two calls
            scheduler.step()
    checkpoints = sorted((tmp_path / "s" / "checkpoints").iterdir())
    assert len(checkpoints) >= 10
    for path in checkpoints:
        ckpt = read_checkpoint(path)
        assert ckpt.meta["scheduler"]["last_epoch"] == ckpt.step, path.name


def test_a_resume_with_another_optimizer_is_refused_at_wrap_and_the_right_one_still_resumes(
    tmp_path,
):
    """Adam's checkpointed state went into an SGD silently (its param groups became Adam's) and
    the first step failed with KeyError: 'momentum'; another number of parameter groups was
    torch's bare ValueError."""
    model = make_model()
    with joined(tmp_path, "o", model) as swarm:
        opt = swarm.wrap(torch.optim.Adam(model.parameters(), lr=1e-3))
        for _ in range(3):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    with joined(tmp_path, "o", model) as swarm:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        said = r"the state of optimizer Adam, this one is SGD: wrap the optimizer that wrote"
        with pytest.raises(ValueError, match=said):
            swarm.wrap(sgd)
        assert sgd.param_groups[0]["lr"] == 0.1 and not sgd.state  # left as it was
        groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]
        with pytest.raises(ValueError, match=r"Adam refused the checkpoint's state: .*parameter "
                                             r"groups"):  # fmt: skip
            swarm.wrap(torch.optim.Adam(groups, lr=1e-3))
        adam = torch.optim.Adam(model.parameters(), lr=1e-3)
        swarm.wrap(adam)
        assert adam.state and int(next(iter(adam.state.values()))["step"]) == 3


def test_bad_use_gets_a_clear_error(tmp_path):
    model = make_model()
    toml = tmp_path / "bad.toml"
    toml.write_text(CONFIG + '[identity.x]\n')
    with pytest.raises(geotrain.ConfigError, match="identity.x"):
        geotrain.join(toml, model)
    good = tmp_path / "good.toml"
    good.write_text(CONFIG)
    with pytest.raises(ValueError, match="model ReLU: expected a torch.nn.Module with param"):
        geotrain.join(good, nn.ReLU())  # was a bare StopIteration
    swarm = joined(tmp_path, "y", model)
    try:
        # the same model (or a model holding its layers) in a second swarm: two nodes mixed
        # into the same tensors from two threads, silently
        with pytest.raises(ValueError, match=r"already joined to a swarm in this process "
                           r"\(state dir '.*/y'\): close\(\) that swarm first"):  # fmt: skip
            joined(tmp_path, "y2", nn.Sequential(model, nn.Linear(1, 1)))
        assert not (tmp_path / "y2").exists()  # refused before anything started
        stranger = torch.optim.SGD(make_model().parameters(), lr=0.1)
        with pytest.raises(ValueError, match="not .all. the joined model's"):
            swarm.wrap(stranger)
        opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.1))
        import numpy as np

        before = swarm.step
        with pytest.raises(ValueError, match=r"a tensor of 2 values; give the one loss"):
            opt.step(loss=torch.tensor([1.0, 2.0]))  # was torch's "only one element tensors"
        with pytest.raises(ValueError, match="expected a number or a one-value tensor"):
            opt.step(loss="low")
        assert swarm.step == before  # a bad loss takes no step
        opt.step(loss=np.float32(0.5))
        assert swarm.step == before + 1
    finally:
        swarm.close()
    with pytest.raises(geotrain.LoopClosed):
        opt.step()
    with pytest.raises(geotrain.LoopClosed, match=r"status\(\) after the swarm was closed"):
        swarm.status()  # was trio's RunFinishedError
    joined(tmp_path, "y3", model).close()  # once closed, the model may join again


@pytest.mark.parametrize(
    ("algorithm", "settings"),
    [
        ("dpsgd", ()),
        ("choco", ('gossip.codec="topk:0.3"',)),
        ("diloco", ("gossip.diloco.inner_steps=10",)),
        ("selsync", ("gossip.selsync.threshold=0.001",)),
    ],
)
def test_every_algorithm_works_through_the_library(tmp_path, algorithm, settings):
    statuses = train_pair(tmp_path, [make_model(), make_model()],
                          f'gossip.algorithm="{algorithm}"', *settings)  # fmt: skip
    assert all(s.step == 150 and s.exchanges_ok >= 1 for s in statuses), statuses
    assert all(s.algorithm == algorithm for s in statuses)


def train_pair(tmp_path: Path, models: list[nn.Module], *extra: str, steps: int = 150) -> list:
    """Two loops of their own (`train`), one thread each, in one swarm; their last statuses."""
    with joined(tmp_path, "a", models[0], *extra) as a:
        with joined(tmp_path, "b", models[1], *extra, f'network.bootstrap=["{a.address}"]') as b:
            threads = [threading.Thread(target=train, args=(s, m, steps, i, PACE_S))
                       for i, (s, m) in enumerate([(a, models[0]), (b, models[1])])]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            return [a.status(), b.status()]


def test_choco_mixes_loops_whose_models_were_built_without_a_common_seed(tmp_path):
    """Two loops of one's own whose models start from different random weights: choco refused
    every exchange between them ("initial models differ"); now their link starts at zero."""
    statuses = train_pair(tmp_path, [make_model(0), make_model(1)], 'gossip.algorithm="choco"',
                          'gossip.codec="topk:0.3"')  # fmt: skip
    assert all(s.step == 150 and s.exchanges_ok >= 3 for s in statuses), statuses
    assert sum(s.exchanges_failed for s in statuses) <= 2, statuses  # the one resync


def test_a_gpt_style_model_with_dataclass_outputs_trains_in_its_own_loop(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent / "examples"))
    try:
        import lm_loop
    finally:
        sys.path.pop(0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(lm_loop.TinyGPT())
    with joined(tmp_path, "a", models[0]) as a:
        with joined(tmp_path, "b", models[1], f'network.bootstrap=["{a.address}"]') as b:
            results: dict = {}
            threads = [
                threading.Thread(target=lambda s=s, m=m, i=i: results.__setitem__(
                    i, lm_loop.train(s, m, 80, i)))
                for i, (s, m) in enumerate([(a, models[0]), (b, models[1])])
            ]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
            assert b.status().exchanges_ok >= 2
    for losses in results.values():  # from ~5.5 (uniform over 256 bytes) down
        assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:5]) / 5


class ModeWatch(nn.Module):
    """A model that counts the forward passes during which its train/eval mode changed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 1)
        self.changed = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        mode = self.training
        time.sleep(0.002)  # a forward pass that takes a while
        out = self.lin(x)
        self.changed += self.training != mode
        return out


def test_an_evaluation_that_raises_or_gives_no_number_is_logged_and_training_goes_on(tmp_path):
    """An exception in the user's evaluate (or a None from it) stopped the node: the next
    step() raised LoopClosed and no final checkpoint was written. A NaN showed as no metric,
    unexplained."""
    from structlog.testing import capture_logs

    model = make_model()
    calls = []

    def evaluate(m: nn.Module) -> float | None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("my eval broke")
        return {3: None, 4: float("nan")}.get(len(calls), 0.5)

    with capture_logs() as logs:
        swarm = geotrain.join(config(tmp_path, "e", "training.eval_every=5",
                                     "training.wait_for_peers=0"), model, evaluate=evaluate,
                              identity=Identity.generate(),
                              admission=Admission.open_swarm("geotrain"))  # fmt: skip
        with swarm:
            opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.01))
            steps = 0  # (an evaluation runs at the user's step after the node asks: on a busy
            # box the node may ask for the fifth only after 40 quick steps, so step on to it)
            while steps < 40 or (len(calls) < 5 and steps < 4000):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                steps += 1
            status = swarm.status()
    assert status.step == steps and len(calls) >= 5 and status.metric == 0.5
    failed = [e for e in logs if e["event"] == "evaluate_failed"]
    assert [e["failures"] for e in failed] == [1]  # said once (then every 100th)
    assert "RuntimeError: my eval broke" in failed[0]["error"]
    assert list((tmp_path / "e" / "checkpoints").glob(f"ckpt-{steps:010d}*"))


def test_evaluations_run_between_the_users_steps_never_during_a_forward_pass(tmp_path):
    model = ModeWatch()
    evaluated = []

    def evaluate(m: nn.Module) -> float:
        evaluated.append(m.training)  # the node puts the model in eval mode for it
        with torch.no_grad():
            return float(m(torch.zeros(4, 8)).abs().mean())

    swarm = geotrain.join(config(tmp_path, "a", "training.eval_every=1",
                                 "training.wait_for_peers=0"), model, evaluate=evaluate,
                          identity=Identity.generate(), admission=Admission.open_swarm("geotrain"))
    with swarm:
        opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.01))
        for _ in range(60):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
            assert model.training  # the user's mode, as they left it
    assert len(evaluated) >= 20 and not any(evaluated)
    assert model.changed == 0  # no forward pass, the user's or the evaluation's, saw a switch


@pytest.mark.parametrize("every_s, at_least, at_most", [(0.25, 3, 20), (0.0, 0, 0)])
def test_evaluations_come_by_time_when_steps_are_slow(tmp_path, every_s, at_least, at_most):
    """training.eval_every_s: with slow steps a step count puts minutes between evaluations;
    the time rule evaluates anyway, and is off at 0 (the step rule alone, here never due)."""
    import time

    model, calls = make_model(), []

    def evaluate(m: nn.Module) -> float:
        calls.append(time.monotonic())
        return 0.5

    swarm = geotrain.join(config(tmp_path, "a", "training.eval_every=100000",
                                 f"training.eval_every_s={every_s}", "training.wait_for_peers=0"),
                          model, evaluate=evaluate, identity=Identity.generate(),
                          admission=Admission.open_swarm("geotrain"))  # fmt: skip
    with swarm:
        opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.01))
        started = time.monotonic()
        while time.monotonic() - started < 2.0:  # slow steps: 50 ms each
            model(torch.randn(4, 8)).pow(2).mean().backward()
            time.sleep(0.05)
            opt.step()
            opt.zero_grad()
        during = len(calls)  # (close evaluates once more)
    assert at_least <= during <= at_most
    gaps = [b - a for a, b in zip(calls[: during - 1], calls[1:during], strict=True)]
    assert all(g >= every_s * 0.9 for g in gaps)  # not at every step once due


def test_a_join_that_times_out_stops_its_node_and_says_what_it_waited_for(tmp_path, capsys):
    before = {t for t in threading.enumerate() if t.name == "geotrain-node"}
    waited = (r"not ready within 1.5 s \(stopped\): it was waiting for peers: 0 of 1 showed up "
              r"\(training.wait_for_peers; network.bootstrap: none\)")  # fmt: skip
    with pytest.raises(TimeoutError, match=waited):
        geotrain.join(config(tmp_path, "a", "training.wait_for_peers=1"), make_model(),
                      identity=Identity.generate(), admission=Admission.open_swarm("geotrain"),
                      ready_timeout_s=1.5)  # nobody to wait for  # fmt: skip
    left = {t for t in threading.enumerate() if t.name == "geotrain-node"} - before
    assert not any(t.is_alive() for t in left)  # nothing keeps listening behind the user's back
    logged = capsys.readouterr()
    logged = logged.out + logged.err
    assert "waiting_for_peers" in logged  # said as it began (20 s of silence before)
    assert "peers_ready" not in logged  # (it was said as the wait was stopped)


def test_a_node_joining_with_the_identity_of_the_node_it_dials_is_refused_at_once(tmp_path):
    """Two nodes with one key file: the one joining through the other waited out
    wait_for_peers_s (300 s) with a hint about NAT, while only the other said what was wrong."""
    me = Identity.generate()
    admission = Admission.open_swarm("geotrain")
    model = make_model()
    with geotrain.join(config(tmp_path, "a", "training.wait_for_peers=0"), model,
                       identity=me, admission=admission) as a:  # fmt: skip
        started = time.monotonic()
        with pytest.raises(geotrain.ConfigError, match=(
                f"identity: the node at {a.address} runs with this node's identity")):
            geotrain.join(config(tmp_path, "b", "training.wait_for_peers=1",
                                 f'network.bootstrap=["{a.address}"]'), make_model(1),
                          identity=me, admission=admission, ready_timeout_s=60)  # fmt: skip
        assert time.monotonic() - started < 30
        assert a.status().exchanges_failed == 0  # the first one serves on


def test_a_node_whose_bootstrap_reaches_itself_is_not_taken_for_a_twin(tmp_path, capsys):
    """A seed list that names the seed itself another way (localhost for 127.0.0.1) dials the
    node itself: its own refusal came back signed with its identity, and the twin check stopped
    a node that has no twin."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TimeoutError, match="waiting for peers: 0 of 1 showed up"):
        geotrain.join(config(tmp_path, "seed", "training.wait_for_peers=1",
                             f'network.listen="tcp://127.0.0.1:{port}"',
                             f'network.advertise="tcp://127.0.0.1:{port}"',
                             f'network.bootstrap=["tcp://localhost:{port}"]'), make_model(),
                      identity=Identity.generate(), admission=Admission.open_swarm("geotrain"),
                      ready_timeout_s=4)  # fmt: skip
    logged = capsys.readouterr()
    assert "bootstrap_is_self" in logged.out + logged.err


def test_a_node_that_stops_by_itself_is_an_error_at_the_next_step(tmp_path):
    model = make_model()
    swarm = joined(tmp_path, "a", model, "training.wait_for_peers=0")
    opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.01))
    import trio

    opt.step()  # fine while the node runs
    # the node ends without the user closing it (here: asked from its own loop, as an error or
    # a signal would end it): the next step says so instead of training alone unawares
    trio.from_thread.run_sync(swarm.node.request_stop, trio_token=swarm._token)
    swarm._thread.join(30)
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(geotrain.LoopClosed, match="the geotrain node stopped"):
        opt.step()
    swarm.close()


def test_a_scheduler_built_on_the_wrapped_optimizer_schedules_it(tmp_path):
    # a script that wraps first and builds its schedule (or anything that checks for a torch
    # Optimizer) on what wrap returned: torch refused it ("SwarmOptimizer is not an Optimizer")
    model = make_model()
    swarm = joined(tmp_path, "a", model, "training.wait_for_peers=0")
    try:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = swarm.wrap(sgd)
        assert isinstance(opt, torch.optim.Optimizer)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        stepped = []
        opt.register_step_post_hook(lambda *_: stepped.append(1))
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            schedule.step()
        assert sgd.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
        assert len(stepped) == 3 and opt.state_dict() == sgd.state_dict()
        assert swarm.step == 3
    finally:
        swarm.close()


def test_a_grad_scaler_steps_a_wrapped_fused_optimizer_as_the_bare_one(tmp_path):
    # torch.amp.GradScaler gives a fused optimizer its scale by setting attributes on what it
    # was handed (grad_scale, found_inf): on the wrapper, the wrapped optimizer never saw them and
    # stepped on gradients still scaled (here 1024 times too far)
    import copy

    model = make_model()
    bare_model = copy.deepcopy(model)
    swarm = joined(tmp_path, "a", model, "training.wait_for_peers=0")
    try:
        opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.1, fused=True))
        bare = torch.optim.SGD(bare_model.parameters(), lr=0.1, fused=True)
        scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
        for _ in range(3):
            x = torch.randn(4, 8)
            for m, o, scaler in ((model, opt, scalers[0]), (bare_model, bare, scalers[1])):
                o.zero_grad()
                scaler.scale(m(x).pow(2).mean()).backward()
                scaler.step(o)
                scaler.update()
        for p, q in zip(model.parameters(), bare_model.parameters(), strict=True):
            assert torch.allclose(p, q, atol=1e-6)
        assert not hasattr(opt.optimizer, "grad_scale")  # (the scaler took them back)
    finally:
        swarm.close()


def test_a_loops_step_time_is_its_whole_iteration():
    import time

    from geotrain.node.training import LoopTrainer

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loop = LoopTrainer(model)
    loop.attach(opt)
    loop.start()
    seconds = []
    for _ in range(4):
        time.sleep(0.03)  # the user's data, forward and backward: outside the optimizer's step
        _, result = loop.stepped(opt.step, 0.0)
        seconds.append(result.seconds)
    # what diloco's adaptive rounds and dpsgd's deadlines pace by: the iteration, not opt.step
    assert all(s >= 0.03 for s in seconds[1:]), seconds


def test_joining_with_another_model_than_the_swarms_is_a_clear_error(tmp_path):
    from geotrain.node import ConfigError

    first = joined(tmp_path, "a", make_model(), "training.wait_for_peers=0")
    try:
        other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))  # other shapes
        with pytest.raises(ConfigError, match=r"the model differs from the swarm's: 1 peer\(s\)"):
            joined(tmp_path, "b", other, f'network.bootstrap=["{first.address}"]',
                   "training.wait_for_peers=1")  # fmt: skip
        # the refused node said it leaves: the swarm stops counting it at once, not after the
        # failure detector's timeouts
        assert [p.state for p in first.status().peers] == ["left"]
    finally:
        first.close()


def test_a_loop_that_ends_on_an_evaluation_step_closes_cleanly_with_that_evaluation(tmp_path):
    import json

    model = make_model()
    swarm = geotrain.join(config(tmp_path, "a", "training.eval_every=5",
                                 "training.wait_for_peers=0"), model,
                          evaluate=lambda m: 0.5, identity=Identity.generate(),
                          admission=Admission.open_swarm("geotrain"))  # fmt: skip
    opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.01))
    for _ in range(10):  # the last step asks for an evaluation that waits for a next step
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    import time

    deadline = time.monotonic() + 30
    while not swarm._loop._pending:  # the node asked for step 10's evaluation and waits
        assert time.monotonic() < deadline, "the node never asked for the evaluation"
        time.sleep(0.01)
    swarm.close()  # no next step comes: the node evaluates at its close, and nothing failed
    status = json.loads((tmp_path / "a" / "status.json").read_text())
    assert status["step"] == 10 and status["metric"] == 0.5 and not status["running"]


def test_a_diverged_loss_is_said_once_and_again_every_thousand_steps():
    from structlog.testing import capture_logs

    from geotrain.node.training import LoopTrainer

    loop = LoopTrainer(make_model())
    loop.max_bad_losses = 0  # (training.max_nonfinite_steps = 0: train on)
    with capture_logs() as logs:
        for loss in [1.0, float("nan"), float("inf"), *[float("nan")] * 1000, 0.5, float("nan")]:
            loop.stepped(lambda: None, loss)
    said = [e for e in logs if e["event"] == "loss_not_finite"]
    assert [e["step"] for e in said] == [2, 1002, 1005]  # first, 1000 later, after a good one
    assert said[0]["log_level"] == "warning" and "diverged" in said[0]["detail"]


def test_a_loop_that_stays_diverged_gets_Diverged_from_its_step():
    """training.max_nonfinite_steps bad losses in a row: the step that makes it so raises
    (geotrain.Diverged), and every later one until a finite loss; a finite loss resets."""
    from geotrain.node.training import LoopTrainer

    loop = LoopTrainer(make_model())
    loop.max_bad_losses = 3
    for loss in [float("nan"), float("nan"), 1.0, float("inf"), float("nan")]:
        loop.stepped(lambda: None, loss)  # never three in a row
    assert loop.nonfinite_losses == 2
    with pytest.raises(geotrain.Diverged, match="3 steps in a row .* training.max_nonfinite"
                       ) as raised:  # fmt: skip
        loop.stepped(lambda: None, float("nan"))
    assert loop.step == 6  # the step itself was taken (its optimizer ran) before it raised
    assert raised.value.result.step == 6  # and counted: the node is told of it
    with pytest.raises(geotrain.Diverged):
        loop.stepped(lambda: None, float("nan"))
    loop.stepped(lambda: None, 0.5)
    assert loop.nonfinite_losses == 0


def _stepped_loop(make_opt, steps=3):
    from geotrain.node.training import LoopTrainer

    torch.manual_seed(0)
    model = make_model()
    opt = make_opt(model)
    loop = LoopTrainer(model)
    loop.attach(opt)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for _ in range(steps):
        def closure():
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss

        closure()
        loop.stepped(lambda: opt.step(closure), 0.0)
    return loop, opt


def test_a_tensor_learning_rate_goes_through_a_checkpoint():
    """AdamW(lr=torch.tensor(...)) (a documented torch option) stopped the node at its first
    checkpoint: 'Object of type Tensor is not JSON serializable'."""
    from geotrain.node.state import Checkpoint
    from geotrain.node.state._checkpoint import decode_checkpoint, encode_checkpoint

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))

    loop, opt = _stepped_loop(adamw)
    tensors, meta = loop.state_tensors()
    back = decode_checkpoint(encode_checkpoint(Checkpoint(3, "adpsgd", tensors, meta)))
    fresh, fresh_opt = _stepped_loop(adamw, steps=0)
    fresh.restore(back.tensors, back.meta, back.step)
    lr = fresh_opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and float(lr) == pytest.approx(1e-3)
    saved, loaded = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for i in saved:
        assert torch.equal(saved[i]["exp_avg"], loaded[i]["exp_avg"])
        assert float(saved[i]["step"]) == float(loaded[i]["step"]) == 3


def test_an_optimizer_state_no_checkpoint_can_hold_leaves_the_model_saved(capsys):
    """LBFGS keeps lists of tensors in its state: the checkpoint holds the model without the
    optimizer (said once) instead of stopping the node."""
    from structlog.testing import capture_logs

    loop, _ = _stepped_loop(lambda model: torch.optim.LBFGS(model.parameters(), lr=0.1))
    with capture_logs() as logs:
        tensors, meta = loop.state_tensors()
        loop.state_tensors()
    assert "optimizer" not in meta and any(k.startswith("model/") for k in tensors)
    said = [e for e in logs if e["event"] == "optimizer_not_checkpointed"]
    assert len(said) == 1 and "a checkpoint holds an optimizer's tensors and numbers" in (
        said[0]["reason"])  # fmt: skip
    assert loop.optimizer_layout() is None  # nothing to hand a joiner either


def test_wrap_refuses_a_scheduler_that_is_not_one_or_not_its_optimizers_and_a_second_optimizer():
    """Each was accepted: "cosine" as a scheduler failed at close(), another optimizer's scheduler
    was silently checkpointed, and a second wrap() silently took over from the first."""
    from geotrain.node.training import LoopTrainer

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = LoopTrainer(model)
    with pytest.raises(ValueError, match="'cosine': expected a torch learning-rate scheduler"):
        loop.attach(opt, "cosine")
    with pytest.raises(ValueError, match="the scheduler schedules another optimizer"):
        loop.attach(opt, torch.optim.lr_scheduler.StepLR(other, 10))
    schedule = torch.optim.lr_scheduler.StepLR(opt, 10)
    loop.attach(opt, schedule)
    loop.attach(opt, schedule)  # the same optimizer again: fine
    with pytest.raises(ValueError, match="an optimizer is wrapped already"):
        loop.attach(other)
    assert loop.optimizer is opt and loop.scheduler is schedule


def _join_alone_and_train(tmp_path, model, steps: int, *overrides: str, **join) -> None:
    """`steps` steps of a loop joined alone (no peers), with the loss reported, then close
    (`join`: more of geotrain.join's arguments)."""
    with geotrain.join(config(tmp_path, "a", "training.wait_for_peers=0", *overrides), model,
                       identity=Identity.generate(), admission=Admission.open_swarm("geotrain"),
                       **join) as swarm:  # fmt: skip
        opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.01))
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()


def test_status_of_a_loop_with_no_evaluate_shows_its_loss_once(tmp_path):
    """With no evaluate the metric is the loss: `geotrain status` printed "loss x  loss x"."""
    import json

    from geotrain.node.state import render_status

    _join_alone_and_train(tmp_path, make_model(), 4, "training.eval_every=2")
    line = next(x for x in render_status(json.loads((tmp_path / "a" / "status.json")
                                                    .read_text())).splitlines()
                if x.startswith("training"))  # fmt: skip
    assert line.count("loss") == 1 and "own loop" in line, line


def test_status_shows_a_held_out_metric_named_loss(tmp_path):
    """An evaluate named "loss" (a held-out loss, a common name) was hidden as if it were the
    training loss."""
    from geotrain.node.state import render_status

    model = make_model()
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    _join_alone_and_train(tmp_path, model, 4, "training.eval_every=2", metric="loss",
                          evaluate=lambda m: float(nn.functional.mse_loss(m(x), y)),
                          higher_is_better=False)  # fmt: skip
    data = json.loads((tmp_path / "a" / "status.json").read_text())
    assert data["held_out"] is True and data["metric"] is not None
    line = next(x for x in render_status(data).splitlines() if x.startswith("training"))
    assert line.count("loss") == 2 and f"loss {data['metric']:.4f} (step" in line, line


def test_a_model_with_an_infinite_buffer_is_checkpointed(tmp_path):
    """An attention mask holds -inf by design (the charlm task's `causal` buffer): the check
    that keeps a diverged model out of checkpoints refused every checkpoint of such a model."""
    model = make_model()
    model.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
    _join_alone_and_train(tmp_path, model, 3)
    assert list((tmp_path / "a" / "checkpoints").glob("ckpt-*"))  # the final one, at close


def test_ctrl_c_during_an_evaluation_reaches_the_loop_and_the_swarm_closes_cleanly(tmp_path):
    """Ctrl-C while the node's evaluation ran in the user's thread was handed to the node's
    thread: the node failed (no final checkpoint, no leave) and the loop got LoopClosed instead
    of KeyboardInterrupt."""
    model, calls = make_model(), []

    def evaluate(m: nn.Module) -> float:
        calls.append(len(calls))
        if len(calls) == 1:
            raise KeyboardInterrupt  # as a SIGINT arriving during the user's evaluate
        return 0.5

    swarm = geotrain.join(config(tmp_path, "a", "training.eval_every=5",
                                 "training.wait_for_peers=0"), model, evaluate=evaluate,
                          identity=Identity.generate(), admission=Admission.open_swarm("geotrain"))
    steps = 0
    with pytest.raises(KeyboardInterrupt), swarm:
        opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.01))
        while steps < 5000:
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            steps += 1
    assert steps < 5000 and len(calls) >= 2  # interrupted; the evaluation ran again at close
    final = list((tmp_path / "a" / "checkpoints").glob("ckpt-*"))
    assert final, "no final checkpoint: the node failed instead of closing"
    status = json.loads((tmp_path / "a" / "status.json").read_text())
    assert status["metric"] == 0.5


def test_wrap_of_something_not_an_optimizer_says_what_it_takes():
    """swarm.wrap(model) (or a list of parameters, or "adam") was an AttributeError about
    param_groups."""
    from geotrain.node.training import LoopTrainer

    model = make_model()
    loop = LoopTrainer(model)
    for wrong, got in ((model, "a Sequential:"), (list(model.parameters()), "a list:"),
                       ("adam", "a str ('adam'):")):  # fmt: skip
        with pytest.raises(ValueError, match=r"wrap\(\) takes your torch optimizer") as err:
            loop.attach(wrong)
        # one line, naming the type (a module's repr was pasted in, cut mid-line)
        assert f"got {got} e.g. swarm.wrap" in str(err.value) and "\n" not in str(err.value)


def test_a_scheduler_made_on_what_wrap_returned_is_checkpointed_when_wrapped_again(tmp_path):
    """The README's pattern, a schedule built on what wrap returned, could not be checkpointed:
    passed to wrap it was refused as another optimizer's."""
    model = make_model()
    with joined(tmp_path, "s", model, "training.wait_for_peers=0") as swarm:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = swarm.wrap(sgd)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        swarm.wrap(opt, schedule)  # what wrap returned, wrapped again with its schedule
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            schedule.step()
    again = make_model()
    with joined(tmp_path, "s", again, "training.wait_for_peers=0") as swarm:
        sgd = torch.optim.SGD(again.parameters(), lr=0.1)
        opt = swarm.wrap(sgd)  # first without the schedule: its saved state waits for it
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        swarm.wrap(opt, schedule)
        assert schedule.last_epoch == 4
        assert sgd.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)


@pytest.mark.parametrize("changes", [True, False])
def test_ctrl_c_in_the_middle_of_a_change_is_remembered_and_an_evaluation_is_not(changes):
    """Ctrl-C in the user's thread while it ran a mix or an outer step can leave the model
    half changed: the node refuses its final checkpoint then (the newest on disk stays). An
    evaluation changes nothing, and the final checkpoint is written after one."""
    from geotrain.node.training import LoopClosed, LoopTrainer

    model = make_model()
    loop = LoopTrainer(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loop.attach(opt)
    loop.start()
    told: list[BaseException] = []

    def half_change(live):
        next(iter(live.values())).add_(1.0)  # the first tensor changed, then the interrupt
        raise KeyboardInterrupt

    def node_side() -> None:
        try:
            loop.apply(half_change, changes=changes)
        except LoopClosed as exc:
            told.append(exc)

    worker = threading.Thread(target=node_side)
    worker.start()
    while not loop._pending:
        time.sleep(0.001)
    with pytest.raises(KeyboardInterrupt):
        loop.stepped(opt.step, loss=0.1)
    worker.join(5)
    assert len(told) == 1  # the node hears the loop closed; the interrupt is the user's
    assert loop.cut_short is changes


def test_a_sigterm_during_a_mix_exits_after_the_mix_and_the_final_checkpoint_is_written(
    tmp_path,
):
    """join's SIGTERM exit cut a mix the loop's thread was applying short, like Ctrl-C: the
    final checkpoint was refused (the model half changed) and the steps since the last one
    were lost. It now waits for the end of the change (not for the next one: they stay queued
    for close, which runs them and writes the final checkpoint; a SIGTERM in one of those is
    raised by close once the node has stopped)."""
    import contextlib
    import os
    import signal

    from geotrain.node.training import LoopClosed

    before = signal.getsignal(signal.SIGTERM)
    swarm = None
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        model = make_model()
        swarm = joined(tmp_path, "s", model, "training.wait_for_peers=0",
                       "state.checkpoint_every=1000")  # fmt: skip
        opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.01))
        for _ in range(3):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        loop = swarm._loop
        names = list(loop.params())
        done: list[str] = []

        def mix(live):  # a mix over every tensor, the signal coming after the first
            for i, name in enumerate(names):
                live[name].add_(1.0)
                if i == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.05)  # (the handler runs in here, between two tensors)
                done.append(name)

        told: list[object] = []

        def node_side(fn) -> None:
            try:
                told.append(loop.apply(fn))
            except LoopClosed as exc:
                told.append(exc)

        workers = [threading.Thread(target=node_side, args=(fn,), daemon=True)
                   for fn in (mix, mix)]  # fmt: skip
        for worker in workers:
            worker.start()
        while len(loop._pending) < 2:
            time.sleep(0.001)
        with pytest.raises(SystemExit) as exited:
            opt.step()
        assert exited.value.code == 143 and done == names  # the whole mix, then the exit
        assert not loop.cut_short and len(loop._pending) == 1  # the second waits for close
        with pytest.raises(SystemExit) as exited:  # (a SIGTERM in the mix close runs: raised
            swarm.close()  # once the node has stopped, its final checkpoint written)
        assert exited.value.code == 143
        for worker in workers:
            worker.join(5)
        assert told == [None, None] and done == names + names
        step = loop.step
        assert (tmp_path / "s" / "checkpoints" / f"ckpt-{step:010d}.safetensors").exists()
    finally:
        if swarm is not None:
            with contextlib.suppress(BaseException):
                swarm.close()
        signal.signal(signal.SIGTERM, before)


def test_no_final_checkpoint_of_a_model_a_ctrl_c_left_half_changed(tmp_path):
    model = make_model()
    swarm = joined(tmp_path, "h", model, "training.wait_for_peers=0", "state.checkpoint_every=1000")
    opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.01))
    for _ in range(5):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    swarm._loop.cut_short = True  # as a Ctrl-C in the middle of a mix leaves it
    swarm.close()
    assert not list((tmp_path / "h" / "checkpoints").glob("ckpt-*"))


def test_a_model_with_lazy_parameters_is_refused_before_anything_starts():
    """A LazyLinear's weight has no shape before its first forward pass: join said nothing and
    the node failed later with torch's "uninitialized parameter" from its own thread."""
    from geotrain.node.training import LoopTrainer

    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"\['0.weight', '0.bias'\] are not initialized yet"):
        LoopTrainer(model)
    model(torch.randn(2, 8))  # one forward pass: shapes known, it joins
    assert sorted(LoopTrainer(model).params()) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_training_settings_a_loop_of_ones_own_does_not_read_are_warned_about(tmp_path):
    """precision = "bf16", accumulate or lr in [training] did nothing under geotrain.join, and
    nothing said so; the task (documented as unused) is not warned about."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        swarm = joined(tmp_path, "a", make_model(), "training.wait_for_peers=0",
                       'training.precision="bf16"', "training.accumulate=4",
                       'training.task="charlm"')  # fmt: skip
        swarm.close()
    said = [e for e in logs if e["event"] == "training_settings_unused"]
    assert len(said) == 1 and said[0]["log_level"] == "warning"
    assert said[0]["settings"] == ["training.precision", "training.accumulate"]


def test_a_compiled_model_joins_under_its_own_names(tmp_path):
    """torch.compile's wrapper names every parameter '_orig_mod.<name>': a compiled peer and
    an uncompiled one refused each other, and a checkpoint written by one did not resume the
    other."""
    first = joined(tmp_path, "a", torch.compile(make_model()), "training.wait_for_peers=0")
    try:
        assert set(first.node.trainer.params()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        second = joined(tmp_path, "b", make_model(1), f'network.bootstrap=["{first.address}"]',
                        "training.wait_for_peers=1")  # fmt: skip
        second.close()
    finally:
        first.close()


def test_a_loop_that_trains_without_wrap_is_told_at_close(tmp_path):
    """Stepping the optimizer itself instead of what wrap() returned trained alone, and
    nothing said so; joining and closing without training says nothing."""
    from structlog.testing import capture_logs

    model = make_model()
    with capture_logs() as logs:
        joined(tmp_path, "a", model, "training.wait_for_peers=0").close()
        swarm = joined(tmp_path, "b", model, "training.wait_for_peers=0")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # never wrapped
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        swarm.close()
    said = [e for e in logs if e["event"] == "never_wrapped"]
    assert len(said) == 1 and said[0]["log_level"] == "warning"


def _moments_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s["exp_avg"].clone() for p, s in optimizer.state.items()}


def test_optimizer_state_follows_parameter_names_not_positions(tmp_path):
    """Optimizer state was kept by position: a resume, or a joiner, whose optimizer lists the
    same parameters in another order (param groups built from a set: ordered by id, so by
    process) took one layer's moments for another of the same shape, silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # two weights and biases alike
    first = joined(tmp_path, "a", model, "training.wait_for_peers=0")
    try:
        opt = first.wrap(torch.optim.AdamW(model.parameters(), lr=0.01))
        for _ in range(3):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        saved = _moments_by_name(model, opt.optimizer)
        # a late joiner whose optimizer lists the layers the other way round (every shape at
        # its place: nothing refused it): the state by name (state sync)
        other = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        second = joined(tmp_path, "b", other, f'network.bootstrap=["{first.address}"]',
                        "training.wait_for_peers=1")  # fmt: skip
        swapped = torch.optim.AdamW([*other[1].parameters(), *other[0].parameters()], lr=0.01)
        second.wrap(swapped)
        second.close()
        synced = _moments_by_name(other, swapped)
        assert set(synced) == set(saved)
        assert all(torch.equal(synced[n], saved[n]) for n in saved)
    finally:
        first.close()
    # the resume of the first, its optimizer listing the layers the other way: by name
    again = joined(tmp_path, "a", model, "training.wait_for_peers=0")  # (its checkpoint)
    swapped = torch.optim.AdamW([*model[1].parameters(), *model[0].parameters()], lr=0.01)
    again.wrap(swapped)
    again.close()
    resumed = _moments_by_name(model, swapped)
    assert set(resumed) == set(saved) and all(torch.equal(resumed[n], saved[n]) for n in saved)


def test_a_checkpoint_written_through_torch_compiles_wrapper_resumes(tmp_path):
    """Before join took a compiled model's inner module, its checkpoints named everything
    '_orig_mod.<name>'; such a state.dir resumes."""
    import dataclasses

    from geotrain.node.state import CheckpointStore

    model = make_model()
    swarm = joined(tmp_path, "a", model, "training.wait_for_peers=0")
    train(swarm, model, 3, seed=1)
    swarm.close()
    trained = [p.detach().clone() for p in model.parameters()]
    store = CheckpointStore(tmp_path / "a" / "checkpoints", keep=5)
    ckpt, _ = store.load_latest()
    assert ckpt is not None and ckpt.step == 3
    renamed = {k.replace("model/", "model/_orig_mod.", 1): v for k, v in ckpt.tensors.items()}
    store.save(dataclasses.replace(ckpt, tensors=renamed))  # as the compiled wrapper wrote it
    again = make_model(seed=9)
    swarm = joined(tmp_path, "a", again, "training.wait_for_peers=0")
    try:
        assert swarm.step == 3
        assert all(torch.equal(a, b) for a, b in zip(again.parameters(), trained, strict=True))
    finally:
        swarm.close()


def test_the_memory_estimate_counts_the_wrapped_optimizers_state(tmp_path):
    """At join the loop's optimizer is not known: the estimate counts Adam's two moments and its
    step's temporaries (two of the largest tensor: torch's default on CPU), and says it assumed
    them; wrap() measures the real one (SGD without momentum keeps no state and makes none: four
    model copies less in status here; with momentum one)."""
    from geotrain.node._memory import optimizer_state_copies

    model = nn.Linear(1000, 1000)  # 1M parameters: 4 MB a copy
    copy_mb = 4.004
    with joined(tmp_path, "m", model) as swarm:
        at_join = swarm.node.memory
        assert ("adam's state (2) and its step's temporaries (2), assumed until wrap() shows "
                "yours") in at_join.explain()  # fmt: skip
        swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.1))
        wrapped = swarm.node.memory
        assert "SGD's state (0)" in wrapped.explain()
        assert at_join.total_gb * 1000 - wrapped.total_gb * 1000 == pytest.approx(4 * copy_mb,
                                                                                  rel=0.01)
        assert swarm.status().memory_estimate_mb == pytest.approx(wrapped.total_gb * 1000)
    assert optimizer_state_copies(torch.optim.SGD(model.parameters(), 0.1, momentum=0.9))[0] == 1
    # Adam's step: two temporaries of each tensor in turn (one weight of 1M here: 2 copies) on
    # torch's default, one of every tensor at once with foreach, none fused
    assert optimizer_state_copies(torch.optim.Adam(model.parameters(), amsgrad=True)) == (
        pytest.approx(3 + 2, rel=1e-3), "Adam's state (3) and its step's temporaries (2)")
    assert optimizer_state_copies(torch.optim.AdamW(model.parameters(), foreach=True))[0] == 3
    assert optimizer_state_copies(torch.optim.AdamW(model.parameters(), fused=True))[0] == 2
    base = nn.Linear(2000, 2000).requires_grad_(False)  # a frozen base given to it too: no step
    both = torch.optim.AdamW([*base.parameters(), *model.parameters()])
    assert optimizer_state_copies(both)[0] == pytest.approx(2 + 2, rel=1e-3)
    assert optimizer_state_copies(torch.optim.RMSprop(model.parameters(), centered=True))[0] == 2
    lbfgs = optimizer_state_copies(torch.optim.LBFGS(model.parameters()))
    assert lbfgs == (2.0, "LBFGS's state (2, assumed: an optimizer not known here)")


def test_an_optimizer_bigger_than_the_guess_at_join_is_warned_about(tmp_path, capsys):
    # Adam-sized (its step's temporaries counted): 0.658 GB; with amsgrad's third copy 0.662 GB
    model = nn.Linear(1000, 1000)
    with joined(tmp_path, "m", model, "limits.memory_gb=0.660") as swarm:
        capsys.readouterr()
        swarm.wrap(torch.optim.Adam(model.parameters(), amsgrad=True))
        logged = capsys.readouterr()
    line = next(x for x in (logged.out + logged.err).splitlines()
                if "memory_estimate" in x and "Adam's state (3)" in x)  # fmt: skip
    assert "warning" in line and "may outgrow limits.memory_gb" in line, line


def test_a_one_cycle_resume_with_the_same_settings_says_nothing(tmp_path):
    # OneCycleLR moves SGD's momentum each step: the one given at wrap (its max) differs from a
    # checkpoint's mid-cycle one on every resume, and that is the schedule's doing
    from structlog.testing import capture_logs

    def one_cycle(model):
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return sgd, torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.1, total_steps=100)

    model = make_model()
    with joined(tmp_path, "c", model) as swarm:
        sgd, schedule = one_cycle(model)
        opt = swarm.wrap(sgd, schedule)
        for _ in range(10):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
    with joined(tmp_path, "c", model) as swarm, capture_logs() as logs:
        swarm.wrap(*one_cycle(model))
    assert not [e for e in logs if e["event"] == "optimizer_settings_from_checkpoint"], logs


def test_join_turns_sigterm_into_an_exit_until_close_and_keeps_a_handler_of_ones_own(tmp_path):
    """Without a handler SIGTERM ended the program past its exit handlers (no checkpoint, no
    leave); join installs one while a swarm is open, and leaves a program's own alone."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        swarm = joined(tmp_path, "a", make_model())
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        with pytest.raises(SystemExit) as exited:
            handler(signal.SIGTERM, None)
        assert exited.value.code == 143
        swarm.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

        def mine(*_):
            pass

        signal.signal(signal.SIGTERM, mine)
        swarm = joined(tmp_path, "b", make_model())
        assert signal.getsignal(signal.SIGTERM) is mine
        swarm.close()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
