"""Fixtures for the API unit tests (helpers in api_harness.py, the engine double in api_fake_engine.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from api_harness import running_app  # noqa: E402


@pytest.fixture
async def server():
    async with running_app() as triple:
        yield triple


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s
