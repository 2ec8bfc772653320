"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /v1/models/{model_id}.

/tokenize takes `{"prompt": str, "add_special_tokens": bool = true}` or `{"messages": [...],
"tools", "chat_template_kwargs", "add_generation_prompt": bool = true,
"continue_final_message": bool = false}` (read by the chat parsers of moed.api.protocol and
moed.api.tools, rendered and encoded by the same call as /v1/chat/completions: the same body
gives its prompt_tokens) and answers `{"count", "max_model_len", "tokens"}`; /detokenize takes
`{"tokens": [int]}` and answers `{"prompt": str}`. Both need a tenant API key when keys are
configured (moed.api.middleware.TENANT_PATHS), run their O(prompt) work in the offload pool, and
refuse fields they do not apply.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from aiohttp import web

from moed.api.errors import APIError, bad_request
from moed.api.generate import encode_prompts
from moed.api.protocol import GenerationRequest, check_text, parse_messages, parse_token_ids
from moed.api.state import STATE, ServerState
from moed.api.tools import check_template_kwargs, parse_template, parse_tools
from moed.engine.client import EngineClient

# what shapes a chat prompt (tool_choice and the like shape the output, not the prompt)
_CHAT_ONLY = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")
_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", *_CHAT_ONLY})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _engine(state: ServerState) -> EngineClient:
    if state.engine is None or not state.ready:
        raise APIError(503, "Model is not loaded yet.", code="not_ready",
                       headers={"Retry-After": str(state.config.admission.retry_after_s)})
    return state.engine


def _body(raw: bytes, fields: frozenset[str], model: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"Malformed JSON body: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:     # a utility endpoint: nothing is sent here by load generators
        raise bad_request(f"unsupported field '{unknown[0]}' (this endpoint takes "
                          f"{', '.join(sorted(fields))})", unknown[0])
    if body.get("model") is not None and body["model"] != model:
        raise APIError(404, f"The model '{body['model']}' does not exist; this server serves "
                            f"'{model}'.", param="model", code="model_not_found")
    return body


def _flag(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, True)
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean", key)
    return v


def _tokenize(engine: EngineClient, raw: bytes, model: str) -> dict[str, Any]:
    """In the offload pool: parse, render, encode."""
    body = _body(raw, _TOKENIZE_FIELDS, model)
    tok = engine.tokenizer
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("send exactly one of 'prompt' or 'messages'", "prompt")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", "prompt")
        check_text(prompt, "prompt")
        for name in _CHAT_ONLY:
            if name in body:
                raise bad_request(f"'{name}' applies to 'messages' only", name)
        ids = tok.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens"))
    else:
        if "add_special_tokens" in body:
            raise bad_request("'add_special_tokens' applies to 'prompt' only (the chat "
                              "template places the special tokens)", "add_special_tokens")
        req = GenerationRequest(chat=True, model=body.get("model"),
                                messages=parse_messages(body), tools=parse_tools(body),
                                template=parse_template(body))
        check_template_kwargs(req.template, tok)
        ids = encode_prompts(engine, req)[0]
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids)}


def _detokenize(engine: EngineClient, raw: bytes, model: str) -> dict[str, Any]:
    body = _body(raw, _DETOKENIZE_FIELDS, model)
    vocab = getattr(engine.tokenizer, "vocab_size", None)
    ids = parse_token_ids(body.get("tokens"), "tokens", vocab)
    return {"prompt": engine.tokenizer.decode(list(ids))}


async def _offloaded(request: web.Request,
                     fn: Callable[[EngineClient, bytes, str], dict[str, Any]]) -> web.Response:
    state = request.app[STATE]
    engine = _engine(state)
    raw = await request.read()
    out = await state.offload.run(fn, engine, raw, state.model_name,
                                  retry_after_s=state.config.admission.retry_after_s)
    return web.json_response(out)


async def tokenize(request: web.Request) -> web.Response:
    return await _offloaded(request, _tokenize)


async def detokenize(request: web.Request) -> web.Response:
    return await _offloaded(request, _detokenize)


async def model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = _engine(state)
    if request.match_info["model_id"] != state.model_name:
        raise APIError(404, f"The model '{request.match_info['model_id']}' does not exist.",
                       param="model", code="model_not_found")
    return web.json_response({"id": state.model_name, "object": "model",
                              "created": state.created, "owned_by": "moed",
                              "max_model_len": engine.max_model_len})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models/{model_id}", model)
