"""The README and the docs stay true: the task example works, the README's commands exist, its
own-loop example runs, the scenario example is a valid scenario."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from geotrain.node.cli._main import build_parser
from geotrain.node.training._tasks import TaskContext, resolve_task
from geotrain.node.training._trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
OWN_TASK = (ROOT / "docs" / "how-to" / "own-task.md").read_text()
SCENARIOS = (ROOT / "docs" / "how-to" / "testbed-scenarios.md").read_text()


def test_the_custom_task_example_trains(tmp_path, monkeypatch):
    code = re.search(r"```python\n(.*?)```", OWN_TASK, re.S).group(1)
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tasks.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = resolve_task("my_package.tasks:my_task")(TaskContext(shard_index=1, num_shards=2))
    trainer = Trainer(task)
    for _ in range(300):
        trainer.train_step()
    assert task.reached(trainer.evaluate(), task.default_target)
    sys.modules.pop("my_package.tasks", None)
    sys.modules.pop("my_package", None)


def test_every_command_in_the_readme_table_exists():
    parser = build_parser()
    listed = set(re.findall(r"^\| `geotrain ([a-z]+)", README, re.M))  # the command table
    choices = parser._subparsers._group_actions[0].choices  # the subcommand table
    assert listed and listed <= set(choices), listed - set(choices)


def test_the_own_training_script_example_runs(tmp_path, monkeypatch):
    import torch

    from geotrain.node import Identity

    section = README[README.index("## Your own training loop") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    Identity.generate().save(tmp_path / "me.key")
    (tmp_path / "node.toml").write_text(
        '[identity]\nkey = "me.key"\nopen_swarm = true\n[state]\ndir = "state"\n'
    )
    monkeypatch.chdir(tmp_path)  # the example names "node.toml", as a user's script would
    namespace: dict = {}
    exec(compile(code, "README example", "exec"), namespace)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    loader = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(30)]

    def compute_loss(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    namespace["train"](model, loader, compute_loss)
    checkpoints = list((tmp_path / "state" / "checkpoints").glob("ckpt-*.safetensors"))
    assert checkpoints  # closed cleanly: the final checkpoint


def test_the_scenario_file_example_is_a_valid_scenario():
    import tomllib

    from geotrain.testbed._scenario import scenario_from_dict

    section = SCENARIOS[SCENARIOS.index("## A scenario file") :]
    text = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    scenario = scenario_from_dict(tomllib.loads(text))
    assert scenario.peer_regions == ("us", "us", "us", "eu", "eu")
    assert scenario.slowdown(4) == 3.0 and [f.action for f in scenario.faults] == [
        "kill", "restart", "degrade", "partition", "heal"]  # fmt: skip
    assert scenario.faults[2].link.rate_mbit == 5 and scenario.faults[2].regions == ("us", "eu")
