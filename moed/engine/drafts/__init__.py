"""Draft proposers for speculative decoding: where the tokens a step verifies come from.

A proposer guesses a request's next few tokens cheaply; the target model scores them in one
forward pass and moed.model.spec_verify keeps the longest prefix that exact speculative
sampling accepts, so the output distribution never depends on the guesses, only the speed.
Proposers are per-request and pure (tokens in, token ids out); the engine owns when they run.

ngram.py: prompt lookup (vLLM's `ngram` method), an incremental n-gram index.

Not wired yet (issue 32): nothing in the engine calls this package, and no config key or
request field selects it.
"""
