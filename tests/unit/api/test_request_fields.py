"""The field walker: every request field the parser reads (moed.api.protocol's COMPLETION_FIELDS
and CHAT_FIELDS) has evidence, a test that shows it applied (it changes the output as its
definition predicts) or refused (a 400 naming it). EVIDENCE maps each field to such tests by
pytest node id; `path::test[part]` means a parametrized case of that test whose id contains
`part`. Adding a field to the parser without declaring it fails (protocol._Body refuses the
read), declaring it without evidence fails here, and so does evidence that no longer exists.

The second half holds the applied tests no other file has: each field parsed by the real parser
and run through the real engine (tiny Qwen3-MoE, fp32), against the same body without it."""
from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from moed.api import protocol
from moed.api.protocol import CHAT_FIELDS, COMPLETION_FIELDS, parse_request, resolve_max_tokens

ROOT = Path(__file__).resolve().parents[3]
ME = "tests/unit/api/test_request_fields.py"
PROTO = "tests/unit/api/test_api_protocol.py"
SERVER = "tests/unit/api/test_api_server.py"
OPENAI = "tests/integration/test_server_openai.py"
SAMPLING = "tests/integration/test_sampling_api.py"
PLP = "tests/integration/test_prompt_logprobs.py"
DISAGG = "tests/integration/test_sampling_disagg.py"
REFUSED = f"{PROTO}::test_unimplemented_fields_are_refused_by_name"
SO = "tests/integration/test_structured_outputs.py"
SP = "tests/unit/api/test_structured_parse.py"
TOOLS = "tests/unit/api/test_tools_parse.py"
TOOLS_HTTP = "tests/integration/test_tool_calling.py"
REFUSED_HTTP = f"{SAMPLING}::test_refused_fields_answer_400_naming_them"
SKIP = "tests/unit/api/test_skip_special.py"
MISTRAL_HTTP = "tests/integration/test_tool_calling_mistral.py"

ISOLATION = "tests/integration/test_tenant_isolation.py"
PRIORITY_HTTP = "tests/integration/test_priority.py"

