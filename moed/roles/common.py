"""What both roles share: the node's TransferWorker over its engine's KV tensor, and metrics."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from moed.engine.client import EngineClient
from moed.obs import metrics
from moed.transfer import TransferHandle, TransferState, TransferStatus, create_backend
from moed.transfer.worker import TransferWorker

if TYPE_CHECKING:
    from moed.app import App

log = structlog.get_logger(__name__)


def observe_transfer(handle: TransferHandle, status: TransferStatus, seconds: float) -> None:
    """TransferWorker observer → the transfer metrics section."""
    if status.state is TransferState.DONE:
        metrics.TRANSFER_BYTES.inc(handle.nbytes)
        metrics.TRANSFER_SECONDS.observe(seconds)
        if handle.nbytes and seconds > 0:
            metrics.TRANSFER_GBPS.observe(handle.nbytes / seconds / 1e9)
    elif status.state is TransferState.FAILED:
        metrics.TRANSFER_FAILURES.labels(status.reason.split(":")[0] or "transfer_error").inc()


async def start_worker(kind: str, node: str, engine: EngineClient) -> TransferWorker:
    """A started worker with the engine's KV region (tensor + layout from the model's KVLayout)
    registered (one per process)."""
    region = engine.kv_region()
    worker = TransferWorker(lambda: create_backend(kind, node), observer=observe_transfer)
    await worker.start()
    try:
        layout = await worker.register_kv(region.tensor, region.layout)
    except BaseException:
        await worker.close()
        raise
    log.info("transfer_ready", backend=kind, agent=worker.name, layers=layout.num_layers,
             blocks=layout.num_blocks, block_bytes=layout.block_bytes, kv_layout=layout.layout_id)
    return worker


def advertise_transfer(app: App, worker: TransferWorker) -> None:
    """Put our transfer endpoint (the agent name) in the gossip metadata, next to the KV
    layout id the membership already carries, so peers can pair with us knowingly."""
    from moed.cluster.service import MembershipComponent

    membership = next((c for c in app.components if isinstance(c, MembershipComponent)), None)
    if membership is not None:
        membership.update_meta(transfer=worker.name)


def new_incarnation() -> int:
    """Grows across restarts of a node (wall clock in ns): peers drop an older incarnation."""
    return time.time_ns()
