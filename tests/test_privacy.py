"""Differential privacy ([privacy], Opacus): epsilon grows with the steps, training on the node's
data stops at the budget (mixing-only steps after it), a model Opacus cannot handle is refused at
start with its own words, the config's checks, status and metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio
from torch import nn

import geotrain
from geotrain.node import ConfigError, Identity, TaskContext, Trainer, resolve_task
from geotrain.node._config import config_from_toml
from geotrain.node.identity import Admission
from geotrain.node.state import CheckpointStore, StateDir
from geotrain.node.training import PrivacyError, Task, make_private

pytest.importorskip("opacus")


def _digits(shard: int = 0, shards: int = 8) -> Trainer:
    return Trainer(resolve_task("digits-mlp")(TaskContext(shard_index=shard, num_shards=shards)))


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return trainer.snapshot()


def test_epsilon_grows_with_every_step_and_training_stops_at_the_budget():
    trainer = _digits()
    private = make_private(trainer, epsilon=2.0, delta=1e-5, max_grad_norm=1.0,
                           noise_multiplier=2.0)  # fmt: skip
    assert private.sample_rate == pytest.approx(32 / trainer.task.train_size)
    spent = [0.0]
    while not private.exhausted:
        before = _params(trainer)
        trainer.train_step()
        if private.exhausted:
            break
        assert private.epsilon() > spent[-1]  # every private step costs something
        assert not all(torch.equal(before[k], v) for k, v in _params(trainer).items())
        spent.append(private.epsilon())
        assert len(spent) < 1000, "the budget should be spent long before this"
    assert len(spent) > 5  # (2.0 lasts about 15 steps at this noise and sample rate)
    assert spent[-1] <= 2.0 < spent[-1] + (spent[-1] - spent[-2]) * 2  # stopped at the budget
    steps = private.steps
    assert steps == len(spent) - 1 and trainer.step == steps + 1
    # after the budget: no batch is read, no gradient taken, the step counter goes on
    batches = trainer.task.batches
    frozen = _params(trainer)
    for _ in range(3):
        trainer.train_step()
    assert all(torch.equal(frozen[k], v) for k, v in _params(trainer).items())
    assert private.steps == steps and trainer.step == steps + 4
    assert trainer.task.batches is batches and private.statistics().exhausted


def test_the_budget_stops_training_at_exactly_the_accountants_last_step_within_it(monkeypatch):
    from opacus.accountants import RDPAccountant

    trainer = _digits()
    private = make_private(trainer, epsilon=2.0, noise_multiplier=2.0)
    # the accountant alone, step by step: the last step count whose epsilon is within 2.0
    alone, within = RDPAccountant(), 0
    while True:
        alone.step(noise_multiplier=2.0, sample_rate=private.sample_rate)
        if alone.get_epsilon(1e-5) > 2.0:
            break
        within += 1
    # a private step asks the accountant nothing (a query costs more than a small step)
    asked = []
    real = RDPAccountant.get_epsilon
    monkeypatch.setattr(RDPAccountant, "get_epsilon",
                        lambda self, delta, **kw: asked.append(1) or real(self, delta, **kw))
    for _ in range(within):
        trainer.train_step()
    assert asked == [] and private.steps == within and not private.exhausted
    for _ in range(3):  # the budget is spent: mixing-only steps, said once (with the epsilon)
        trainer.train_step()
    # (and epsilon, said with it, comes from one step's divergence: no slow query either)
    assert private.steps == within and private.exhausted and asked == []
    check = RDPAccountant()
    check.history = [(2.0, private.sample_rate, within)]
    assert private.epsilon() == pytest.approx(real(check, 1e-5)) and private.epsilon() <= 2.0


def folding_mlp(ctx: TaskContext) -> Task:
    """A model that folds its batch into the feature dimension before a layer: Opacus gets no
    per-sample gradient of that layer."""

    class Fold(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b = x.shape[0]
            h = self.inner(x.reshape(b * 2, 2).repeat(1, 2))  # (2b, 4): the batch folded in
            return self.outer(h.reshape(b, 2, 4).sum(1))

    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))

    def batches():
        while True:
            yield x[:16], y[:16]

    return Task(model=Fold(), batches=batches(), metric="accuracy", train_size=64,
                loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                evaluate=lambda m: 0.0)  # fmt: skip


def test_a_model_without_per_sample_gradients_is_refused_at_start_naming_the_layer():
    trainer = Trainer(folding_mlp(TaskContext()))
    before = _params(trainer)
    with pytest.raises(PrivacyError, match=r"inner.weight \(32\), inner.bias \(32\)"):
        make_private(trainer, epsilon=1.0, noise_multiplier=1.0)
    assert all(torch.equal(before[k], v) for k, v in _params(trainer).items())
    assert all(p.grad is None for p in trainer.model.parameters())  # the dry pass left nothing


def test_the_gpt_task_trains_privately():
    task = resolve_task("gpt")(TaskContext(shard_index=0, num_shards=4, params={"size": "1m"}))
    trainer = Trainer(task)
    private = make_private(trainer, epsilon=8.0, noise_multiplier=1.0, sample_rate=0.01)
    before = _params(trainer)
    trainer.train_step()
    assert private.steps == 1 and 0 < private.epsilon() <= 8.0
    assert not all(torch.equal(before[k], v) for k, v in _params(trainer).items())


def test_a_restart_from_a_checkpoint_goes_on_spending_the_same_budget():
    import json

    trainer = _digits()
    private = make_private(trainer, epsilon=5.0, noise_multiplier=2.0)
    for _ in range(4):
        trainer.train_step()
    tensors, meta = trainer.state_tensors()
    meta = json.loads(json.dumps(meta))  # as a checkpoint stores it
    restarted = _digits()
    again = make_private(restarted, epsilon=5.0, noise_multiplier=2.0)
    restarted.restore(tensors, meta, meta["step"])
    assert again.epsilon() == pytest.approx(private.epsilon()) and again.steps == 4
    restarted.train_step()
    assert again.epsilon() > private.epsilon()


def test_without_a_noise_multiplier_the_budget_is_spread_over_the_planned_steps():
    trainer = _digits()
    private = make_private(trainer, epsilon=3.0, planned_steps=40)
    for _ in range(40):
        trainer.train_step()
    assert private.steps == 40 and not private.exhausted
    assert 2.5 < private.epsilon() <= 3.0


def batchnorm_mlp(ctx: TaskContext) -> Task:
    """A task whose model Opacus refuses (BatchNorm mixes the samples of a batch)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))

    def batches():
        while True:
            yield x[:16], y[:16]

    return Task(model=model, batches=batches(), metric="accuracy", train_size=64,
                loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                evaluate=lambda m: 0.0)  # fmt: skip


