"""DeepSeek-V3's MTP layer served (moed/model/mtp.py): its logits equal the training module's
(moed/dev/train/mtp.py) on the same hidden states and tokens, through chunked prefill and decode
steps batched together (so its own KV is written and read); with MTP off nothing changes; the
demo model's stored MTP layer; the refusals; the KV layout and the MTP step's inputs."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moed.model import archs
from moed.model.batch import ForwardBatch
from moed.model.hf_config import load_spec
from moed.model.kv_layout import KVLayout
from moed.model.loader import load_weights
from moed.model.mtp import mtp_inputs
from moed.model.runner import ModelRunner, auto_num_blocks
from moed.model.safetensors_file import WeightError

DEMO = Path(__file__).resolve().parents[3] / "models" / "stdlib-ds3-tiny"
BS = 4


@pytest.fixture(scope="module")
def base(make_checkpoint) -> Path:
    """A tiny fp32 DeepSeek-V3 without an MTP layer."""
    return make_checkpoint("deepseek_v3", hidden_size=64, num_layers=2, num_heads=4, num_experts=8,
                           moe_intermediate_size=32, vocab_size=512, max_position_embeddings=128,
                           dtype="float32")


def _with_mtp(src: Path, dst: Path, own_copies: bool):
    """src plus one MTP layer with random weights, written by the training module's
    checkpoint_tensors -> (dir, module, the embedding and head it was given)."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from moed.dev.train.mtp import MTPModule

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    config = AutoConfig.from_pretrained(dst)
    config._attn_implementation = "sdpa"
    mtp = MTPModule(config).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in mtp.named_parameters():     # wide init, norms around 1: nothing is flat
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("norm.weight")
                    else 0.08 * torch.randn(p.shape, generator=gen))
        for name, b in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    t = load_file(str(dst / "model.safetensors"))
    embed, head = t["model.embed_tokens.weight"], t["lm_head.weight"]
    if own_copies:
        embed = embed + 0.05 * torch.randn(embed.shape, generator=gen)
        head = head + 0.05 * torch.randn(head.shape, generator=gen)
    t.update(mtp.checkpoint_tensors(embed, head))
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst, mtp, config, embed, head


@pytest.fixture(scope="module", params=["shared", "own"])
def with_mtp(base, tmp_path_factory, request):
    return _with_mtp(base, tmp_path_factory.mktemp("mtp") / "m", own_copies=request.param == "own")


def _runner(d: Path, mtp: bool = False, num_blocks: int = 24) -> ModelRunner:
    return ModelRunner(d, dtype="float32", device="cpu", num_blocks=num_blocks, block_size=BS, mtp=mtp)


