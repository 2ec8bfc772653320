"""An in-process App on 127.0.0.1 with the fake engine (helpers for the API unit tests)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, AsyncIterator

from api_fake_engine import FakeEngine

from moed import config as mconfig
from moed.api import openai
from moed.obs import metrics


class FakeEngineComponent:
    name = "fake-engine"

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def add_routes(self, web_app) -> None:
        openai.add_routes(web_app)

    async def start(self, app) -> None:
        await self.engine.start()
        app.state.engine = self.engine
        app.state.model_name = "fake"
        metrics.set_model_name("fake")   # what EngineComponent does: the model_name label

    async def drain(self) -> None:
        pass

    async def stop(self) -> None:
        await self.engine.shutdown()


def make_config(**sections: dict[str, Any]) -> mconfig.Config:
    base = mconfig.Config(model=mconfig.ModelConfig(path="/nonexistent/fake"))
    out = {}
    for f in dataclasses.fields(base):
        sec = getattr(base, f.name)
        out[f.name] = dataclasses.replace(sec, **sections.get(f.name, {}))
    out["server"] = dataclasses.replace(out["server"], port=0)
    return mconfig.Config(**out)


@contextlib.asynccontextmanager
async def running_app(engine: FakeEngine | None = None, **sections: dict[str, Any]
                      ) -> AsyncIterator[tuple[Any, str, FakeEngine]]:
    from moed.app import App

    engine = engine or FakeEngine()
    app = App(make_config(**sections), components=[FakeEngineComponent(engine)])
    await app.start()
    try:
        yield app, f"http://127.0.0.1:{app.port}", engine
    finally:
        app.request_stop()
        await app.drain()
