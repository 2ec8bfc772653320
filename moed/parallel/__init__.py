"""Expert parallelism on torch.distributed: layout (which rank holds which physical expert
slots), group (rendezvous, timeouts, failure), dispatch (tokens to the ranks of their experts
and back), agree (the per-step "anyone has work" and the idle wait), rebalance (the expert
balancer's controller: new maps applied layer by layer, weights moved between ranks). See
docs/parallel.md."""