@torch.no_grad()
def _reference(mtp, config, hidden: torch.Tensor, next_ids: list[int], embed: torch.Tensor,
               head: torch.Tensor) -> torch.Tensor:
    """The training module over one whole sequence: positions 0..T-1 -> logits [T, V]."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    pos = torch.arange(hidden.shape[0]).unsqueeze(0)
    pe = DeepseekV3RotaryEmbedding(config)(hidden[None], pos)
    x = mtp(hidden[None], F.embedding(torch.tensor(next_ids), embed)[None], pe)
    return x[0] @ head.T


# Two sequences stepped together: A's prompt in chunks of 8, 8, 5, B's at once, then decodes of
# both (one new token each), so the MTP layer's cached KV is read by later steps.
SCHEDULE = [[("A", 8), ("B", 13)], [("A", 8), ("B", 1)], [("A", 5), ("B", 1)],
            [("A", 1), ("B", 1)], [("A", 1), ("B", 1)], [("A", 1), ("B", 1)]]


def _run(r: ModelRunner, seqs: dict[str, list[int]], mtp: bool):
    """SCHEDULE through r -> per sequence: main hidden rows and MTP logits rows by position,
    and the main logits of every step."""
    done = {k: 0 for k in seqs}
    tables = {"A": list(range(0, 8)), "B": list(range(8, 16))}
    hidden = {k: [] for k in seqs}
    mlogits = {k: [] for k in seqs}
    main = []
    for step in SCHEDULE:
        names = [k for k, _ in step]
        batch = ForwardBatch([seqs[k][done[k]:done[k] + n] for k, n in step], [done[k] for k in names],
                             [tables[k] for k in names])
        if not mtp:
            main.append(r.forward(batch))
        else:
            logits, h = r.forward(batch, hidden=True)
            main.append(logits)
            mb, rows = mtp_inputs(batch, [seqs[k][done[k] + n] for k, n in step])
            mb = dataclasses.replace(mb, all_logits=(True,) * len(step))
            out = r.forward_mtp(mb, h.index_select(0, torch.tensor(rows)))
            row = 0
            for k, n in step:
                hidden[k].append(h[row:row + n])
                mlogits[k].append(out[row:row + n])
                row += n
        for k, n in step:
            done[k] += n
    return {k: torch.cat(v) for k, v in hidden.items() if v}, {k: torch.cat(v) for k, v in mlogits.items() if v}, main


def _seqs(vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(3)
    return {"A": torch.randint(0, vocab, (27,), generator=gen).tolist(),
            "B": torch.randint(0, vocab, (20,), generator=gen).tolist()}


def test_mtp_logits_equal_the_training_modules(with_mtp):
    d, mtp, config, embed, head = with_mtp
    r = _runner(d, mtp=True)
    own = not torch.equal(embed, r.model.embed)
    assert (r.mtp.embed is r.model.embed, r.mtp.head is r.model.lm_head) == (not own, not own)
    seqs = _seqs(r.spec.vocab_size)
    hidden, got, _ = _run(r, seqs, mtp=True)
    for k, toks in seqs.items():
        n = hidden[k].shape[0]
        want = _reference(mtp, config, hidden[k], toks[1:n + 1], embed, head)
        assert got[k].shape == want.shape
        assert (got[k] - want).abs().max().item() < 1e-4, k


def test_quantized_heads_shared_as_before_and_drafting(with_mtp):
    """model.quantization_lm_head quantizes the MTP shared head too: the same quantizer on a
    bitwise-equal copy gives an equal record, so the main head is still shared (else its own,
    quantized); both take the native quantized matmul and their logits are the dequantized
    heads' (fp32 summation order apart)."""
    d, _, _, embed, _ = with_mtp
    r = ModelRunner(d, dtype="float32", device="cpu", num_blocks=24, block_size=BS, mtp=True,
                    quantization="int8", quantization_lm_head="int8")
    own = not torch.equal(embed, r.model.embed)
    assert (r.mtp.head is r.model.lm_head) == (not own)
    native = r.ctx.for_weight(r.model.lm_head.quant) is not None      # the kernels load here
    for head in (r.model.lm_head, r.mtp.head):
        assert head.quant is not None and (head.qpath == "native" or not native), head.qpath
    seqs = _seqs(r.spec.vocab_size)
    hidden, got, main = _run(r, seqs, mtp=True)
    x = torch.randn(3, r.spec.hidden_size, generator=torch.Generator().manual_seed(1))
    w = r.mtp.head.quant.dequantize()
    assert (r.mtp.head(x) - x @ w.T).abs().max() < 1e-4
    assert all(torch.isfinite(v).all() for v in got.values())


# per SCHEDULE step, the drafts draft_mtp is asked for (A, B): none, one, a chain of 3 or 2
DEPTHS = [(0, 1), (1, 0), (3, 1), (1, 2), (0, 0), (2, 3)]


