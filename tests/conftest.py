"""Shared test set-up."""

from __future__ import annotations

import pytest
import structlog


@pytest.fixture(autouse=True)
def _fresh_logging():
    """A test that configures logging (into a captured stream) must not leak it into the next."""
    yield
    structlog.reset_defaults()
