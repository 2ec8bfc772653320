"""Offline byte-level BPE tokenizers for random checkpoints (no model hub needed).

Trained with `tokenizers` on the Python standard library's own sources (present on every
machine that runs moed), sorted by path so the corpus and the result are deterministic for a
given Python install. Trained tokenizers are cached per (style, vocab size) under
`~/.cache/moed/tokenizers/` (or `$MOED_CACHE_DIR`) so tests do not retrain each time.
"""
from __future__ import annotations

import os
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import structlog
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

log = structlog.get_logger(__name__)

# Special tokens per chat style; they take ids 0..n-1 in the trained vocab.
SPECIAL_TOKENS: dict[str, list[str]] = {
    "chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],   # Qwen style
    "mistral": ["<unk>", "<s>", "</s>"],                           # Mixtral style: bos=1, eos=2
}
_CACHE_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get("MOED_CACHE_DIR") or Path.home() / ".cache" / "moed"
    return Path(root) / "tokenizers"


def _corpus(max_bytes: int) -> Iterator[str]:
    """Stdlib .py sources in sorted path order (skips site-packages and tests), up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def _train(style: str, vocab_size: int) -> Tokenizer:
    max_bytes = min(20_000_000, max(3_000_000, vocab_size * 400))
    return train_bpe(style, vocab_size, _corpus(max_bytes))


def train_bpe(style: str, vocab_size: int, texts: Iterable[str]) -> Tokenizer:
    """A byte-level BPE of `style` trained on texts (deterministic for the same texts)."""
    specials = SPECIAL_TOKENS[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if style == "mistral":
        # Mistral tokenizers prepend <s> when asked for special tokens.
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def trained_tokenizer(style: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE with at most `vocab_size` tokens (specials first), from cache or trained."""
    if style not in SPECIAL_TOKENS:
        raise ValueError(f"unknown tokenizer style {style!r}; expected one of {sorted(SPECIAL_TOKENS)}")
    if vocab_size < 256 + len(SPECIAL_TOKENS[style]):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE (>= 259)")
    path = cache_dir() / f"{style}-{vocab_size}-v{_CACHE_VERSION}.json"
    if path.exists():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # a corrupt cache file is rebuilt, never trusted
            log.warning("tokenizer_cache_corrupt", path=str(path))
    t0 = time.monotonic()
    tok = _train(style, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic write: concurrent test processes may train the same tokenizer.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    tok.save(tmp)
    os.replace(tmp, path)
    log.info("tokenizer_trained", style=style, vocab_size=tok.get_vocab_size(),
             seconds=round(time.monotonic() - t0, 2), path=str(path))
    return tok