def test_a_model_opacus_cannot_handle_is_refused_in_its_words(tmp_path):
    trainer = Trainer(batchnorm_mlp(TaskContext()))
    with pytest.raises(PrivacyError, match="BatchNorm cannot support training with differential"):
        make_private(trainer, epsilon=1.0, noise_multiplier=1.0)
    cfg = config_from_toml(
        '[identity]\nopen_swarm = true\n[training]\ntask = "test_privacy:batchnorm_mlp"\n'
        "[privacy]\nepsilon = 1.0\nnoise_multiplier = 1.0\n",
        base=tmp_path, overrides=[f'state.dir="{tmp_path / "n"}"'],
    )  # fmt: skip

    async def start() -> None:
        admission = Admission.open_swarm("geotrain")
        async with geotrain.open_node(cfg, identity=Identity.generate(), admission=admission):
            pass

    with pytest.raises(ConfigError, match=r"privacy: Opacus cannot make this model private: .*"
                                          "BatchNorm"):  # fmt: skip
        trio.run(start)


def test_a_budget_no_noise_can_keep_names_epsilon():
    # it was Opacus' bare "The privacy budget is too low.", naming no setting
    with pytest.raises(PrivacyError, match=r"epsilon = 1e-09: no noise multiplier spends it in "
                       r"100 steps .* set privacy.noise_multiplier"):  # fmt: skip
        make_private(_digits(), epsilon=1e-9, planned_steps=100)