# fields of both endpoints
_BOTH: dict[str, tuple[str, ...]] = {
    "priority": (f"{PRIORITY_HTTP}::test_priority_orders_seating_and_sheds_batch_first",
                 "tests/unit/api/test_priority_classes.py::test_the_field_is_an_integer_in_int32"),
    "cache_salt": (f"{ISOLATION}::test_a_tenants_cached_prompt_is_no_hit_for_another",),
    "model": (f"{SERVER}::test_bad_input_is_4xx_openai_shaped[payload10-404-model]",
              f"{OPENAI}::test_models_and_completion"),
    "max_tokens": (f"{ME}::test_applied_max_tokens_and_max_completion_tokens",
                   f"{OPENAI}::test_models_and_completion"),
    "max_completion_tokens": (f"{ME}::test_applied_max_tokens_and_max_completion_tokens",
                              f"{OPENAI}::test_chat_stream_and_non_stream"),
    "temperature": (f"{ME}::test_applied_temperature",),
    "top_p": (f"{ME}::test_applied_top_p_top_k_min_p_keep_only_the_top_token",),
    "top_k": (f"{ME}::test_applied_top_p_top_k_min_p_keep_only_the_top_token",),
    "min_p": (f"{ME}::test_applied_top_p_top_k_min_p_keep_only_the_top_token",
              f"{DISAGG}::test_greedy_and_seeded_outputs_equal_colocated_and_disaggregated"),
    "min_tokens": (f"{ME}::test_applied_stop_token_ids_and_min_tokens",),
    "seed": (f"{ME}::test_applied_seed", f"{OPENAI}::test_n_choices_and_seeded_sampling",
             f"{DISAGG}::test_greedy_and_seeded_outputs_equal_colocated_and_disaggregated"),
    "stop": (f"{OPENAI}::test_stop_string_cuts_text",),
    "stop_token_ids": (f"{ME}::test_applied_stop_token_ids_and_min_tokens",),
    "n": (f"{OPENAI}::test_n_choices_and_seeded_sampling",),
    "stream": (f"{OPENAI}::test_stream_completion_matches_non_stream_and_usage_last",),
    "stream_options": (f"{OPENAI}::test_stream_completion_matches_non_stream_and_usage_last",
                       f"{PROTO}::test_include_usage_needs_stream"),
    "stream_options.include_usage": (
        f"{OPENAI}::test_stream_completion_matches_non_stream_and_usage_last",),
    "stream_options.continuous_usage_stats": (
        f"{PLP}::test_continuous_usage_stats_on_every_chunk",),
    "ignore_eos": (f"{ME}::test_applied_ignore_eos",),
    "return_token_ids": (f"{OPENAI}::test_models_and_completion",),
    "presence_penalty": (f"{ME}::test_applied_presence_penalty",
                         f"{DISAGG}::test_greedy_and_seeded_outputs_equal_colocated_and_disaggregated"),
    "frequency_penalty": (
        f"{SAMPLING}::test_frequency_penalty_changes_greedy_output_and_repeats_less",),
    "repetition_penalty": (f"{SAMPLING}::test_repetition_penalty_is_applied",),
    "logit_bias": (f"{SAMPLING}::test_logit_bias_forces_and_removes_tokens",),
    "logprobs": (f"{OPENAI}::test_logprobs", f"{OPENAI}::test_top_logprobs"),
    # structured outputs (moed.api.structured)
    "response_format": (f"{SO}::test_json_schema_always_validates_colocated",
                        f"{SP}::test_response_format_shapes"),
    "structured_outputs": (f"{SO}::test_first_token_from_the_prefill_node_obeys_the_grammar",
                           f"{SP}::test_structured_outputs_shapes"),
    "guided_json": (f"{SP}::test_guided_extras",),
    "guided_regex": (f"{SO}::test_json_object_regex_choice_and_grammar",),
    "guided_choice": (f"{SO}::test_json_object_regex_choice_and_grammar",),
    "guided_grammar": (f"{SO}::test_json_object_regex_choice_and_grammar",),
    "guided_whitespace_pattern": (f"{SP}::test_guided_extras",),
    "guided_decoding_backend": (f"{SP}::test_guided_extras",),
    # special tokens in the output text
    "skip_special_tokens": (
        f"{SKIP}::test_the_engine_shows_special_tokens_only_when_asked",
        f"{MISTRAL_HTTP}::test_skip_special_tokens_shows_and_hides_special_tokens"),
    "spaces_between_special_tokens": (f"{SKIP}::test_refusals_name_the_field",
                                      f"{SKIP}::test_parsed_onto_sampling_params",
                                      f"{MISTRAL_HTTP}::test_refusals"),
}
COMPLETIONS: dict[str, tuple[str, ...]] = {
    **_BOTH,
    "prompt": (f"{PROTO}::test_completion_prompt_forms",
               f"{OPENAI}::test_greedy_over_http_equals_engine"),
    "echo": (f"{PLP}::test_echo_logprobs_are_the_oracles_and_cover_the_prompt_first",
             f"{PLP}::test_text_offsets_index_the_returned_text"),
    "prompt_logprobs": (f"{PLP}::test_vllm_prompt_logprobs_field",
                        f"{PLP}::test_prompt_logprobs_refusals"),
    "suffix": (f"{REFUSED}[suffix]", f"{REFUSED_HTTP}[suffix]"),
    "best_of": (f"{REFUSED}[best_of]", f"{REFUSED_HTTP}[best_of]"),
    # chat-only fields sent to /v1/completions
    **{f: (f"{ME}::test_chat_only_fields_are_refused_on_completions",
           f"{TOOLS}::test_tool_fields_on_completions_are_refused")
       for f in ("tools", "tool_choice", "functions", "function_call", "chat_template_kwargs")},
}
CHAT: dict[str, tuple[str, ...]] = {
    **_BOTH,
    "messages": (f"{PROTO}::test_chat_messages", f"{OPENAI}::test_chat_stream_and_non_stream"),
    "top_logprobs": (f"{OPENAI}::test_top_logprobs",),
    "prompt_logprobs": (f"{ME}::test_prompt_logprobs_is_refused_on_chat",),
    # tool calling and the chat template (moed.api.tools)
    "echo": (f"{TOOLS}::test_chat_echo_prepends_the_assistant_message",
             f"{TOOLS_HTTP}::test_continue_final_message_with_echo"),
    "tools": (f"{TOOLS}::test_tools_reach_the_template",
              f"{TOOLS}::test_strict_functions_under_auto_constrain_calls_not_text",
              f"{TOOLS_HTTP}::test_tools_reach_the_template"),
    "tool_choice": (f"{TOOLS}::test_tool_grammar_qwen",
                    f"{TOOLS}::test_tool_choice_none_does_not_parse",
                    f"{TOOLS_HTTP}::test_required_always_yields_a_parsable_call",
                    f"{TOOLS_HTTP}::test_named_choice_streamed"),
    "parallel_tool_calls": (f"{TOOLS}::test_parallel_tool_calls_false_keeps_one_call",),
    "functions": (f"{TOOLS}::test_refusals_name_the_field[kw10-functions-deprecated]",),
    "function_call": (f"{TOOLS}::test_refusals_name_the_field[kw11-function_call-tools]",),
    "chat_template_kwargs": (f"{TOOLS}::test_template_kwargs_must_be_template_variables",
                             f"{TOOLS_HTTP}::test_tools_reach_the_template"),
    "continue_final_message": (f"{TOOLS}::test_continue_final_message_and_add_generation_prompt",
                               f"{TOOLS_HTTP}::test_continue_final_message_with_echo"),
    "add_generation_prompt": (f"{TOOLS}::test_continue_final_message_and_add_generation_prompt",),
}


