"""State sync on the in-memory network, on a virtual clock: a joiner fetches a model in chunks, and
a server that goes away or sends garbage mid-stream leaves the joiner's model as it was; the
server's optimizer state follows the model, or, when it does not fit, the joiner's optimizer
starts fresh."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import trio
from _runtimes import same, trainer

from geotrain.gossip import LinkTable
from geotrain.node import TaskContext, Trainer, resolve_task
from geotrain.node._protocol import StateReply, StateRequest
from geotrain.node._state_sync import StateSync
from geotrain.node.algorithms import ChunkPlan, inline
from geotrain.node.testing import StaticMembership, open_memory_network
from geotrain.node.training import LoopTrainer
from geotrain.node.transport import ErrorReply, PeerInfo


class Replaced:
    """Stands in for the algorithm: counts `model_replaced` calls."""

    def __init__(self) -> None:
        self.calls = 0

    def model_replaced(self) -> None:
        self.calls += 1


def sync(t, net, me: str, peers, chunk_numel: int = 8, **kw) -> tuple[StateSync, Replaced]:
    algo = Replaced()
    transport = net.add(me, _unset)
    s = StateSync(t, algo, "adpsgd", transport, StaticMembership(list(peers)), LinkTable(),
                  random.Random(0), chunk_numel=chunk_numel, max_chunk_numel=1000,
                  to_thread=inline, **kw)  # fmt: skip
    net.set_handler(me, s.handle)
    return s, algo


async def _unset(peer, header, payload):
    raise RuntimeError("no handler yet")


async def test_a_joiner_fetches_the_model_in_chunks(autojump_clock):
    server, joiner = trainer(0, 2), trainer(1, 2)
    for _ in range(5):
        server.train_step()
    async with open_memory_network() as net:
        sync(server, net, "server", ["joiner"])
        s, algo = sync(joiner, net, "joiner", ["server"])
        assert await s.fetch(trio.Event())
        assert same(joiner.snapshot(), server.snapshot()) and algo.calls == 1
        assert net.bytes_sent[("joiner", "server")] > 0  # five chunk requests went out


async def test_a_server_gone_mid_stream_leaves_the_joiner_as_it_was(autojump_clock):
    server, joiner = trainer(0, 2), trainer(1, 2)
    server.train_step()
    before = joiner.snapshot()
    async with open_memory_network() as net:
        net.set_delay("joiner", "server", 0.1)
        sync(server, net, "server", ["joiner"])
        s, algo = sync(joiner, net, "joiner", ["server"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.fetch, trio.Event())
            await trio.sleep(0.25)  # chunk 0 is in, chunks 1-4 on their way
            net.remove("server")
        assert same(joiner.snapshot(), before) and algo.calls == 0


@pytest.mark.parametrize("lie", ["nonfinite", "wrong chunk", "other plan"])
async def test_a_server_that_lies_is_refused_and_the_joiner_keeps_its_model(autojump_clock, lie):
    joiner = trainer(1, 2)
    before = joiner.snapshot()
    liar = trainer(0, 2)
    liar.update(lambda live: [t.fill_(float("nan")) for t in live.values()] if lie == "nonfinite"
                else None)  # fmt: skip
    plan = ChunkPlan.for_model(liar.params(), 32)

    async def lying(peer, header, payload):
        index = 0 if lie == "wrong chunk" else header.index  # always sends chunk 0
        from geotrain.node.algorithms import encode_chunk, read_chunk

        data = encode_chunk(read_chunk(liar, plan, index), "none")
        chunks = len(plan) + (1 if lie == "other plan" else 0)
        return StateReply(step=3, chunks=chunks), data

    async with open_memory_network() as net:
        net.add("liar", lying)
        s, algo = sync(joiner, net, "joiner", ["liar"])
        with trio.move_on_after(10):
            await s.fetch(trio.Event())
        assert same(joiner.snapshot(), before) and algo.calls == 0


async def test_a_request_for_another_algorithm_or_plan_is_refused(autojump_clock):
    server = trainer(0, 2)
    async with open_memory_network() as net:
        s, _ = sync(server, net, "server", [])
        plan = ChunkPlan.for_model(server.params(), 32)
        peer = PeerInfo("x", b"", "mem://x", "inbound")
        for request, why in [
            (StateRequest(algorithm="choco", plan=plan.digest, chunk_numel=8, index=0), "runs"),
            (StateRequest(algorithm="adpsgd", plan=123, chunk_numel=8, index=0), "differ"),
            (StateRequest(algorithm="adpsgd", plan=plan.digest, chunk_numel=8, index=99), "99"),
            (StateRequest(algorithm="adpsgd", plan=plan.digest, chunk_numel=10**9, index=0),
             "chunks of"),
        ]:
            reply, data = await s.handle(peer, request, memoryview(b""))
            assert isinstance(reply, ErrorReply) and why in reply.reason and data == b""
        torch.testing.assert_close(server.snapshot(), server.snapshot())


async def test_with_untrusted_peers_a_donors_optimizer_state_is_not_taken(autojump_clock, capsys):
    # one admitted attacker's momentum of 1e30 (finite: taken) left a late joiner at chance
    # accuracy for good; with gossip.robust set the joiner's optimizer starts fresh
    attacker, joiner = trainer(0, 2), trainer(1, 2)
    for _ in range(5):
        attacker.train_step()
    for st in attacker.optimizer.state.values():
        st["momentum_buffer"].fill_(1e30)
    async with open_memory_network() as net:
        sync(attacker, net, "attacker", ["joiner", "trusting"])
        s, _ = sync(joiner, net, "joiner", ["attacker"], untrusted=True)
        assert await s.fetch(trio.Event())
        assert same(joiner.snapshot(), attacker.snapshot())  # the model, with its checks
        assert optimizer_state(joiner) == {}
        assert "optimizer_state_not_taken" in capsys.readouterr().out
        trusting = trainer(1, 2)
        s, _ = sync(trusting, net, "trusting", ["attacker"])
        assert await s.fetch(trio.Event())  # without gossip.robust: taken, as before
        assert optimizer_state(trusting)


@pytest.mark.parametrize("lie", ["huge", "sign flip"])
async def test_with_untrusted_peers_the_model_is_the_median_of_three_donors(autojump_clock, lie,
                                                                           capsys):  # fmt: skip
    # one admitted attacker as the only donor hands a joiner any model it likes (finite values
    # pass every check a joiner can make); with gossip.robust set each value is the median of
    # three donors', so one liar among them moves no value beyond the two honest ones'
    honest = [trainer(0, 4), trainer(1, 4)]
    for i, t in enumerate(honest):
        for _ in range(3 + 2 * i):
            t.train_step()
    liar = trainer(2, 4)
    liar.update(lambda live: [t.fill_(1e6) if lie == "huge" else t.copy_(-1000 * t)
                              for t in live.values()])  # fmt: skip
    joiner = trainer(3, 4)
    async with open_memory_network() as net:
        for name, t in [("h0", honest[0]), ("h1", honest[1]), ("liar", liar)]:
            sync(t, net, name, ["joiner"])
        s, algo = sync(joiner, net, "joiner", ["h0", "h1", "liar"], untrusted=True)
        assert await s.fetch(trio.Event())
        assert algo.calls == 1
        for donor in ("h0", "h1", "liar"):  # every chunk was asked of each of the three
            assert net.bytes_sent[(donor, "joiner")] >= 4 * sum(
                t.numel() for t in joiner.params().values())  # fmt: skip
    got, (a, b), bad = joiner.snapshot(), [t.snapshot() for t in honest], liar.snapshot()
    for name, value in got.items():
        low, high = torch.minimum(a[name], b[name]), torch.maximum(a[name], b[name])
        assert bool(((low <= value) & (value <= high)).all()), name
        assert torch.equal(value, torch.stack([a[name], b[name], bad[name]]).median(0).values)
    assert not same(got, a) and not same(got, b)  # each value's median: no one donor's model
    out = capsys.readouterr().out
    assert "state_synced" in out and "donors=3" in out and "state_sync_few_donors" not in out
    # without gossip.robust the first donor's model is taken whole (here, the liar's, when drawn)
    trusting = trainer(3, 4)
    async with open_memory_network() as net:
        sync(liar, net, "liar", ["trusting"])
        s, _ = sync(trusting, net, "trusting", ["liar"])
        assert await s.fetch(trio.Event())
        assert same(trusting.snapshot(), liar.snapshot())


async def test_with_untrusted_peers_a_donor_that_cannot_serve_is_left_out(autojump_clock,
                                                                         capsys):  # fmt: skip
    # three dialable peers, one of which refuses every chunk: the joiner must not retry it in
    # every try (all of them failed and it trained from scratch); once DONOR_WAIT_S is over it
    # syncs from the two that serve
    honest = [trainer(0, 3), trainer(1, 3)]
    joiner = trainer(2, 3)

    async def refusing(peer, header, payload):
        return ErrorReply(code="bad_request", reason="not serving"), b""

    async with open_memory_network() as net:
        for name, t in [("h0", honest[0]), ("h1", honest[1])]:
            sync(t, net, name, ["joiner"])
        net.add("mute", refusing)
        s, algo = sync(joiner, net, "joiner", ["h0", "h1", "mute"], untrusted=True)
        assert await s.fetch(trio.Event())
    a, b = (t.snapshot() for t in honest)
    assert same(joiner.snapshot(), {k: (a[k] + b[k]) / 2 for k in a}) and algo.calls == 1
    assert "state_sync_few_donors" in capsys.readouterr().out


async def test_with_untrusted_peers_and_one_donor_the_joiner_waits_then_says_so(autojump_clock,
                                                                               capsys):  # fmt: skip
    donor, joiner = trainer(0, 2), trainer(1, 2)
    async with open_memory_network() as net:
        sync(donor, net, "donor", ["joiner"])
        s, _ = sync(joiner, net, "joiner", ["donor"], untrusted=True)
        started = trio.current_time()
        assert await s.fetch(trio.Event())
        assert trio.current_time() - started >= 10.0  # it waited DONOR_WAIT_S for two more
    assert same(joiner.snapshot(), donor.snapshot())
    out = capsys.readouterr().out
    assert "state_sync_few_donors" in out and "one donor's" in out


def optimizer_state(t) -> dict[str, torch.Tensor]:
    sd = t.optimizer.state_dict()["state"]
    return {f"{i}/{k}": v for i, st in sd.items() for k, v in st.items() if torch.is_tensor(v)}


async def test_a_joiner_takes_the_servers_optimizer_state_and_keeps_its_hyperparameters(
    autojump_clock,
):
    server = trainer(0, 2)
    ctx = TaskContext(shard_index=1, num_shards=2, params={})
    joiner = Trainer(resolve_task("synthetic-linreg")(ctx), lr=0.0123)  # its own setting
    for _ in range(5):
        server.train_step()
    async with open_memory_network() as net:
        sync(server, net, "server", ["joiner"])
        s, _ = sync(joiner, net, "joiner", ["server"])
        assert await s.fetch(trio.Event())
        theirs, mine = optimizer_state(server), optimizer_state(joiner)
        assert theirs and set(mine) == set(theirs)  # (momentum buffers, fetched in chunks of 8)
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
        assert joiner.optimizer.param_groups[0]["lr"] == 0.0123
        joiner.train_step()  # and it trains on with them


def adam_trainer(index: int) -> Trainer:
    ctx = TaskContext(shard_index=index, num_shards=2, params={})
    return Trainer(resolve_task("synthetic-linreg")(ctx), optimizer="adam")


@pytest.mark.parametrize("server_kind", ["other optimizer", "no steps yet", "poisoned state",
                                         "oversized layout"])
async def test_an_optimizer_state_that_does_not_fit_leaves_a_fresh_optimizer(
    autojump_clock, server_kind
):
    server = adam_trainer(0) if server_kind != "other optimizer" else trainer(0, 2)
    if server_kind != "no steps yet":
        server.train_step()
    if server_kind == "poisoned state":
        for st in server.optimizer.state.values():
            st["exp_avg"].fill_(float("nan"))
    if server_kind == "oversized layout":  # a state tensor of no parameter's shape (10^12 values)
        layout = server.optimizer_layout()
        server.optimizer_layout = lambda: {**layout, "tensors": [
            *layout["tensors"], ["optim/0/huge", [10**6, 10**6], "float32"]]}
    joiner = adam_trainer(1)
    async with open_memory_network() as net:
        sync(server, net, "server", ["joiner"])
        s, _ = sync(joiner, net, "joiner", ["server"])
        assert await s.fetch(trio.Event())  # the model came all the same
        assert same(joiner.snapshot(), server.snapshot())
        assert optimizer_state(joiner) == {}  # a fresh Adam: no state until its first step
        joiner.train_step()
        assert all(bool(torch.isfinite(v).all()) for v in optimizer_state(joiner).values())


async def library_joiner_synced_from(server: Trainer, make=None
                                     ) -> tuple[torch.nn.Module, LoopTrainer]:  # fmt: skip
    """A library node's trainer (geotrain.join) that state-synced from `server`, and its model;
    with `make`, it then wrapped the optimizer and scheduler `make(model)` returns (scheduler
    None for none) while the server was there: the peer's optimizer state is fetched at wrap,
    once its class is known."""
    model = resolve_task("synthetic-linreg")(TaskContext(shard_index=1, num_shards=2)).model
    joiner = LoopTrainer(model)
    async with open_memory_network() as net:
        sync(server, net, "server", ["joiner"])
        s, _ = sync(joiner, net, "joiner", ["server"])
        assert await s.fetch(trio.Event())
        if make is not None:
            optimizer, scheduler = make(model)
            await trio.to_thread.run_sync(joiner.attach, optimizer, scheduler)  # (the user's wrap)
    return model, joiner


async def library_joiner_wrapped(server: Trainer, make) -> tuple[LoopTrainer, Any, Any]:
    """library_joiner_synced_from with `make`: the trainer, its optimizer and scheduler."""
    _, joiner = await library_joiner_synced_from(server, make)
    return joiner, joiner.optimizer, joiner.scheduler


@pytest.mark.parametrize("wrapped", ["SGD", "Adam"])
async def test_a_library_joiner_gets_the_optimizer_state_at_wrap(autojump_clock, wrapped):
    # joined before its optimizer exists (geotrain.join, then swarm.wrap): the state waits for
    # wrap, then goes into the user's optimizer with the user's own settings, or, when it is
    # another optimizer, is dropped and the user's starts fresh
    server = trainer(0, 2)
    assert type(server.optimizer).__name__ == "SGD"
    for _ in range(5):
        server.train_step()
    def make(model):
        if wrapped == "SGD":
            return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), None
        return torch.optim.Adam(model.parameters(), lr=0.5), None

    joiner, optimizer, _ = await library_joiner_wrapped(server, make)
    assert same(joiner.params(), server.params())
    mine = {f"{i}/{k}": v for i, st in optimizer.state_dict()["state"].items()
            for k, v in st.items() if torch.is_tensor(v)}  # fmt: skip
    if wrapped == "SGD":
        theirs = optimizer_state(server)
        assert theirs and set(mine) == set(theirs)
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    else:
        assert mine == {}
    assert optimizer.param_groups[0]["lr"] == 0.5


async def test_a_library_joiner_refuses_an_optimizer_state_no_model_of_its_could_have(
    autojump_clock, capsys
):
    # before wrap its optimizer is unknown, but not its model: a state tensor of a shape no
    # parameter has (here 10^12 values: memory it must never try to take) is refused at once
    server = trainer(0, 2)
    server.train_step()
    layout = server.optimizer_layout()
    server.optimizer_layout = lambda: {**layout, "tensors": [
        *layout["tensors"], ["optim/0/huge", [10**6, 10**6], "float32"]]}  # fmt: skip
    _, joiner = await library_joiner_synced_from(server)  # the model came
    assert joiner._optimizer_state is None  # nothing of the optimizer's waits for wrap
    assert "shapes no parameter has" in capsys.readouterr().out  # (before any chunk is asked)


def scheduled_trainer(index: int) -> Trainer:
    ctx = TaskContext(shard_index=index, num_shards=2, params={})
    return Trainer(resolve_task("synthetic-linreg")(ctx), warmup_steps=10, schedule="cosine",
                   total_steps=100)  # fmt: skip


async def test_a_joiner_goes_on_from_the_servers_point_in_the_schedule(autojump_clock, capsys):
    # a joiner that warmed up from zero at the swarm's step 30 would train at a tenth of the
    # swarm's rate for its first steps, then cosine-decay 30 steps behind everybody else
    server, joiner = scheduled_trainer(0), scheduled_trainer(1)
    for _ in range(30):
        server.train_step()
    assert joiner.optimizer.param_groups[0]["lr"] != server.optimizer.param_groups[0]["lr"]
    async with open_memory_network() as net:
        sync(server, net, "server", ["joiner"])
        s, _ = sync(joiner, net, "joiner", ["server"])
        assert await s.fetch(trio.Event())
    assert joiner.scheduler.last_epoch == 30 and joiner.step == 0  # (its own steps: none yet)
    assert joiner.optimizer.param_groups[0]["lr"] == server.optimizer.param_groups[0]["lr"]
    server.train_step()
    joiner.train_step()
    assert joiner.optimizer.param_groups[0]["lr"] == server.optimizer.param_groups[0]["lr"]
    assert "schedule_synced" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["cosine", "sequential", "plateau"])
async def test_a_library_joiner_moves_its_own_scheduler_on_at_wrap(autojump_clock, kind):
    # the user's scheduler (any torch scheduler) is stepped to the server's point; one with
    # no step count of its own (ReduceLROnPlateau) is left as it is
    server = scheduled_trainer(0)
    for _ in range(30):
        server.train_step()
    lr = torch.optim.lr_scheduler

    def schedule(optimizer):
        if kind == "cosine":
            return lr.CosineAnnealingLR(optimizer, T_max=100)
        if kind == "sequential":
            return lr.SequentialLR(optimizer, [lr.LinearLR(optimizer, 0.1, total_iters=10),
                                               lr.CosineAnnealingLR(optimizer, T_max=90)],
                                   milestones=[10])  # fmt: skip
        return lr.ReduceLROnPlateau(optimizer)

    def make(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
        return optimizer, schedule(optimizer)

    joiner, optimizer, scheduler = await library_joiner_wrapped(server, make)
    if kind == "plateau":
        assert optimizer.param_groups[0]["lr"] == 1.0
        return
    ref_opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    ref = schedule(ref_opt)  # the same schedule, stepped 30 times by hand
    for _ in range(30):
        ref_opt.step()
        ref.step()
    assert scheduler.last_epoch == 30
    assert optimizer.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    assert optimizer.param_groups[0]["lr"] != 1.0


async def test_a_library_joiner_s_schedule_point_waits_for_a_later_wrap_with_its_scheduler(
        autojump_clock):  # fmt: skip
    """Wrapped first without a scheduler (one made on what wrap returned, wrapped again with
    it), a joiner dropped the peer's point in the schedule: it started over."""
    server = scheduled_trainer(0)
    for _ in range(30):
        server.train_step()
    joiner, optimizer, _ = await library_joiner_wrapped(
        server, lambda model: (torch.optim.SGD(model.parameters(), lr=1.0), None))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    joiner.attach(optimizer, scheduler)
    assert scheduler.last_epoch == 30


