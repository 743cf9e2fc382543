"""One replica's recently routed prefix blocks: what its prefix cache probably still holds.

An LRU set of chained block hashes (prefix.block_hashes), sized like the replica's KV cache:
a block the router sent long ago has likely been evicted there too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

CHARS_PER_TOKEN = 4  # English text, roughly: converts the engine's token blocks to ours
DEFAULT_CAPACITY_BLOCKS = 16384  # when the engine does not say how large its cache is
# The most blocks kept per replica (64 M characters, about 16 M tokens of KV cache; some 100 MB
# here), whatever its num_gpu_blocks says: 1e18 let the index grow with every prompt routed.
MAX_CAPACITY_BLOCKS = 1 << 20


def capacity_blocks(num_gpu_blocks: int | None, block_size: int | None, block_chars: int) -> int:
    """How many of our blocks the replica's KV cache holds (vllm:cache_config_info)."""
    if num_gpu_blocks is None or block_size is None:
        return DEFAULT_CAPACITY_BLOCKS
    blocks = num_gpu_blocks * block_size * CHARS_PER_TOKEN // block_chars
    return max(1, min(blocks, MAX_CAPACITY_BLOCKS))


class PrefixIndex:
    """LRU of block hashes; `match` reads, `add` records a routed request."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` held here (the chain makes block i imply blocks < i)."""
        blocks = self._blocks
        matched = 0
        for value in hashes:
            if value not in blocks:
                break
            matched += 1
        return matched

    def add(self, hashes: Sequence[int]) -> None:
        blocks = self._blocks
        for value in hashes:
            if value in blocks:
                blocks.move_to_end(value)
            else:
                blocks[value] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        while len(self._blocks) > capacity:
            self._blocks.popitem(last=False)
