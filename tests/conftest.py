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


# Under pytest-xdist (`-n 3 --dist loadgroup`) these run one after another on one worker: they make
# network namespaces, and some look at the whole host (netem and namespace probes, "nothing left
# behind"), which another run's namespaces would disturb. The 10^8-parameter tests hold ~2 GB a
# node: one such test at a time.
_ONE_AT_A_TIME = {
    "namespaces": {
        "test_deployment.py", "test_testbed_availability.py", "test_testbed_cli.py",
        "test_testbed_failures.py", "test_testbed_hivemind.py", "test_testbed_linkcheck.py",
        "test_testbed_namespaces.py", "test_testbed_nat.py", "test_testbed_netem.py",
        "test_testbed_report.py", "test_testbed_run.py", "test_testbed_userspace.py",
    },
    "large-models": {"test_node_large.py"},
}  # fmt: skip


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):  # (its xdist_group mark is registered by it)
        return
    for item in items:
        for group, files in _ONE_AT_A_TIME.items():
            if item.path.name in files or (group == "namespaces" and "[testbed.md]" in item.name):
                item.add_marker(pytest.mark.xdist_group(group))
