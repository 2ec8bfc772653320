#!/bin/sh
# Entry point of every moed container (deploy/kubernetes): sets the moed settings only the pod
# knows, then execs moed, which becomes PID 1 (SIGTERM reaches it: the drain). Arguments: moed's.
#
#   GOSSIP_SERVICE   the headless Service of all moed pods (publishNotReadyAddresses): every
#                    address it publishes now becomes a seed (cluster.seeds). moed resolves a
#                    seed name once and keeps its first address, which may be this pod: passing
#                    them all means a pod joins whoever is up. The first pods wait up to
#                    SEED_WAIT_S (20) for a peer to appear, so pods started together find each
#                    other; a pod that sees none starts alone and the next ones join it.
#   POD_IP           this pod's address (not a seed of itself)
#   CPU_LIMIT        the container's CPU limit (whole cores): engine.num_threads = CPU_LIMIT - 1,
#                    one core left to the event loop, as moed's own default does with the cores
#                    it may use (a CPU limit does not shrink the affinity mask it counts)
#   LWS_WORKER_INDEX, LWS_GROUP_SIZE, LWS_LEADER_ADDRESS (set by LeaderWorkerSet): the
#                    expert-parallel rank, group size and rank 0's rendezvous on EP_PORT (29500)
set -eu

if [ -n "${GOSSIP_SERVICE:-}" ]; then
    port="${GOSSIP_PORT:-7946}"
    deadline=$(( $(date +%s) + ${SEED_WAIT_S:-20} ))
    while :; do
        peers=$(getent ahostsv4 "$GOSSIP_SERVICE" 2>/dev/null | awk -v self="${POD_IP:-}" \
            '$1 != self && !seen[$1]++ { print $1 }' | sort) || peers=""
        [ -n "$peers" ] || [ "$(date +%s)" -ge "$deadline" ] && break
        sleep 1
    done
    seeds=""
    for ip in $peers; do seeds="${seeds:+$seeds,}$ip:$port"; done
    export MOED_CLUSTER_SEEDS="$seeds"
    echo "moed-k8s: cluster seeds from $GOSSIP_SERVICE: ${seeds:-none (first pod)}" >&2
fi

if [ -n "${CPU_LIMIT:-}" ]; then
    export MOED_ENGINE_NUM_THREADS=$(( CPU_LIMIT > 1 ? CPU_LIMIT - 1 : 1 ))
fi

if [ -n "${LWS_WORKER_INDEX:-}" ]; then
    export MOED_PARALLEL_EP_RANK="$LWS_WORKER_INDEX"
    export MOED_PARALLEL_EP_SIZE="${LWS_GROUP_SIZE:?LWS_GROUP_SIZE unset}"
    export MOED_PARALLEL_EP_INIT="tcp://${LWS_LEADER_ADDRESS:?LWS_LEADER_ADDRESS unset}:${EP_PORT:-29500}"
fi

exec moed "$@"          # /opt/moed/bin/moed: the image puts /opt/moed/bin first on PATH
