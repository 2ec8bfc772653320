"""The committed demo checkpoint (models/stdlib-ds3-tiny) is the one trained: its files match
SHA256SUMS and the weights match the hash pinned here (a retrained model must update both, on
purpose), it fits the size budget and keeps DeepSeek-V3's MTP layout."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

MODEL = Path(__file__).resolve().parents[3] / "models" / "stdlib-ds3-tiny"
WEIGHTS_SHA256 = "d2228a956f0236ba28ee322fbb2670d397d738a3eae12d21d7e6c7d984d985db"


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_files_match_the_manifest_and_the_pinned_weights():
    lines = (MODEL / "SHA256SUMS").read_text().split("\n")
    sums = dict(reversed(line.split("  ", 1)) for line in lines if line)
    assert {"model.safetensors", "config.json", "tokenizer.json", "split.json"} <= set(sums)
    for name, digest in sums.items():
        assert _sha(MODEL / name) == digest, name
    assert sums["model.safetensors"] == WEIGHTS_SHA256


def test_size_config_and_card():
    assert sum(p.stat().st_size for p in MODEL.iterdir()) < 30e6
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_shared_experts"] == 1 and cfg["n_group"] > 1
    meta = json.loads((MODEL / "training.json").read_text())
    assert not meta["partial"] and meta["evals"]["heldout"]["ppl"] < meta["evals"]["random_init_full"]["ppl"] / 50
    card = (MODEL / "README.md").read_text()
    assert f"{meta['evals']['heldout']['ppl']:.2f}" in card and WEIGHTS_SHA256 in card
    split = json.loads((MODEL / "split.json").read_text())
    assert split["heldout"] and not set(split["heldout"]) & set(split["train"])


def test_the_stored_mtp_layer_is_the_trained_one():
    """Reloaded from the files (main model and MTP layer), the first held-out windows score as
    the training run scored them at its last step (within thread-count float noise)."""
    import pytest

    pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer

    from moed.dev.train.train import evaluate, from_checkpoint, heldout_chunks

    meta = json.loads((MODEL / "training.json").read_text())
    cfg, want = meta["config"], meta["history"][-1]["eval"]
    split = json.loads((MODEL / "split.json").read_text())
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    chunks, missing = heldout_chunks(tok, split["heldout"], cfg["seq_len"], limit=cfg["eval_chunks"])
    if missing:
        pytest.skip(f"this Python's stdlib lacks held-out files the training run scored: {missing[:3]}")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(cfg["threads"])
        got = evaluate(from_checkpoint(MODEL), chunks)
    finally:
        torch.set_num_threads(threads)
    assert got["tokens"] == want["tokens"]
    assert abs(got["nll"] - want["nll"]) < 1e-4, (got, want)
    dist = meta.get("mtp_distill")
    if dist is None:
        assert abs(got["mtp_next_next_acc"] - want["mtp_next_next_acc"]) < 0.005, (got, want)
    else:       # the MTP layer moved after training (moed.dev.train.distill): its own check
        from moed.dev.train.distill import agreement

        check = dist["check"]
        torch.set_num_threads(dist["config"]["threads"])
        try:
            again = agreement(from_checkpoint(MODEL), chunks[:check["windows"]])
        finally:
            torch.set_num_threads(threads)
        assert again["positions"] == check["positions"]
        for k in ("agreement_with_main", "mtp_next_next_acc"):
            assert abs(again[k] - check[k]) < 0.005, (again, check)
    assert got["mtp_next_next_acc"] > 0.2