@pytest.mark.parametrize("name,declared,evidence", [
    ("completions", COMPLETION_FIELDS, COMPLETIONS), ("chat", CHAT_FIELDS, CHAT)])
def test_every_declared_field_has_evidence(name, declared, evidence):
    missing = sorted(set(declared) - set(evidence))
    stale = sorted(set(evidence) - set(declared))
    assert not missing, f"{name}: fields the parser reads with no test of their effect: {missing}"
    assert not stale, f"{name}: evidence for fields the parser does not read: {stale}"
    assert all(evidence[f] for f in declared)


_ID = re.compile(r"^(tests/[\w/]+\.py)::(\w+)(?:\[([^\]]+)\])?$")


def _collected(paths: list[str]) -> set[str]:
    """Node ids pytest collects from `paths` (a child process: collection only, no tests run)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *paths], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    return {line.strip() for line in r.stdout.splitlines() if "::" in line}


def test_every_evidence_test_exists():
    ids = sorted({i for ev in (COMPLETIONS, CHAT) for ids in ev.values() for i in ids})
    bad = [i for i in ids if not _ID.match(i)]
    assert not bad, f"evidence must be tests/...py::test_name[part]: {bad}"
    files = sorted({_ID.match(i).group(1) for i in ids})
    absent = [f for f in files if not (ROOT / f).is_file()]
    assert not absent, f"evidence files missing: {absent}"
    have = _collected(files)
    gone = []
    for i in ids:
        path, test, part = _ID.match(i).groups()
        base = f"{path}::{test}"
        if part is None:
            ok = base in have or any(h.startswith(base + "[") for h in have)
        else:
            ok = any(h.startswith(base + "[") and part in h[len(base):] for h in have)
        if not ok:
            gone.append(i)
    assert not gone, f"evidence tests that pytest does not collect: {gone}"


def test_an_undeclared_read_fails(monkeypatch):
    """The declaration is the parser's: reading a field it does not list is an error."""
    parse_request({"prompt": "x", "seed": 3}, chat=False)
    monkeypatch.setattr(protocol, "COMPLETION_FIELDS", COMPLETION_FIELDS - {"seed"})
    with pytest.raises(protocol.UndeclaredField, match="'seed'"):
        parse_request({"prompt": "x"}, chat=False)


def test_unknown_fields_are_ignored():
    a = parse_request({"prompt": "x", "seed": 1}, chat=False)
    b = parse_request({"prompt": "x", "seed": 1, "no_such_field": {"x": 1}, "aiperf": 2},
                      chat=False)
    assert a == b


def test_chat_only_fields_are_refused_on_completions():
    for field, value in (("tools", [{"type": "function", "function": {"name": "f"}}]),
                         ("tool_choice", "auto"), ("functions", [{"name": "f"}]),
                         ("function_call", "auto"), ("chat_template_kwargs", {"a": 1})):
        with pytest.raises(protocol.APIError) as e:
            parse_request({"prompt": "x", field: value}, chat=False)
        assert e.value.status == 400 and e.value.param == field


