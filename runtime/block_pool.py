"""The KV block pool: a fixed set of ref-counted blocks with automatic prefix caching.

Plain Python, no tensors: a block is an id into the KV cache tensors that the model runner owns.

Prefix caching: once a block is full and its KV computed, the scheduler registers it under a hash
of (parent block's hash, the block's token ids), a chain, so equal hashes mean equal whole
prefixes. A block whose ref count drops to zero keeps its hash and waits in an LRU of free cached
blocks: a later request with the same prefix takes it back (`share`); a fresh allocation evicts
the least recently freed one only when no never-cached free block is left.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes  # sha256 digest of one full block's token ids chained to its parent's hash

_ROOT_TAG = b"\x00"    # first block of a sequence: no parent
_CHILD_TAG = b"\x01"   # followed by the 32-byte parent digest


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block, chained to its parent's hash (None for a sequence's first block)."""
    digest = hashlib.sha256(_ROOT_TAG if parent_hash is None else _CHILD_TAG + parent_hash)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def lora_root_hash(lora_int_id: int | None) -> BlockHash | None:
    """The parent of a sequence's first block under a run-time LoRA adapter (None: no adapter), so the
    blocks of one adapter never match another's or the base model's."""
    return None if lora_int_id is None else hashlib.sha256(b"lora\x00" + str(lora_int_id).encode()).digest()


def sequence_root_hash(lora_int_id: int | None, image_hash: bytes | None,
                       cache_salt: str | None = None) -> BlockHash | None:
    """The parent of a sequence's first block: lora_root_hash, and with images (runtime/multimodal.py) their digest
    too, so a prompt's blocks never match those of the same tokens with other images, or without (vLLM keys only
    the blocks from the first image on; here the whole prompt's, text before the image included). A request's
    `cache_salt` (vLLM's) goes in last: its blocks match only requests with the same salt."""
    root = lora_root_hash(lora_int_id)
    if image_hash is not None:
        root = hashlib.sha256(b"images\x00" + (root or b"") + image_hash).digest()
    if cache_salt is not None:
        root = hashlib.sha256(b"salt\x00" + (root or b"") + cache_salt.encode("utf-8", "surrogatepass")).digest()
    return root