def test_privacy_settings_are_checked_and_name_the_field():
    base, ident = Path("."), "[identity]\nopen_swarm = true\n"
    assert not config_from_toml(ident, base=base).privacy.enabled
    with pytest.raises(ConfigError, match=r"privacy.noise_multiplier = None: expected a value, or "
                                          r"training.max_steps > 0"):  # fmt: skip
        config_from_toml(ident + "[privacy]\nepsilon = 3.0\n", base=base)
    with pytest.raises(ConfigError, match=r"privacy.delta = 2.0: expected 0 < delta < 1"):
        config_from_toml(ident + "[privacy]\nepsilon = 3.0\ndelta = 2.0\n", base=base)
    with pytest.raises(ConfigError, match=r"training.clip_grad_norm = 1.0: expected unset with"):
        config_from_toml(ident + "[training]\nclip_grad_norm = 1.0\nmax_steps = 10\n"
                         "[privacy]\nepsilon = 3.0\n", base=base)  # fmt: skip
    ok = config_from_toml(ident + "[training]\nmax_steps = 100\n[privacy]\nepsilon = 8\n",
                          base=base)  # fmt: skip
    assert ok.privacy.epsilon == 8.0 and ok.privacy.delta == 1e-5
    # a [privacy] table without its epsilon trained with no privacy at all, and said nothing
    with pytest.raises(ConfigError, match=r"privacy.epsilon = None: expected a budget: the "
                                          r"\[privacy\] table sets delta, max_grad_norm but no"):
        config_from_toml(ident + "[privacy]\ndelta = 1e-5\nmax_grad_norm = 1.0\n", base=base)
    with pytest.raises(ConfigError, match=r"privacy.epsilon = None: .* sets nothing"):
        config_from_toml(ident + "[privacy]\n", base=base)


async def test_status_and_metrics_show_the_spent_epsilon_and_the_node_says_when_it_stops(
    tmp_path, capsys
):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    cfg = config_from_toml(
        '[identity]\nopen_swarm = true\n[training]\ntask = "digits-mlp"\nmax_steps = 20\n'
        "num_shards = 8\n[privacy]\nepsilon = 1.5\nnoise_multiplier = 2.0\n"
        '[metrics]\nlisten = "127.0.0.1:0"\n[state]\nstatus_every_s = 0.1\n',
        base=tmp_path, overrides=[f'state.dir="{tmp_path / "n"}"'],
    )  # fmt: skip
    admission = Admission.open_swarm("geotrain")
    async with geotrain.open_node(cfg, identity=Identity.generate(), admission=admission) as node:
        with trio.fail_after(120):
            await node.wait_stopped()
        status = node.status()
        text = (await trio.to_thread.run_sync(generate_latest, node.metrics.registry)).decode()
    assert status.privacy_budget == 1.5 and status.privacy_exhausted
    from geotrain.node.state import render_status

    shown = render_status(status.to_json())  # what `geotrain status` prints
    assert f"privacy   epsilon {status.privacy_epsilon:.3f} of 1.5  BUDGET SPENT" in shown
    assert 1.0 < status.privacy_epsilon <= 1.5
    families = {f.name: f for f in text_string_to_metric_families(text)}
    spent = families["geotrain_privacy_epsilon_spent"].samples[0].value
    assert spent == pytest.approx(status.privacy_epsilon)
    out = capsys.readouterr().out
    assert "privacy_budget_spent" in out and "privacy_epsilon" in out


def test_the_ledger_records_private_steps_before_they_are_taken_and_a_clean_stop_settles_it():
    trainer = _digits()
    private = make_private(trainer, epsilon=8.0, noise_multiplier=2.0)
    written: list[dict] = []
    private.ledger = written.append
    for taken in range(1, 46):
        trainer.train_step()
        # every step taken was in the ledger before it: a SIGKILL now loses none of them
        assert private.steps_in(written[-1]) >= taken
    assert len(written) == 3  # steps 1-20, 21-40, 41-60: one durable write per block
    assert private.steps_in(written[-1]) == 60
    private.settle()
    assert private.steps_in(written[-1]) == 45 == private.steps_in(private.state())
    with pytest.raises(ValueError, match="history entry"):
        private.steps_in({"history": [[2.0, 0.5, "many"]]})
    with pytest.raises(ValueError, match="expected"):
        private.steps_in({"history": {"abc": 1}})
    with pytest.raises(ValueError, match="steps 'x'"):
        private.steps_in({"history": [], "steps": "x"})


def test_epsilon_is_the_rdp_accountants_own_figure():
    # (computed from one step's divergence times the steps: opacus' own, without the 20-250 ms
    # a query took, which made every start and restore seconds longer)
    trainer = _digits()
    private = make_private(trainer, epsilon=8.0, noise_multiplier=2.0)
    for _ in range(7):
        trainer.train_step()
    private.accountant.history.insert(0, (0.7, 0.01, 30))  # (a mechanism of an earlier run)
    for more in (0, 1, 50, 400):
        probe = type(private.accountant)()
        probe.history = [*private.accountant.history]
        if more:
            probe.history.append((private.noise_multiplier, private.sample_rate, more))
        assert private._epsilon_after(more) == pytest.approx(probe.get_epsilon(private.delta))


