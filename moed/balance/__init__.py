"""Every placement policy, pure: functions over `Candidate` records (no I/O, no clocks, no
asyncio), so each is tested without a server.

    candidate.py  Candidate: one node as a policy sees it (membership info, advertised load,
                  this node's own calls in flight, breaker state, KV layout)
    breaker.py    per-peer circuit breaker (closed → open → half-open trial)
    prefill.py    which prefill node takes a decode node's job
    router.py     which serving node a router sends a request to
"""
