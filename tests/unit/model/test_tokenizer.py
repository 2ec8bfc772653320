"""Tokenizer over the generated checkpoints: round trip, streaming detokenizer, chat templates."""
from __future__ import annotations

import json

import pytest

from moed.model.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

TEXTS = ["def f(x):\n    return x * 2\n", "héllo wörld — naïve café", "世界你好 🙂🎉👍🏽 Ελληνικά",
         "tabs\tand\nnewlines\r\n", ""]


@pytest.fixture(scope="module", params=["qwen3", "mixtral"])
def tok(request, tiny_qwen3, tiny_mixtral) -> Tokenizer:
    return Tokenizer.from_dir(tiny_qwen3 if request.param == "qwen3" else tiny_mixtral)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_decode(tok, text):
    prompt = tok.encode("prompt: ", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt)
    pieces = [det.add(i) for i in ids] + [det.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)   # never half a character
    if any(ord(c) > 0x7FF for c in text):
        assert "" in pieces[:-1]                      # multi-byte chars were held back


def test_incremental_detokenizer_invalid_bytes_flush(tok):
    # An emoji cut after its first byte token(s): held back, then flushed with U+FFFD.
    ids = tok.encode("ok 🙂", add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    emitted = "".join(det.add(i) for i in ids[:-1])
    assert "\ufffd" not in emitted
    assert emitted + det.flush() == tok.decode(ids[:-1])


def test_eos_and_specials(tiny_qwen3, tiny_mixtral):
    q, m = Tokenizer.from_dir(tiny_qwen3), Tokenizer.from_dir(tiny_mixtral)
    assert q.eos_token_ids == (q.token_to_id("<|im_end|>"), q.token_to_id("<|endoftext|>"))
    assert m.eos_token_ids == (m.token_to_id("</s>"),)
    assert m.encode("hi")[0] == m.token_to_id("<s>") and m.encode("hi", add_special_tokens=False)[0] != 1
    assert q.encode("hi") == q.encode("hi", add_special_tokens=False)
    assert q.decode([q.token_to_id("<|im_end|>")], skip_special_tokens=False) == "<|im_end|>"
    assert q.decode([q.token_to_id("<|im_end|>")]) == ""


def test_chat_templates_match_transformers(tiny_qwen3, tiny_mixtral):
    from transformers import AutoTokenizer

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 世界"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]
    for d in (tiny_qwen3, tiny_mixtral):
        ours, ref = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
        text = ours.apply_chat_template(msgs)
        assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
    q = Tokenizer.from_dir(tiny_qwen3).apply_chat_template(msgs[1:2])
    assert q == "<|im_start|>user\nHi 世界<|im_end|>\n<|im_start|>assistant\n"
    assert Tokenizer.from_dir(tiny_mixtral).apply_chat_template(msgs[1:2]) == "<s>[INST] Hi 世界 [/INST]"


def test_chat_template_errors(tiny_mixtral, tmp_path):
    with pytest.raises(TokenizerError, match="unknown role"):
        Tokenizer.from_dir(tiny_mixtral).apply_chat_template([{"role": "developer",
                                                                "content": "x"}])
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tiny_mixtral / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_dir(tmp_path / "missing")


def test_trained_tokenizer_cache_is_rebuilt_when_corrupt(tmp_path, monkeypatch):
    from moed.dev import bpe_train

    monkeypatch.setenv("MOED_CACHE_DIR", str(tmp_path))
    (tmp_path / "tokenizers").mkdir()
    path = tmp_path / "tokenizers" / f"mistral-300-v{bpe_train._CACHE_VERSION}.json"
    path.write_text("{not json")
    tok = bpe_train.trained_tokenizer("mistral", 300)
    assert tok.get_vocab_size() == 300 and tok.token_to_id("</s>") == 2
    assert bpe_train.trained_tokenizer("mistral", 300).to_str() == tok.to_str()   # now cached, same
    with pytest.raises(ValueError, match="too small"):
        bpe_train.trained_tokenizer("chatml", 100)


def test_incremental_detokenizer_prompt_ending_mid_character(tok):
    ids = tok.encode("héllo 🙂 world", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    det = IncrementalDetokenizer(tok, ids[:cut])
    text = "".join(det.add(i) for i in ids[cut:]) + det.flush()
    assert text == tok.decode(ids[cut:])