def test_a_killed_node_restarts_with_the_budget_its_steps_after_the_checkpoint_spent(tmp_path):
    # the accountant was restored from the last checkpoint only: a node SIGKILLed 1700 steps
    # after it came back with the budget of those steps unspent, though the models they made
    # had been sent
    import signal

    from _swarm import LocalSwarm

    swarm = LocalSwarm(tmp_path, common={
        "training": {"task": "digits-mlp", "threads": 1, "num_shards": 8, "max_steps": 0},
        "privacy": {"epsilon": 8.0, "noise_multiplier": 2.0},
        "state": {"checkpoint_every": 100_000, "status_every_s": 0.1},
    })  # fmt: skip
    try:
        node = swarm.start(swarm.add("n"))
        swarm.wait_until(lambda: (node.status() or {}).get("step", 0) >= 60, 120, "step 60")
        seen = node.status()["privacy_epsilon"]
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(10)
        swarm.start(node)
        swarm.wait_until(lambda: "privacy_ledger_ahead" in node.log_text(), 60, "the ledger")
        swarm.wait_until(lambda: (node.status() or {}).get("pid") == node.proc.pid, 60, "status")
        assert node.status()["privacy_epsilon"] >= seen > 0
        node.proc.send_signal(signal.SIGTERM)
        swarm.wait_all(timeout=60)
        ledger = json.loads((node.state / "privacy.json").read_text())
        # a clean stop records exactly what was spent, as its final checkpoint does
        ckpt, _ = CheckpointStore(StateDir(node.state).checkpoints).load_latest()
        assert ledger == ckpt.meta["privacy"]
        (node.state / "privacy.json").write_text("{not json")
        swarm.start(node)
        assert node.proc.wait(60) != 0
        assert "the privacy ledger" in node.log_text() and "cannot be read" in node.log_text()
    finally:
        swarm.stop_all()


def test_a_restart_spreads_what_is_left_of_the_budget_over_the_steps_left():
    """A stranger's swarm: 7.99 of epsilon 8 spent in 3,000 steps, restarted with max_steps
    raised to 1,000,000; the noise was derived afresh for the whole budget over all of them
    (15.5 where it had been 1.10) and every model went to chance."""
    first = make_private(_digits(), epsilon=8.0, planned_steps=300)
    sigma = first.noise_multiplier
    half = {"history": [[sigma, first.sample_rate, 150]], "steps": 150, "exhausted": False,
            "budget": 8.0}  # fmt: skip
    # restarted halfway with the same plan: the same noise goes on (not the fresh derivation)
    again = make_private(_digits(), epsilon=8.0, planned_steps=300)
    again.load_state(half)
    assert again.replan(150) is None and again.noise_multiplier == sigma
    assert again.optimizer.noise_multiplier == sigma
    # asked for 100x the steps: what is left over what is left needs far more noise
    longer = make_private(_digits(), epsilon=8.0, planned_steps=30_000)
    longer.load_state(half)
    was, now = longer.replan(30_000 - 150)
    assert was == sigma and now > 2 * sigma
    assert longer.optimizer.noise_multiplier == now == longer.noise_multiplier
    # ... and it spends the budget by then (to the search's 1% of noise), never more
    assert 7.8 <= longer._epsilon_after(30_000 - 150) <= 8.0
    # fewer steps left than planned: the noise it had is kept, not lowered
    fewer = make_private(_digits(), epsilon=8.0, planned_steps=300)
    fewer.load_state(half)
    assert fewer.replan(20) is None and fewer.noise_multiplier == sigma
    # a noise the user set is theirs: never re-derived
    fixed = make_private(_digits(), epsilon=8.0, noise_multiplier=1.0)
    fixed.load_state({"history": [[1.0, fixed.sample_rate, 100]], "steps": 100})
    assert fixed.replan(10_000) is None and fixed.noise_multiplier == 1.0


