"""Every placement policy, pure: functions over `Candidate` records (no I/O, no clocks, no
asyncio), so each is tested without a server.

    candidate.py  Candidate: one node as a policy sees it (membership info, advertised load,
                  this node's own calls in flight, breaker state, KV layout)
    breaker.py    per-peer circuit breaker (closed → open → half-open trial)
    prefill.py    which prefill node takes a decode node's job (by jobs in flight; by predicted
                  finish time from the node's advertised cost state)
    cost.py       the attention cost model: a step's time from its chunks, fitted online
    step_time.py  the time-budget step policy: which prompt chunks run this step
    router.py     which serving node a router sends a request to (load, prefix affinity,
                  saturation)
    experts.py    the expert load balancer (EPLB): per-(layer, expert) load → physical→logical
                  expert map; migration-aware by default, DeepSeek's from-scratch one as a peer
    capacity.py   the capacity signals (measured prefill rate, decode step time, queue vs
                  compute time, predicted TTFT, capacity left under the SLO) and their meter
    scale.py      the scaling planner: desired prefill/decode node counts, which node drains
"""
