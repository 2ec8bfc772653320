"""The demo model's training script (moed/dev/train): bitwise reproducible for a seed, the
checkpoint it writes has DeepSeek-V3's layout (MTP module as layer N), and the corpus split."""
from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

pytest.importorskip("transformers")

from moed.dev.train import corpus  # noqa: E402
from moed.dev.train.train import PRESETS, train  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _run(tmp_path, name, **over):
    cfg = dataclasses.replace(PRESETS["tiny"], **over)
    out = tmp_path / name
    meta = train(cfg, out, work=tmp_path / f"work-{name}", final_eval=False)
    return out, meta


def test_same_seed_twice_gives_bitwise_equal_weights_and_another_seed_does_not(tmp_path):
    threads = torch.get_num_threads()
    a, meta = _run(tmp_path, "a")
    b, _ = _run(tmp_path, "b")
    c, _ = _run(tmp_path, "c", seed=1)
    assert torch.get_num_threads() == threads and not torch.are_deterministic_algorithms_enabled()
    digest = {d: hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (a, b, c)}
    assert digest[a] == digest[b]
    assert digest[a] != digest[c]
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert meta["steps_done"] == 5 and not meta["partial"]
    losses = [h["loss"] for h in meta["history"]]
    assert len(losses) == 5 and all(x == x for x in losses)     # no NaN


def test_checkpoint_layout_is_deepseek_v3s_with_one_mtp_layer(tmp_path):
    from safetensors import safe_open

    out, _ = _run(tmp_path, "layout", steps=1)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    n = cfg["num_hidden_layers"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    mtp = {k.removeprefix(f"model.layers.{n}.") for k in keys if k.startswith(f"model.layers.{n}.")}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight",
                 "shared_head.norm.weight", "shared_head.head.weight", "input_layernorm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                 "mlp.experts.0.gate_proj.weight", "mlp.shared_experts.down_proj.weight"):
        assert name in mtp, name
    assert not any(k.startswith(f"model.layers.{n + 1}.") for k in keys)
    assert "model.layers.0.mlp.gate_proj.weight" in keys             # the dense first layer
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in keys   # routed experts, one by one
    split = json.loads((out / "split.json").read_text())
    assert split["heldout"] and not set(split["heldout"]) & set(split["train"])


def test_the_split_is_a_fixed_function_of_the_path():
    assert corpus.is_heldout("json/decoder.py") == corpus.is_heldout("json/decoder.py")
    files = corpus.list_files()
    train_files, heldout = corpus.split(files)
    assert 0.02 < len(heldout) / len(files) < 0.09
    assert not any(f.startswith(("test/", "idlelib/", "site-packages/")) for f in files)
    assert sorted(train_files + heldout) == sorted(files)


def test_windows_score_only_whole_pairs():
    assert corpus.chunks(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]
    assert corpus.chunks(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_distilling_the_mtp_layer_moves_it_alone_and_twice_gives_equal_weights(tmp_path):
    """moed.dev.train.distill: the MTP layer's own tensors move, the main model's, the shared
    embedding's and head's copies stay bitwise; the same seed twice gives equal files; the
    record (held-out agreement before and after) lands in training.json."""
    import shutil

    from safetensors.torch import load_file

    from moed.dev.train.distill import DistillConfig, distill

    src, _ = _run(tmp_path, "src", steps=2)
    cfg = DistillConfig(steps=3, batch_size=2, warmup=1, eval_windows=2, lr=1e-2)
    outs = []
    threads = torch.get_num_threads()
    for name in ("a", "b"):
        d = tmp_path / f"distilled-{name}"
        shutil.copytree(src, d)
        rec = distill(d, cfg, log=lambda line: None)
        outs.append(d)
    assert torch.get_num_threads() == threads and not torch.are_deterministic_algorithms_enabled()
    a, b = (hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in outs)
    assert a == b
    before, after = load_file(str(src / "model.safetensors")), load_file(str(outs[0] / "model.safetensors"))
    assert before.keys() == after.keys()
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    mtp = f"model.layers.{n}."
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.startswith(mtp) for k in moved), sorted(moved)[:5]
    assert f"{mtp}eh_proj.weight" in moved
    assert torch.equal(after[f"{mtp}embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert torch.equal(after[f"{mtp}shared_head.head.weight"], after["lm_head.weight"])
    meta = json.loads((outs[1] / "training.json").read_text())
    assert meta["mtp_distill"] == json.loads(json.dumps(rec))
    assert [h["step"] for h in rec["history"]] == [3] and rec["heldout_windows"] == 2
    for k in ("before", "after"):
        assert 0.0 <= rec[k]["agreement_with_main"] <= 1.0 and rec[k]["positions"] > 0


def test_distill_refuses_a_bad_setting_or_directory_in_one_line(tmp_path, capsys):
    """A directory that is no trained checkpoint, or a setting out of range: exit 2, one line
    naming it, no traceback, nothing written."""
    from moed.dev.train.distill import DistillConfig, main

    (tmp_path / "config.json").write_text("{}")
    assert main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distill: ") and "training.json" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    for bad in (["--steps", "0"], ["--lr", "0"], ["--threads", "0"], ["--eval-windows", "-1"]):
        assert main(["--model", str(tmp_path), *bad]) == 2, bad
        assert capsys.readouterr().err.startswith("distill: "), bad
    with pytest.raises(ValueError, match="batch_size"):
        DistillConfig(batch_size=0)