def test_a_spent_budget_raised_by_the_operator_trains_again():
    """After the budget ran out at 2.0, a restart with epsilon 8 kept the spent flag: the node
    said "epsilon 1.9997, budget 8.0 ... privacy_budget_spent" and trained no more."""
    spent = make_private(_digits(), epsilon=2.0, noise_multiplier=2.0)
    k = spent._allowed + 1  # (one step past the budget of 2.0)
    ledger = {"history": [[2.0, spent.sample_rate, k]], "steps": k, "exhausted": True,
              "budget": 2.0}  # fmt: skip
    spent.load_state(ledger)
    assert spent.exhausted and not spent.budget_raised and spent.would_exceed()
    raised = make_private(_digits(), epsilon=8.0, noise_multiplier=2.0)
    raised.load_state(ledger)
    assert not raised.exhausted and raised.budget_raised and not raised.would_exceed()
    # the same budget with more noise (or a ledger that does not say its budget): still spent
    louder = make_private(_digits(), epsilon=2.0, noise_multiplier=50.0)
    louder.load_state(ledger)
    assert louder.exhausted and not louder.budget_raised
    unsaid = make_private(_digits(), epsilon=8.0, noise_multiplier=2.0)
    unsaid.load_state({**ledger, "budget": None})
    assert unsaid.exhausted and not unsaid.budget_raised


def test_a_budget_spent_without_the_flag_is_found_spent_at_restart():
    """A node killed after spending its budget left a ledger without the spent flag (it is only
    written at a clean stop); restarted with steps left, the search for a noise went to 1e6."""
    first = make_private(_digits(), epsilon=2.0, planned_steps=300)
    sigma = first.noise_multiplier
    k = first._allowed  # its whole budget
    killed = make_private(_digits(), epsilon=2.0, planned_steps=300)
    killed.load_state({"history": [[sigma, killed.sample_rate, k]], "steps": k,
                       "exhausted": False, "budget": 2.0})  # fmt: skip
    assert killed.replan(100) is None and killed.exhausted and killed.would_exceed()


async def test_a_node_refuses_to_spread_a_spent_budget_over_far_more_steps(tmp_path, capsys):
    import re

    from geotrain.node._open_node import leaf_errors

    # (20 ms steps: the first node must be stopped part way, and at full speed its 30 steps fit
    # in one 0.1 s status period, so a loaded box let it finish and spend its whole budget)
    toml = ('[identity]\nopen_swarm = true\n[training]\ntask = "digits-mlp"\nmax_steps = 30\n'
            "num_shards = 8\nstep_time_ms = 20\n[privacy]\nepsilon = 3.0\n[state]\n"
            "status_every_s = 0.1\n")
    admission = Admission.open_swarm("geotrain")
    state = [f'state.dir="{tmp_path / "n"}"']
    cfg = config_from_toml(toml, base=tmp_path, overrides=state)
    async with geotrain.open_node(cfg, identity=Identity.generate(), admission=admission) as node:
        with trio.fail_after(120):  # stopped a third of the way through its 30 steps
            while node.status().step < 10:
                await trio.sleep(0.05)
        node.request_stop()
        await node.wait_stopped()
    more = config_from_toml(toml, base=tmp_path, overrides=[*state, "training.max_steps=30000"])
    with pytest.raises(BaseExceptionGroup) as info:
        async with geotrain.open_node(more, identity=Identity.generate(), admission=admission):
            pass
    [refused] = leaf_errors(info.value)
    assert isinstance(refused, ConfigError)
    assert re.search(r"privacy: epsilon .* of 3 is spent .* the 299\d\d steps left of "
                     r"training.max_steps \(30000\) needs noise", str(refused)), refused
    # a few more steps than planned: the noise rises a little, and the node says so
    some = config_from_toml(toml, base=tmp_path, overrides=[*state, "training.max_steps=45"])
    async with geotrain.open_node(some, identity=Identity.generate(), admission=admission) as node:
        with trio.fail_after(120):
            await node.wait_stopped()
        assert node.status().privacy_epsilon <= 3.0
    assert "privacy_noise_replanned" in capsys.readouterr().out


def test_a_node_restarted_spent_keeps_the_pace_of_its_private_steps():
    """Restarted with its budget spent, a node paced its mixing-only steps by their own waits:
    19 steps/s where its private steps had gone at 10 (a stranger's run), so its exchanges
    came twice as often and max_steps came early."""
    trainer = _digits()
    private = make_private(trainer, epsilon=2.0, noise_multiplier=2.0)
    for _ in range(3):
        trainer.train_step()
    assert private.step_s is not None and private.state()["step_s"] == private.step_s
    k = private._allowed + 3  # (past the budget: spent)
    ledger = {"history": [[2.0, private.sample_rate, k]], "steps": k, "exhausted": True,
              "step_s": 0.2}  # fmt: skip
    restarted = _digits()
    make_private(restarted, epsilon=2.0, noise_multiplier=2.0).load_state(ledger)
    results = [restarted.train_step() for _ in range(3)]
    assert all(0.19 <= r.seconds < 0.5 for r in results), [r.seconds for r in results]