def test_draft_mtp_writes_forward_mtps_kv_and_drafts_its_argmax(with_mtp):
    """The cheaper MTP step (the full layer on the drafting rows only, entries elsewhere):
    the MTP KV of every computed position equals the full pass's (bit for bit, also where a
    chain's scratch entries were written the step before), the first draft is the full pass's
    argmax, a chain drafts `depth` tokens from slots past the last position only."""
    d = with_mtp[0]
    full, cheap = _runner(d, mtp=True), _runner(d, mtp=True)
    seqs = _seqs(full.spec.vocab_size)
    tables = {"A": list(range(0, 8)), "B": list(range(8, 16))}
    done = {k: 0 for k in seqs}
    layer = full.spec.num_layers
    for step, depth in zip(SCHEDULE, DEPTHS):
        names = [k for k, _ in step]
        batch = ForwardBatch([seqs[k][done[k]:done[k] + n] for k, n in step], [done[k] for k in names],
                             [tables[k] for k in names])
        mb, rows = mtp_inputs(batch, [seqs[k][done[k] + n] for k, n in step])
        _, h = full.forward(batch, hidden=True)
        logits = full.forward_mtp(mb, h.index_select(0, torch.tensor(rows)))
        _, h2 = cheap.forward(batch, hidden=True)
        drafts = cheap.draft_mtp(mb, h2.index_select(0, torch.tensor(rows)), list(depth))
        for i, (k, n) in enumerate(step):
            done[k] += n
            assert len(drafts[i]) == depth[i]
            if depth[i]:
                assert drafts[i][0] == int(logits[i].argmax())
            flat = [t.view(-1, t.shape[-1]) for t in (full.kv_cache[layer], cheap.kv_cache[layer])]
            slots = [tables[k][p // BS] * BS + p % BS for p in range(done[k])]
            assert torch.equal(flat[0][slots], flat[1][slots]), (k, done[k])
    with pytest.raises(ValueError, match="needs slots to position"):
        b = ForwardBatch([[1]], [31], [tables["A"]])
        cheap.draft_mtp(b, torch.zeros(1, cheap.spec.hidden_size), [2])


@pytest.mark.parametrize("steps", [
    # every sequence drafting after a short chunk (a verify step's kept rows)
    ((6, [1, 2]), (3, [1, 2]), (2, [1, 2])),
    # a sequence that only writes its entries (depth 0: a held row, a paused request's)
    # beside a drafting one, all short
    ((6, [1, 1]), (2, [0, 1]), (1, [1, 0]), (3, [0, 2])),
], ids=["verify-shaped", "with-depth-0"])
def test_short_chunks_run_the_mtp_layer_in_one_pass(with_mtp, monkeypatch, steps):
    """Prompt chunks then chunks under MTP_ONE_PASS_ROWS: one pass of the layer, no separate
    entry writes after the first (6-row) chunk; the entries and every drafting sequence's
    first draft are the full pass's."""
    d = with_mtp[0]
    full, cheap = _runner(d, mtp=True), _runner(d, mtp=True)
    seqs = _seqs(full.spec.vocab_size)
    tables = [list(range(0, 8)), list(range(8, 16))]
    layer = full.spec.num_layers
    calls = []
    write_kv = cheap.mtp.write_kv
    monkeypatch.setattr(cheap.mtp, "write_kv", lambda *a: calls.append("write_kv") or write_kv(*a))
    done = 0
    for n, depth in steps:
        batch = ForwardBatch([seqs["A"][done:done + n], seqs["B"][done:done + n]], [done, done], tables)
        mb, rows = mtp_inputs(batch, [seqs["A"][done + n], seqs["B"][done + n]])
        _, h = full.forward(batch, hidden=True)
        logits = full.forward_mtp(mb, h.index_select(0, torch.tensor(rows)))
        _, h2 = cheap.forward(batch, hidden=True)
        drafts = cheap.draft_mtp(mb, h2.index_select(0, torch.tensor(rows)), depth)
        done += n
        assert [len(x) for x in drafts] == depth
        assert all(x[0] == int(logits[i].argmax()) for i, x in enumerate(drafts) if x)
        flat = [t.view(-1, t.shape[-1]) for t in (full.kv_cache[layer], cheap.kv_cache[layer])]
        for t in tables:
            slots = [t[p // BS] * BS + p % BS for p in range(done)]
            assert torch.equal(flat[0][slots], flat[1][slots]), done
    assert calls == ["write_kv"]        # the 6-row chunk only


def _counted(calls: list[str], name: str, fn):
    return lambda *a, **k: calls.append(name) or fn(*a, **k)


def _count_calls(runner: ModelRunner, monkeypatch) -> list[str]:
    """The runner's backend plans and input builds, named in order as they happen."""
    calls: list[str] = []
    monkeypatch.setattr(runner.backend, "plan", _counted(calls, "plan", runner.backend.plan))
    monkeypatch.setattr(runner, "_inputs", _counted(calls, "inputs", runner._inputs))
    return calls


def test_a_pass_over_the_main_steps_rows_takes_its_plan_positions_and_rotary_tables(with_mtp, monkeypatch):
    """An MTP pass over the main step's own rows (one decode row each; a verify step's rows, its
    drafts all kept) plans nothing, builds its inputs once and gathers no rotary tables: the
    main forward's serve it. Its drafts and entries are forward_mtp's on the same rows."""
    d = with_mtp[0]
    full, cheap = _runner(d, mtp=True), _runner(d, mtp=True)
    seqs = _seqs(full.spec.vocab_size)
    tables = [list(range(0, 8)), list(range(8, 16))]
    layer = full.spec.num_layers
    calls = _count_calls(cheap, monkeypatch)
    monkeypatch.setattr(cheap.model.rotary, "full_tables",
                        _counted(calls, "tables", cheap.model.rotary.full_tables))
    done = 0
    for n in (6, 1, 2, 1, 2):
        batch = ForwardBatch([seqs["A"][done:done + n], seqs["B"][done:done + n]], [done, done], tables)
        mb, rows = mtp_inputs(batch, [seqs["A"][done + n], seqs["B"][done + n]])
        _, h = full.forward(batch, hidden=True)
        logits = full.forward_mtp(mb, h.index_select(0, torch.tensor(rows)))
        _, h2 = cheap.forward(batch, hidden=True)
        calls.clear()
        drafts = cheap.draft_mtp(mb, h2.index_select(0, torch.tensor(rows)), [1, 1])
        done += n
        assert drafts == [[int(x.argmax())] for x in logits], done
        if n < 6:
            assert calls == ["inputs"], (n, calls)
        flat = [t.view(-1, t.shape[-1]) for t in (full.kv_cache[layer], cheap.kv_cache[layer])]
        for t in tables:
            slots = [t[p // BS] * BS + p % BS for p in range(done)]
            assert torch.equal(flat[0][slots], flat[1][slots]), done


def test_rejected_rows_kept_as_padding_reuse_the_plan_and_change_no_draft_or_entry(with_mtp, monkeypatch):
    """A verify step's rejected drafts' rows kept as padding (mtp_inputs(pad=True), draft_mtp's
    `kept`): the pass plans nothing (the main step's plan serves it), and its drafts and the
    entries of every kept position are those of forward_mtp on the kept rows alone."""
    d = with_mtp[0]
    full, cheap = _runner(d, mtp=True), _runner(d, mtp=True)
    seqs = _seqs(full.spec.vocab_size)
    tables = [list(range(0, 8)), list(range(8, 16))]
    layer = full.spec.num_layers
    calls = _count_calls(cheap, monkeypatch)
    done = [0, 0]
    # (rows per sequence: a prompt chunk, then a known token and drafts; rows kept of them)
    for n, keep in ((6, [6, 6]), (3, [1, 2]), (2, [2, 1]), (3, [3, 1]), (2, [1, 1]), (4, [2, 4])):
        a, b = (seqs[k][p:p + n] for k, p in zip("AB", done))
        batch = ForwardBatch([a, b], list(done), tables)
        nxt = [seqs[k][p + c] for k, p, c in zip("AB", done, keep)]
        mb, rows = mtp_inputs(batch, nxt, keep)
        _, h = full.forward(batch, hidden=True)
        logits = full.forward_mtp(mb, h.index_select(0, torch.tensor(rows)))
        padded, all_rows = mtp_inputs(batch, nxt, keep, pad=True)
        assert all_rows == list(range(2 * n)) and padded.start_pos == batch.start_pos
        _, h2 = cheap.forward(batch, hidden=True)
        calls.clear()
        drafts = cheap.draft_mtp(padded, h2, [1, 1], kept=keep)
        if n < 6:       # (a prompt chunk past MTP_ONE_PASS_ROWS runs its own drafting pass)
            assert calls == ["inputs"], (n, keep, calls)
        assert drafts == [[int(x.argmax())] for x in logits], (n, keep)
        done = [p + c for p, c in zip(done, keep)]
        flat = [t.view(-1, t.shape[-1]) for t in (full.kv_cache[layer], cheap.kv_cache[layer])]
        for t, upto in zip(tables, done):     # (more rows, another matmul blocking: not bitwise)
            slots = [t[p // BS] * BS + p % BS for p in range(upto)]
            torch.testing.assert_close(flat[1][slots], flat[0][slots], msg=str((n, keep)))
    with pytest.raises(ValueError, match="kept"):
        cheap.draft_mtp(padded, h2, [1, 1], kept=[0, 1])


def test_hidden_is_the_main_models_after_its_final_norm(with_mtp):
    """forward(hidden=True) gives transformers' last_hidden_state (after model.norm): the h
    that the training code feeds its MTP module."""
    transformers = pytest.importorskip("transformers")
    d = with_mtp[0]
    r = _runner(d)
    ids = _seqs(r.spec.vocab_size)["A"][:21]
    _, h = r.forward(ForwardBatch([ids], [0], [list(range(6))]), hidden=True)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    assert (h - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_off_changes_nothing(base, with_mtp, dtype):
    """On a checkpoint with an MTP layer, a runner without mtp computes and caches bit for bit
    what it does on the same checkpoint without the layer; with mtp, the main model's logits
    and KV layers are those too, and the one more KV layer changes the layout id."""
    def runner(d, mtp=False):
        return ModelRunner(d, dtype=dtype, device="cpu", num_blocks=24, block_size=BS, mtp=mtp)

    seqs = _seqs(512)
    plain = runner(base)
    _, _, want = _run(plain, seqs, mtp=False)
    off = runner(with_mtp[0])
    _, _, got = _run(off, seqs, mtp=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(off.kv_cache, plain.kv_cache) and off.kv_layout == plain.kv_layout and off.mtp is None
    on = runner(with_mtp[0], mtp=True)
    _, _, got = _run(on, seqs, mtp=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    n = plain.spec.num_layers
    assert on.kv_cache.shape[0] == n + 1 and torch.equal(on.kv_cache[:n], plain.kv_cache)
    assert on.kv_cache[n].any() and on.kv_layout.mtp_layers == 1
    assert on.kv_layout.layout_id != plain.kv_layout.layout_id


def test_demo_models_mtp_layer_equals_the_trained_one():
    """models/stdlib-ds3-tiny on one held-out window: moed's MTP logits equal the training
    module's on moed's hidden states, and end to end (each from its own h) their next-next-token
    picks agree and score as the card says (~34% top-1 over the split)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from moed.dev.train.train import from_checkpoint, heldout_chunks

    split = json.loads((DEMO / "split.json").read_text())
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    chunks, missing = heldout_chunks(tok, split["heldout"][:8], 256, limit=1)
    if not chunks:
        pytest.skip(f"this Python's stdlib lacks the held-out files {missing}")
    c = chunks[0]
    model = from_checkpoint(DEMO)
    r = ModelRunner(DEMO, dtype="float32", device="cpu", num_blocks=17, block_size=16, mtp=True)
    assert r.mtp.embed is r.model.embed and r.mtp.head is r.model.lm_head     # DeepSeek's copies
    t, table = len(c) - 1, list(range(17))
    hs, outs = [], []
    for s in range(0, t, 96):                   # chunked prefill, then the MTP over each chunk
        n = min(96, t - s)
        batch = ForwardBatch([c[s:s + n]], [s], [table])
        _, h = r.forward(batch, hidden=True)
        mb, _ = mtp_inputs(batch, [c[s + n]])
        outs.append(r.forward_mtp(dataclasses.replace(mb, all_logits=(True,)), h))
        hs.append(h)
    got, h = torch.cat(outs), torch.cat(hs)
    with torch.no_grad():
        pe = model.lm.model.rotary_emb(h[None], torch.arange(t)[None])
        want = model.lm.lm_head(model.mtp(h[None], model.lm.model.embed_tokens(torch.tensor([c[1:]])), pe))[0]
        _, e2e = model(torch.tensor([c + [0]]))
    assert (got - want).abs().max().item() < 1e-4
    k = t - 1                                   # position i predicts c[i + 2]
    target = torch.tensor(c[2:])
    assert (got[:k].argmax(-1) == e2e[0, :k].argmax(-1)).float().mean().item() > 0.99
    acc, acc_train = ((x[:k].argmax(-1) == target).float().mean().item() for x in (got, e2e[0]))
    assert abs(acc - acc_train) < 0.01 and acc > 0.1      # one window: 18%; random picks: 0.02%


def test_refusals(base, with_mtp, tmp_path):
    """A checkpoint without an MTP layer: config.json says none (a ValueError naming the key),
    or says one (transformers' default) without its tensors (WeightError naming both)."""
    none = tmp_path / "none"
    shutil.copytree(base, none)
    cfg = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "num_nextn_predict_layers"}))
    spec = load_spec(none)
    for make in (lambda: _runner(none, mtp=True), lambda: load_weights(none, spec, "float32", mtp=True),
                 lambda: auto_num_blocks(spec, BS, "float32", 1, mtp=True)):
        with pytest.raises(ValueError, match="num_nextn_predict_layers is 0 or absent"):
            make()
    assert cfg["num_nextn_predict_layers"] == 1
    with pytest.raises(WeightError, match=r"num_nextn_predict_layers is 1, but the checkpoint lacks .*layers\.2\."):
        _runner(base, mtp=True)
    r = _runner(with_mtp[0])
    batch = ForwardBatch([[1, 2]], [0], [[0]])
    with pytest.raises(RuntimeError, match="mtp=True"):
        r.forward_mtp(batch, torch.zeros(2, r.spec.hidden_size))
    on = _runner(with_mtp[0], mtp=True)
    with pytest.raises(ValueError, match="hidden"):
        on.forward_mtp(batch, torch.zeros(3, r.spec.hidden_size))


def test_kv_layout_with_mtp(with_mtp):
    spec = load_spec(with_mtp[0])
    plain = archs.kv_layout(spec, 16, torch.bfloat16)
    kv = archs.kv_layout(spec, 16, torch.bfloat16, mtp_layers=1)
    assert kv.num_layers == plain.num_layers + 1 and kv.block_bytes == plain.block_bytes
    assert kv.bytes_per_block == (spec.num_layers + 1) * plain.block_bytes
    same_bytes = KVLayout.mla(spec.num_layers + 1, plain.entry_shape[0], 16, torch.bfloat16, plain.rope_dim)
    assert len({plain.layout_id, kv.layout_id, same_bytes.layout_id}) == 3     # a plain model never pairs
    assert plain.with_mtp(0) is plain
    with pytest.raises(ValueError, match="already"):
        kv.with_mtp(1)
    mb = 4 * kv.bytes_per_block // 2**20 + 1
    assert auto_num_blocks(spec, 16, "bfloat16", mb, mtp=True) == (mb << 20) // kv.bytes_per_block


def test_mtp_inputs_shift_tokens_and_keep_positions():
    batch = ForwardBatch([[10, 11, 12], [20], [30, 31]], [0, 7, 4], [[0], [1, 2], [3, 4]])
    mb, rows = mtp_inputs(batch, [13, 21, 32])
    assert mb.token_ids == [[11, 12, 13], [21], [31, 32]] and mb.start_pos == [0, 7, 4]
    assert mb.block_tables == batch.block_tables and rows == [0, 1, 2, 3, 4, 5]
    # after verifying drafts: sequence 0 keeps 2 positions (1 draft accepted, 12 rejected ->
    # the correction 40 follows), sequence 2 keeps 1
    mb, rows = mtp_inputs(batch, [40, 21, 41], keep=[2, 1, 1])
    assert mb.token_ids == [[11, 40], [21], [41]] and rows == [0, 1, 3, 4]
    with pytest.raises(ValueError, match="keep"):
        mtp_inputs(batch, [1, 2, 3], keep=[0, 1, 1])