def _bn_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6),
                               torch.nn.Linear(6, 1))  # fmt: skip


async def test_a_joiner_takes_its_donors_buffers_and_a_bad_answer_leaves_its_own(autojump_clock):
    # BatchNorm's running statistics are not averaged in exchanges (each node keeps its own
    # data's); a late joiner takes its donor's with the model instead of starting from 0 and 1
    donor, joiner = LoopTrainer(_bn_model(0)), LoopTrainer(_bn_model(0))
    donor.model.train()
    for _ in range(20):
        donor.model(torch.randn(16, 4) * 3 + 1)  # (forward passes move the statistics)
    theirs = {n: t.clone() for n, t in donor.buffers().items()}
    assert sorted(theirs) == ["1.running_mean", "1.running_var"]  # (not num_batches_tracked)
    async with open_memory_network() as net:
        sync(donor, net, "donor", ["joiner"])
        wary = LoopTrainer(_bn_model(0))
        own = {n: t.clone() for n, t in wary.buffers().items()}
        s, _ = sync(wary, net, "wary", ["donor"], untrusted=True)
        assert await s.fetch(trio.Event())  # gossip.robust set: the model, not the buffers
        assert same(wary.buffers(), own)
        s, _ = sync(joiner, net, "joiner", ["donor"])
        assert await s.fetch(trio.Event())
        assert same(joiner.buffers(), theirs)

        async def liar(peer, header, payload):  # the right names, a NaN inside
            from geotrain import compress
            from geotrain.node._protocol import BufferStateReply

            bad = {n: t.clone() for n, t in theirs.items()}
            bad["1.running_var"][0] = float("nan")
            return BufferStateReply(count=2), compress.encode_named(
                sorted(bad.items()), compress.get_codec("none"))

        net.set_handler("donor", liar)
        fresh = LoopTrainer(_bn_model(0))
        kept = {n: t.clone() for n, t in fresh.buffers().items()}
        s, _ = sync(fresh, net, "fresh", ["donor"])
        assert not await s.fetch_buffers("donor", "mem://donor")
        assert same(fresh.buffers(), kept)


