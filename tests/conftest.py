"""Shared test set-up."""

from __future__ import annotations

import pytest
import structlog
import torch

# One torch thread in the test process: its models are small, and with two threads each tiny op
# waits on the other thread while the nodes the tests start take the cores (1,000 digits-mlp
# steps took 107 s with two threads on a busy 2-core box, 3.4 s with one). A test that needs
# more sets them itself (in-process nodes set their training.threads).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_logging(monkeypatch):
    """A test that configures logging (into a captured stream) must not leak it into the next,
    nor use up the process's quota of warnings about peers (node._log_quota) for it."""
    from geotrain.node import _log_quota

    monkeypatch.setattr(_log_quota, "_QUOTAS", {})
    yield
    structlog.reset_defaults()


# Under pytest-xdist (`pytest -n 2`), the tests of each group below run one after another on one
# worker, and every other test is scheduled on its own. The namespace tests share the host's
# network namespaces, firewall and emulator probes, and some check the whole host for leftovers;
# the 10^8-parameter tests hold ~2 GB a node, so one at a time.
SERIAL_GROUPS = {
    "namespaces": {
        "test_deployment.py", "test_goodput.py", "test_testbed_availability.py",
        "test_testbed_cli.py", "test_testbed_failures.py", "test_testbed_hivemind.py",
        "test_testbed_linkcheck.py", "test_testbed_namespaces.py", "test_testbed_nat.py",
        "test_testbed_netem.py", "test_testbed_report.py", "test_testbed_run.py",
        "test_testbed_userspace.py",
    },
    "large-models": {"test_node_large.py"},
}  # fmt: skip
SERIAL_NODEIDS = {
    "namespaces": ("tests/test_docs.py::test_the_tutorial_runs_as_written[testbed.md]",),
}


def serial_group(nodeid: str) -> str | None:
    """The group a test id runs in under xdist, or None (scheduled on its own)."""
    file = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    for group, files in SERIAL_GROUPS.items():
        if file in files or nodeid in SERIAL_NODEIDS.get(group, ()):
            return group
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope with our groups as scopes (their own loadgroup names a group through an
    item attribute that pytest 9.2 no longer reads). Larger scopes are handed out first."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return serial_group(nodeid) or nodeid

    return GroupScheduling(config, log)
