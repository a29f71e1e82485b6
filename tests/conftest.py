"""Suite-wide fixtures.

The suite runs in two pytest-xdist workers (pyproject.toml), so two tests may launch ranks at the
same time. A one-node launch that names no port hosts its rendezvous on a free port; tests that
name one (``MASTER_PORT`` read from the environment) get a port that was free when they started,
unless the environment already sets one.

Tests marked ``nightly`` are the slowest checks of a code path a faster test also covers; they run
only with ``HIDUP_NIGHTLY=1`` (README, "Tests"), which keeps the default suite within its time.
"""

from __future__ import annotations

import os
import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _own_rendezvous_port(monkeypatch):
    if "MASTER_PORT" not in os.environ:
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))


def pytest_configure(config):
    config.addinivalue_line("markers", "nightly: a slow check run with HIDUP_NIGHTLY=1 (a faster test covers its path)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("HIDUP_NIGHTLY"):
        return
    skip = pytest.mark.skip(reason="nightly: HIDUP_NIGHTLY=1 runs it (a faster test covers the same code path)")
    for item in items:
        if "nightly" in item.keywords:
            item.add_marker(skip)