@pytest.mark.parametrize("lr", [1.0, torch.tensor(1.0)], ids=["float", "tensor"])
async def test_a_schedule_that_cannot_go_as_far_as_the_swarms_starts_over_as_it_says(
        autojump_clock, capsys, lr):  # fmt: skip
    """A joiner's OneCycleLR of fewer steps than the swarm had taken was stepped to its end
    and left there (learning rate ~0, the cycle spent) while the log said it started over. (A
    tensor lr is set in place by the scheduler: its value is what must come back.)"""
    server = scheduled_trainer(0)
    for _ in range(30):
        server.train_step()
    before = []

    def make(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=20)
        before.extend({k: float(v) if torch.is_tensor(v) else v for k, v in g.items()
                       if k != "params"} for g in optimizer.param_groups)  # fmt: skip
        return optimizer, scheduler

    joiner, optimizer, scheduler = await library_joiner_wrapped(server, make)
    assert "schedule_not_synced" in capsys.readouterr().out
    assert scheduler.last_epoch == 0  # where it was: its 20 steps are the user's to take
    after = [{k: float(v) if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}
             for g in optimizer.param_groups]  # fmt: skip
    assert after == before  # lr and momentum
    for _ in range(20):  # the whole cycle still runs
        optimizer.step()
        scheduler.step()
