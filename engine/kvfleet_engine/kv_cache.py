"""The KV block pool: fixed-size blocks, reference counts, and a prefix cache.

A full block is cached under a chained hash of (parent block's hash, its token ids). A lookup
also compares the block's token ids and parent hash, so a hash collision can never hand a request
someone else's KV. Freed blocks keep their cached content and are reused least-recently-freed
first; blocks with nothing cached are reused before any cached one.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet_engine.request import Request

log = logging.getLogger(__name__)

_ROOT_HASH = b""


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained 128-bit hash of one full block."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block holds a cached full block's content.
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


class KVCacheManager:
    """Owns which request holds which blocks. Verbs return values; None means 'no room'."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, in reuse order (first = next to be reused).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of the request's tokens (its last token is always
        computed, so at most (num_tokens - 1) // block_size blocks)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        parent = _ROOT_HASH
        for index, block_hash in enumerate(self._block_hashes(request)[:max_blocks]):
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            tokens = request.all_token_ids[index * self.block_size : (index + 1) * self.block_size]
            if block.parent_hash != parent or block.token_ids != tuple(tokens):
                log.warning("prefix cache hash collision on block %d; treated as a miss", block_id)
                break
            hits.append(block_id)
            parent = block_hash
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (tokens looked up, tokens found)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries_total += num_tokens
            self.prefix_cache_hits_total += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()
    ) -> list[int] | None:
        """Give the request room for num_new_tokens more tokens after its computed ones (and
        after computed_block_ids, prefix hits from get_computed_blocks). Returns the newly
        allocated block ids, or None without changing anything when the pool is too small."""
        if not computed_block_ids:  # fast path of a decode: room in the last block, none fills
            end = request.num_computed_tokens + num_new_tokens
            if end <= len(request.block_ids) * self.block_size and (
                not self.enable_prefix_caching
                or end // self.block_size <= request.num_registered_blocks
            ):
                return []
        num_computed = request.num_computed_tokens + len(computed_block_ids) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens)
        num_new_blocks = num_needed - len(request.block_ids) - len(computed_block_ids)
        num_revived = sum(1 for b in computed_block_ids if self.blocks[b].ref_count == 0)
        if max(num_new_blocks, 0) + num_revived > self.num_free_blocks:
            return None
        for block_id in computed_block_ids:
            self._take(block_id, keep_cached=True)
        if computed_block_ids:  # prefix hits: cached already
            request.block_ids.extend(computed_block_ids)
            request.num_registered_blocks = len(request.block_ids)
        new_block_ids = [
            self._take(next(iter(self.free_blocks)), keep_cached=False)
            for _ in range(num_new_blocks)
        ]
        request.block_ids.extend(new_block_ids)
        # Only blocks whose tokens are all known (a pending token's block waits a step).
        num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
        if self.enable_prefix_caching and num_full > request.num_registered_blocks:
            self._cache_full_blocks(request, num_full)
        return new_block_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks; cached content stays reusable until evicted. The
        tail is freed first so that the longest prefixes are evicted first."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.block_hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)
        request.block_ids.clear()
        request.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget the cached content of every free block."""
        for block_id in self.free_blocks:
            self._uncache(self.blocks[block_id])

    def _take(self, block_id: int, *, keep_cached: bool) -> int:
        """Add a reference; a free block reused for new content loses its cached identity."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
            if not keep_cached:
                self._uncache(block)
        block.ref_count += 1
        return block_id

    def _uncache(self, block: Block) -> None:
        if (
            block.block_hash is not None
            and self.cached_blocks.get(block.block_hash) == block.block_id
        ):
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = ()

    def _block_hashes(self, request: Request) -> list[bytes]:
        """Extend request.block_hashes over every full block of its known tokens."""
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        while len(hashes) < num_full:
            start = len(hashes) * self.block_size
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(
                hash_block(parent, request.all_token_ids[start : start + self.block_size])
            )
        return hashes

    def _cache_full_blocks(self, request: Request, num_full: int) -> None:
        """Register the request's first num_full blocks (full; their tokens are known)."""
        hashes = self._block_hashes(request)
        for index in range(request.num_registered_blocks, num_full):
            block = self.blocks[request.block_ids[index]]
            block_hash = hashes[index]
            if block_hash in self.cached_blocks:
                continue  # an identical block is already cached; this one stays private
            start = index * self.block_size
            block.block_hash = block_hash
            block.parent_hash = hashes[index - 1] if index else _ROOT_HASH
            block.token_ids = tuple(request.all_token_ids[start : start + self.block_size])
            self.cached_blocks[block_hash] = block.block_id
        request.num_registered_blocks = num_full
