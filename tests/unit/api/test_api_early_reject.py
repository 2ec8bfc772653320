"""Early rejection: a request the cost model says cannot get its first token by its deadline
is refused at once — 429, Retry-After, the predicted wait in the message — and never reaches
the engine; the request timeout is what the deadline is capped by."""
from __future__ import annotations

from api_fake_engine import FakeEngine
from api_harness import running_app


class PredictingEngine(FakeEngine):
    """Predicts a 12 s TTFT for prompts of more than 8 tokens, 0.1 s otherwise."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.asked: list[tuple[int, float | None]] = []

    def ttft_over_deadline(self, prompt_tokens: int, timeout_s: float | None):
        self.asked.append((prompt_tokens, timeout_s))
        predicted = 12.0 if prompt_tokens > 8 else 0.1
        limit = min(4.0, timeout_s or 4.0)
        return (predicted, limit) if predicted > limit else None


async def test_predicted_ttft_past_deadline_is_a_fast_429(http):
    engine = PredictingEngine()
    async with running_app(engine, server={"request_timeout_s": 30.0}) as (_, url, engine):
        async with http.post(f"{url}/v1/completions",
                             json={"prompt": list(range(1, 20)), "max_tokens": 4}) as r:
            body = await r.json()
            assert r.status == 429
            assert r.headers["Retry-After"] == "8"            # 12 s predicted - 4 s deadline
        err = body["error"]
        assert err["code"] == "predicted_ttft"
        assert "12.0s" in err["message"] and "4.0s" in err["message"]
        assert not engine.reqs                                  # never reached the engine
        assert engine.asked[-1] == (19, 30.0)                  # capped by request_timeout_s
        async with http.post(f"{url}/v1/completions",
                             json={"prompt": [1, 2, 3], "max_tokens": 2}) as r:
            assert r.status == 200
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        assert 'moed_admission_rejected_total{reason="predicted_ttft"} 1.0' in text


async def test_an_engine_that_predicts_nothing_admits(http):
    async with running_app(FakeEngine()) as (_, url, _engine):
        async with http.post(f"{url}/v1/completions",
                             json={"prompt": list(range(1, 20)), "max_tokens": 2}) as r:
            assert r.status == 200