def test_prompt_logprobs_is_refused_on_chat():
    with pytest.raises(protocol.APIError) as e:
        parse_request({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1},
                      chat=True)
    assert e.value.status == 400 and e.value.param == "prompt_logprobs"


# ---- applied: parsed by the real parser, run by the real engine -----------------------------

PROMPT = "The cat sat on the"
N = 24


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    import torch

    from moed.config import EngineConfig
    from moed.engine.engine import Engine
    from moed.model.runner import ModelRunner
    from moed.model.tokenizer import Tokenizer

    torch.set_num_threads(1)
    runner = ModelRunner(tiny_qwen3, dtype="float32", device="cpu", num_blocks=128,
                         block_size=4)
    return Engine(runner, Tokenizer.from_dir(tiny_qwen3),
                  EngineConfig(block_size=4, max_num_batched_tokens=64))


def _run(engine, **fields) -> list[int]:
    """Output token ids of a completions body {prompt, max_tokens N, greedy, **fields}."""
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, **fields}
    req = parse_request(body, chat=False, vocab_size=engine.spec.vocab_size)
    ids = engine.tokenizer.encode(PROMPT)
    params = req.sampling_params(resolve_max_tokens(req, len(ids), engine.context), 0)
    return engine.generate([ids], params)[0]


def test_applied_max_tokens_and_max_completion_tokens(engine):
    assert len(_run(engine, ignore_eos=True, max_tokens=5)) == 5
    assert len(_run(engine, ignore_eos=True, max_tokens=5, max_completion_tokens=3)) == 3


def test_applied_temperature(engine):
    greedy = _run(engine, ignore_eos=True)
    assert _run(engine, ignore_eos=True) == greedy
    hot = [_run(engine, ignore_eos=True, temperature=1.5, seed=s) for s in (1, 2)]
    assert hot[0] != greedy and hot[1] != greedy and hot[0] != hot[1]


def test_applied_top_p_top_k_min_p_keep_only_the_top_token(engine):
    """Each filter, at its tightest, leaves only the likeliest token: sampling at
    temperature 1 then gives the greedy output, which without the filter it does not."""
    greedy = _run(engine, ignore_eos=True)
    hot = dict(ignore_eos=True, temperature=1.0, seed=11)
    assert _run(engine, **hot) != greedy
    assert _run(engine, **hot, top_k=1) == greedy
    assert _run(engine, **hot, top_p=1e-9) == greedy
    assert _run(engine, **hot, min_p=1.0) == greedy
    assert _run(engine, **hot, top_k=2) != greedy     # a looser filter still samples


def test_applied_seed(engine):
    kw = dict(ignore_eos=True, temperature=1.0)
    assert _run(engine, **kw, seed=5) == _run(engine, **kw, seed=5)
    assert _run(engine, **kw, seed=5) != _run(engine, **kw, seed=6)


def test_applied_stop_token_ids_and_min_tokens(engine):
    greedy = _run(engine, ignore_eos=True)
    assert _run(engine, ignore_eos=True, stop_token_ids=[greedy[1]])[:2] == greedy[:2]
    assert len(_run(engine, ignore_eos=True, stop_token_ids=[greedy[1]])) == 2
    late = _run(engine, ignore_eos=True, stop_token_ids=[greedy[1]], min_tokens=6)
    assert len(late) > 6 and greedy[1] not in late[:6]


def test_applied_ignore_eos(engine):
    eos = engine.eos_token_ids[0]
    forced = {"logit_bias": {str(eos): 100}}       # EOS is the greedy token at every step
    assert _run(engine, **forced) == [eos]
    assert _run(engine, **forced, ignore_eos=True) == [eos] * N


def test_applied_presence_penalty(engine):
    plain = _run(engine, ignore_eos=True)
    pen = _run(engine, ignore_eos=True, presence_penalty=2.0)

    def repeats(ids: list[int]) -> int:
        return len(ids) - len(set(ids))
    assert repeats(plain) > 0 and repeats(pen) < repeats(plain)
    assert max(Counter(pen).values()) <= max(Counter(plain).values())
