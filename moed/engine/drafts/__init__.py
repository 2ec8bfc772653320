"""Draft proposers for speculative decoding: where the tokens a step verifies come from.

A proposer guesses a request's next few tokens cheaply; the target model scores them in one
forward pass and moed.model.spec_verify keeps the longest prefix that exact speculative
sampling accepts, so the output distribution never depends on the guesses, only the speed.
Proposers are per-request and pure (tokens in, token ids out); the engine owns when they run.

ngram.py: prompt lookup (vLLM's `ngram` method), an incremental n-gram index.
propose.py: when a request drafts and how many tokens (the scheduler's side, no torch);
`[speculative]` turns it on (docs/speculative.md).
gate.py: the per-step switch, whether a step may draft at all (measured per decoding row count).
"""
