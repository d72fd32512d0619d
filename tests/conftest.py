"""Shared test set-up."""

from __future__ import annotations

import pytest
import structlog


@pytest.fixture(autouse=True)
def _fresh_logging(monkeypatch):
    """A test that configures logging (into a captured stream) must not leak it into the next,
    nor use up the process's quota of warnings about peers (node._log_quota) for it."""
    from geotrain.node import _log_quota

    monkeypatch.setattr(_log_quota, "_QUOTAS", {})
    yield
    structlog.reset_defaults()
