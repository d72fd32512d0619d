"""Ways to hold the own-loop API wrong are said at once (MisuseWarning), and refusals reach the
user as public, typed errors with one short traceback."""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import geotrain
from geotrain.node import Admission, Identity, config_from_toml

CONFIG = """
[identity]
open_swarm = true
[gossip]
probe_interval_s = 0.2
[state]
status_every_s = 0.2
"""


def joined(tmp_path: Path, name: str, model: nn.Module, *overrides: str) -> geotrain.Swarm:
    config = config_from_toml(CONFIG, base=tmp_path,
                              overrides=[f'state.dir="{tmp_path / name}"', *overrides])
    return geotrain.join(config, model, identity=Identity.generate(),
                         admission=Admission.open_swarm("geotrain"))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def step(opt, m: nn.Module, features: int = 0) -> None:
    m(torch.randn(8, features or m.in_features)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_stepping_the_raw_optimizer_after_wrap_warns_at_once_at_the_users_line(tmp_path):
    m = model()
    with joined(tmp_path, "a", m) as swarm:
        adamw = torch.optim.AdamW(m.parameters(), lr=0.01)
        opt = swarm.wrap(adamw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(opt, m)  # through the wrapper: nothing said
        assert swarm.step == 1
        with pytest.warns(geotrain.MisuseWarning, match=r"stepped directly.*opt.step\(\)") as said:
            step(adamw, m)
        assert said[0].filename == __file__  # the user's line, not torch's or geotrain's
        assert swarm.step == 1  # (the raw step was not the swarm's)


def test_a_scheduler_not_passed_to_wrap_warns_and_one_passed_does_not(tmp_path):
    m = model()
    with joined(tmp_path, "a", m) as swarm:
        adamw = torch.optim.AdamW(m.parameters(), lr=0.01)
        torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=10)
        opt = swarm.wrap(adamw)
        with pytest.warns(geotrain.MisuseWarning, match=r"swarm.wrap\(optimizer, scheduler\)"):
            step(opt, m)
    m = model()
    with joined(tmp_path, "b", m) as swarm:
        adamw = torch.optim.AdamW(m.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=10)
        opt = swarm.wrap(adamw, schedule)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(opt, m)
            schedule.step()


def test_a_joiner_with_another_model_gets_ModelMismatch_with_a_short_traceback(tmp_path):
    first = joined(tmp_path, "a", model(), "training.wait_for_peers=0")
    try:
        other = nn.Linear(4, 3)  # other shapes
        with pytest.raises(geotrain.ModelMismatch) as caught:
            joined(tmp_path, "b", other, f'network.bootstrap=["{first.address}"]',
                   "training.wait_for_peers=1")
    finally:
        first.close()
    text = "".join(traceback.format_exception(caught.value))
    assert "ExceptionGroup" not in text and "trio" not in text, text
    assert text.count("File ") <= 4, text  # this test, join, its wait: not the node's thread
    assert isinstance(caught.value, geotrain.ConfigError)  # (what a caller catching those gets)


def test_a_rejected_update_says_what_was_compared_and_the_setting_that_governs_it():
    from geotrain.gossip import RejectedUpdate, check_norm_ratio, check_update

    ours = {"w": torch.full((4,), 0.05)}
    with pytest.raises(RejectedUpdate) as caught:
        check_update(ours, {"w": torch.full((4,), 2.0)}, max_norm_ratio=10.0)
    said = str(caught.value)
    assert caught.value.reason == "norm"
    assert "the peer's model has norm 4" in said and "the norm of our model, 0.1" in said, said
    assert "gossip.max_norm_ratio 10" in said and "2 allowed" in said, said
    with pytest.raises(RejectedUpdate, match=r"update \(pseudo-gradient\) has norm 3.62.*"
                       r"the norm of our model, 0.0982"):
        check_norm_ratio(3.62, 0.0982, max_norm_ratio=10.0, what="update (pseudo-gradient)")
    with pytest.raises(RejectedUpdate, match=r"the peer's w is \(3,\), ours \(4,\): another"):
        check_update(ours, {"w": torch.zeros(3)}, max_norm_ratio=10.0)


def test_a_late_joiner_fetches_optimizer_state_only_when_the_classes_match(tmp_path):
    from structlog.testing import capture_logs

    torch.manual_seed(0)
    first = nn.Linear(64, 64)  # 4160 parameters: AdamW's state is 33 kB
    with joined(tmp_path, "a", first, "training.wait_for_peers=0") as a:
        step_a = a.wrap(torch.optim.AdamW(first.parameters(), lr=0.01))
        for _ in range(3):
            step(step_a, first)
        for name, make in [("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
                           ("adamw", lambda p: torch.optim.AdamW(p, lr=0.01))]:
            late = nn.Linear(64, 64)
            with capture_logs() as logs, joined(
                    tmp_path, name, late, f'network.bootstrap=["{a.address}"]',
                    "training.wait_for_peers=1") as b:  # fmt: skip
                before = b.status().sync_bytes_in  # (the model, fetched at join)
                optimizer = make(late.parameters())
                b.wrap(optimizer)
                fetched = b.status().sync_bytes_in - before
            said = {e["event"]: e for e in logs}
            if name == "sgd":
                assert said["optimizer_state_skipped"]["reason"] == (
                    "the peer's optimizer is AdamW, ours SGD"), said
                total = before + fetched
                assert total < 2 * 4 * 4160, total  # the model and a layout, none of the state
                assert "optimizer_state_fetched" not in said, said
            else:
                assert "optimizer_state_synced" in said, said
                assert fetched >= 2 * 4 * 4160, fetched  # exp_avg and exp_avg_sq
                assert set(optimizer.state[late.weight]) >= {"exp_avg", "exp_avg_sq"}


def test_an_opacus_optimizer_is_wrapped_and_its_raw_step_is_said_too(tmp_path):
    opacus = pytest.importorskip("opacus")
    m = model()
    with joined(tmp_path, "a", m) as swarm:
        private = opacus.GradSampleModule(m)
        dp = opacus.optimizers.DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                           noise_multiplier=0.0, max_grad_norm=1.0,
                                           expected_batch_size=8)  # fmt: skip
        opt = swarm.wrap(dp)  # (a DPOptimizer has no step hooks of its own)
        with warnings.catch_warnings():
            warnings.simplefilter("error", geotrain.MisuseWarning)
            step(opt, private, 4)
        with pytest.warns(geotrain.MisuseWarning, match="stepped directly"):
            step(dp, private, 4)
        assert swarm.step == 1


def test_an_optimizer_that_leaves_out_trainable_parameters_is_said_at_wrap(tmp_path):
    base, head = nn.Linear(4, 8), nn.Linear(8, 1)  # the base was meant to be frozen
    m = nn.Sequential(base, head)
    with joined(tmp_path, "a", m) as swarm:
        with pytest.warns(geotrain.MisuseWarning, match=r"2 parameter\(s\) \(40 values, e.g. "
                          r"'0.weight'\).*requires_grad_\(False\)") as said:
            swarm.wrap(torch.optim.AdamW(head.parameters()))
        assert said[0].filename == __file__
    base.requires_grad_(False)  # frozen before join: nothing to say
    with joined(tmp_path, "b", m) as swarm, warnings.catch_warnings():
        warnings.simplefilter("error", geotrain.MisuseWarning)
        swarm.wrap(torch.optim.AdamW(head.parameters()))
