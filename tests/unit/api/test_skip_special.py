"""skip_special_tokens and spaces_between_special_tokens (vLLM's decoding fields): parsed onto
SamplingParams, applied by the engine's detokenizer, and turned off by tool calling where the
family's marker is a special token of the checkpoint (real Mistral's [TOOL_CALLS])."""
from __future__ import annotations

import asyncio
import shutil

import pytest

from moed.api.errors import APIError
from moed.api.protocol import parse_request
from moed.api.tools import bind
from moed.model.tokenizer import Tokenizer

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _refused(param: str, body: dict, chat: bool = False) -> str:
    with pytest.raises(APIError) as e:
        parse_request(body, chat=chat)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    return e.value.message


@pytest.mark.parametrize("chat", [False, True])
def test_parsed_onto_sampling_params(chat):
    base = {"messages": USER} if chat else {"prompt": "x"}
    assert parse_request(base, chat=chat).sampling_params(4, 0).skip_special_tokens is True
    off = parse_request({**base, "skip_special_tokens": False}, chat=chat)
    assert off.skip_special_tokens is False and not off.sampling_params(4, 0).skip_special_tokens
    on = parse_request({**base, "skip_special_tokens": True}, chat=chat)
    assert on.skip_special_tokens is True and on.sampling_params(4, 0).skip_special_tokens
    # false where special tokens are skipped changes nothing (as in vLLM): accepted
    quiet = parse_request({**base, "spaces_between_special_tokens": False}, chat=chat)
    assert not quiet.spaces_between_special_tokens
    assert quiet.sampling_params(4, 0).skip_special_tokens


def test_refusals_name_the_field():
    assert "boolean" in _refused("skip_special_tokens", {"prompt": "x",
                                                         "skip_special_tokens": "no"})
    assert "boolean" in _refused("spaces_between_special_tokens",
                                 {"prompt": "x", "spaces_between_special_tokens": 0})
    says = _refused("spaces_between_special_tokens",
                    {"messages": USER, "skip_special_tokens": False,
                     "spaces_between_special_tokens": False}, chat=True)
    assert "not supported" in says


def _with_marker(src, dst, special: bool) -> Tokenizer:
    """A copy of src's tokenizer files whose vocabulary holds [TOOL_CALLS] (special or not)."""
    from tokenizers import AddedToken, Tokenizer as HF
    for f in src.iterdir():
        if f.is_file() and f.suffix == ".json":
            shutil.copy(f, dst / f.name)
    hf = HF.from_file(str(dst / "tokenizer.json"))
    hf.add_tokens([AddedToken("[TOOL_CALLS]", special=special, normalized=False)])
    (dst / "tokenizer.json").write_text(hf.to_str())
    return Tokenizer.from_dir(dst)


def _chat(**kw):
    return parse_request({"messages": USER, **kw}, chat=True)


def test_tools_with_a_special_marker_show_special_tokens(tiny_mixtral, tmp_path):
    tok = _with_marker(tiny_mixtral, tmp_path, special=True)
    for kw in ({}, {"tool_choice": "required"}, {"skip_special_tokens": False}):
        r = bind(_chat(tools=[WEATHER], **kw), tok, "auto")
        assert r.tools.family == "mistral" and r.skip_special_tokens is False, kw
        assert r.sampling_params(8, 0).skip_special_tokens is False
    with pytest.raises(APIError) as e:     # it would drop the calls: not silently overridden
        bind(_chat(tools=[WEATHER], skip_special_tokens=True), tok, "auto")
    assert e.value.param == "skip_special_tokens" and "[TOOL_CALLS]" in e.value.message
    with pytest.raises(APIError) as e:
        bind(_chat(tools=[WEATHER], spaces_between_special_tokens=False), tok, "auto")
    assert e.value.param == "spaces_between_special_tokens"
    # not parsed (tool_choice none) or no tools: the default stands
    assert bind(_chat(tools=[WEATHER], tool_choice="none"), tok, "auto") \
        .sampling_params(8, 0).skip_special_tokens
    assert bind(_chat(skip_special_tokens=True), tok, "auto").skip_special_tokens is True


def test_a_marker_that_is_an_added_but_not_special_token_keeps_the_default(tiny_mixtral,
                                                                           tmp_path):
    """Real Qwen3 marks <tool_call> as an added token with special: false: decoding keeps it,
    so nothing needs to change (here: [TOOL_CALLS] added the same way)."""
    tok = _with_marker(tiny_mixtral, tmp_path, special=False)
    r = bind(_chat(tools=[WEATHER]), tok, "auto")
    assert r.tools.family == "mistral" and r.skip_special_tokens is None
    assert r.sampling_params(8, 0).skip_special_tokens is True
    assert bind(_chat(tools=[WEATHER], skip_special_tokens=True), tok, "auto").skip_special_tokens


# ---- applied: the real engine's detokenizer -----------------------------------------------

async def test_the_engine_shows_special_tokens_only_when_asked(tiny_qwen3):
    """<|im_start|> (special, not a stop token) forced by logit_bias: its text is the output
    with skip_special_tokens false and nothing with the default."""
    import torch

    from moed.config import EngineConfig
    from moed.engine.engine import Engine
    from moed.model.runner import ModelRunner

    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(tiny_qwen3)
    sid = tok.token_to_id("<|im_start|>")
    assert sid is not None and sid not in tok.eos_token_ids
    runner = ModelRunner(tiny_qwen3, dtype="float32", device="cpu", num_blocks=64, block_size=4)
    engine = Engine(runner, tok, EngineConfig(block_size=4, max_num_batched_tokens=64))
    prompt = tok.encode("The cat sat on the")
    texts: dict[bool, str] = {}
    await engine.start()
    try:
        for skip in (True, False):
            body = {"prompt": "The cat sat on the", "max_tokens": 3, "temperature": 0,
                    "logit_bias": {str(sid): 100}, "skip_special_tokens": skip}
            params = parse_request(body, chat=False).sampling_params(3, 0)
            stream = engine.add_request(f"skip-{skip}", prompt, params)
            out, ids = "", []
            async with asyncio.timeout(60):
                async for ev in stream:
                    out += ev.text
                    ids += list(ev.token_ids)
                    if ev.finished:
                        break
            assert ids == [sid] * 3
            texts[skip] = out
    finally:
        await engine.shutdown()
    assert texts == {True: "", False: "<|im_start|>" * 3}
