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