def hash_token_blocks(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hash chain of every full block of `token_ids` (a trailing partial block gets none)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
    return hashes


@dataclass
class KVBlock:
    """One block of the KV cache.

    Fields:
        block_id: index into the KV cache tensors, 0..num_blocks-1.
        ref_count: number of block tables holding it; 0 means free (possibly still cached).
        block_hash: set while the block is registered in the prefix cache, else None.
    """

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Fixed pool of `num_blocks` blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # Free blocks without a hash: allocated first, since reusing them loses nothing.
        self._free_uncached: deque[KVBlock] = deque(self.blocks)
        # Free blocks with a hash, least recently freed first: evicted in that order.
        self._free_cached: OrderedDict[int, KVBlock] = OrderedDict()
        # Every registered block (in use or free) by hash; one block per hash.
        self._cached: dict[BlockHash, KVBlock] = {}

    # ---- queries ----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count zero, including free cached ones (they are evictable)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_free_cached_blocks(self) -> int:
        return len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_blocks(self, block_ids: Iterable[int]) -> list[KVBlock]:
        return [self.blocks[block_id] for block_id in block_ids]

    def can_allocate(self, num_blocks: int, shared_blocks: Sequence[KVBlock] = ()) -> bool:
        """Whether `allocate(num_blocks)` succeeds after `share(shared_blocks)`.

        Sharing a free cached block takes it off the free list, so it counts against the free
        blocks too.
        """
        num_revived = sum(1 for block in shared_blocks if block.ref_count == 0)
        return num_blocks + num_revived <= self.num_free_blocks

    def find_cached_blocks(self, block_hashes: Iterable[BlockHash]) -> list[KVBlock]:
        """The longest run of cached blocks matching `block_hashes` from the start."""
        found: list[KVBlock] = []
        if not self.enable_prefix_caching:
            return found
        for block_hash in block_hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[KVBlock]:
        """The longest chain of cached full blocks that is a prefix of `token_ids`."""
        if not self.enable_prefix_caching:
            return []
        return self.find_cached_blocks(hash_token_blocks(token_ids, self.block_size))

    # ---- mutations --------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` fresh blocks (ref count 1), evicting cached ones if needed."""
        # NOTE: never-cached free blocks go first; only then is the least recently freed cached
        # block evicted (its hash dropped), so cached prefixes live as long as possible.
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(
                f"allocate({num_blocks}) with {self.num_free_blocks} free blocks; "
                "call can_allocate first"
            )
        allocated = []
        for _ in range(num_blocks):
            block = self._free_uncached.popleft() if self._free_uncached else self._evict()
            block.ref_count = 1
            allocated.append(block)
        return allocated

    def share(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each cached block (a prefix-cache hit); revives free ones."""
        for block in blocks:
            if block.block_hash is None or self._cached.get(block.block_hash) is not block:
                raise RuntimeError(f"share of block {block.block_id}, which is not cached")
            if block.ref_count == 0:
                del self._free_cached[block.block_id]
            block.ref_count += 1

    def fork(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each in-use block: a second block table now holds it (a beam's
        child shares its parent's KV; the first write into a shared block copies it first)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"fork of free block {block.block_id}")
            block.ref_count += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference to each block; blocks reaching zero become free.

        Given a block table, the tail is freed first so that it is also evicted first: a later
        prefix hit needs the leading blocks of a chain, never the trailing ones alone.
        """
        for block in reversed(blocks):
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is None:
                self._free_uncached.append(block)
            else:
                self._free_cached[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed, in-use block under `block_hash`; True if it now is cached.

        When another block already holds the hash (two requests computed the same prefix at the
        same time), this one stays uncached and is recycled plainly once freed.
        """
        if not self.enable_prefix_caching:
            return False
        if block.ref_count <= 0:
            raise RuntimeError(f"cache_block of free block {block.block_id}")
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible (True) when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._free_cached.values():
            block.block_hash = None
            self._free_uncached.append(block)
        self._free_cached.clear()
        self._cached.clear()
        return True

    def _evict(self) -> KVBlock:
        _, block = self._free_cached.popitem(last=False)
        del self._cached[block.block_hash]
        block.block_hash = None
        return block

    # ---- checks -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (used by tests)."""
        free_uncached = {block.block_id for block in self._free_uncached}
        check_invariant(len(free_uncached) == len(self._free_uncached), "duplicate free block")
        check_invariant(not free_uncached & self._free_cached.keys(), "block in both free lists")
        free_ids = free_uncached | self._free_cached.keys()
        for block_id, block in enumerate(self.blocks):
            name = f"block {block_id}"
            check_invariant(block.block_id == block_id, f"{name} has id {block.block_id}")
            is_free = block_id in free_ids
            check_invariant(block.ref_count >= 0, f"{name} has ref count {block.ref_count}")
            check_invariant(is_free == (block.ref_count == 0), f"{name}: free list vs ref count")
            is_hashed = block.block_hash is not None
            check_invariant(not is_free or is_hashed == (block_id in self._free_cached),
                            f"{name} is in the wrong free list")
            check_invariant(not is_hashed or self._cached.get(block.block_hash) is block,
                            f"{name} has a hash that does not map back to it")
        check_invariant(all(block.block_hash == key for key, block in self._cached.items()),
                        "the hash map holds a block under a stale hash")
        check_invariant(self.enable_prefix_caching or not self._cached,
                        "prefix caching is off but blocks are cached")


def check_invariant(condition: bool, message: str) -> None:
    """Raise AssertionError(message) unless condition; unlike `assert`, survives python -O."""
    if not condition:
        raise AssertionError(message)
