"""KV tiers below the engine's KV tensor: L2 host memory, L3 local disk (docs/kv-tiers.md)."""
from moed.kvcache.tiers.cache import TieredCache
from moed.kvcache.tiers.records import LoadResult, TierMatch, TierSettings

__all__ = ["LoadResult", "TierMatch", "TierSettings", "TieredCache"]
