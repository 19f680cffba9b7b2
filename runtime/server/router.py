"""Data parallelism: N independent engine replicas behind one server, each request to the least loaded.

`ReplicaRouter` stands where the server otherwise holds one EngineLoop and answers the same calls.
Each replica is an EngineLoop with its own engine thread (and, for a tensor/pipeline-parallel
artifact, its own ranks and process groups). A request goes to the replica with the fewest
unfinished requests routed to it — exact, unlike the replicas' statistics, which lag one step —
and stays there (its aborts follow it). Statistics are the replicas' summed (fractions averaged).
"""

from __future__ import annotations

import asyncio

from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server.engine_loop import EngineLoop, RequestStream


class ReplicaRouter:
    def __init__(self, replicas: list[EngineLoop]):
        self.replicas = replicas
        self._streams: list[set[RequestStream]] = [set() for _ in replicas]  # unfinished requests routed to each
        self._routes: dict[str, int] = {}  # request id → replica index
        self._starter: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Load the replicas one after another (returns at once): loading shares one-time imports
        and, on GPUs, the free-memory measurement each replica sizes its KV cache from."""
        self._starter = asyncio.get_running_loop().create_task(self._start_in_turn())

    async def _start_in_turn(self) -> None:
        for replica in self.replicas:
            replica.start()
            await replica.wait_ready()

    @property
    def is_ready(self) -> bool:
        return all(replica.is_ready for replica in self.replicas)

    async def wait_ready(self) -> None:
        """Return once every replica is loaded; raise what loading one raised."""
        await asyncio.shield(self._starter)

    async def shutdown(self) -> None:
        self._starter.cancel()
        await asyncio.gather(*(replica.shutdown() for replica in self.replicas))

    # ---- what the server reads -------------------------------------------------------------

    @property
    def engine(self):
        return self.replicas[0].engine  # options, tokenizer and manifest are the same in every replica

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def num_waiting(self) -> int:
        return sum(replica.num_waiting for replica in self.replicas)

    @property
    def num_unfinished_sequences(self) -> int:
        return sum(replica.num_unfinished_sequences for replica in self.replicas)

    @property
    def num_seats(self) -> int:
        return sum(replica.num_seats for replica in self.replicas)

    @property
    def failure(self) -> BaseException | None:
        return next((replica.failure for replica in self.replicas if replica.failure is not None), None)

    @property
    def stats(self) -> dict:
        """The replicas' counters summed; the rates recomputed from the summed counters, and the KV usage
        weighted by each replica's blocks (an unweighted mean of the rates halved a hit rate that one
        replica's traffic made)."""
        snapshots = [replica.stats for replica in self.replicas]
        merged: dict = {}
        for snapshot in snapshots:
            for key, value in snapshot.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    merged[key] = merged.get(key, 0) + value
        queries, proposed = merged.get("prefix_cache_queries", 0), merged.get("num_spec_proposed", 0)
        total_blocks = merged.get("num_total_blocks", 0)
        merged["prefix_cache_hit_rate"] = merged.get("prefix_cache_hits", 0) / queries if queries else 0.0
        merged["spec_acceptance_rate"] = merged.get("num_spec_accepted", 0) / proposed if proposed else 0.0
        merged["kv_cache_usage"] = (sum(s.get("kv_cache_usage", 0.0) * s.get("num_total_blocks", 0) for s in snapshots)
                                    / total_blocks if total_blocks else 0.0)
        return merged

    # ---- requests --------------------------------------------------------------------------

    def num_unfinished(self, index: int) -> int:
        streams = self._streams[index]
        for stream in [s for s in streams if s.is_finished]:
            streams.discard(stream)
            self._routes.pop(stream.request_id, None)
        return len(streams)

    async def add_request(self, stream: RequestStream, prompt_token_ids: list[int], params: SamplingParams,
                          priority: int = 0, lora_request=None, multi_modal_data: dict | None = None,
                          cache_salt: str | None = None) -> None:
        index = min(range(len(self.replicas)), key=self.num_unfinished)
        self._streams[index].add(stream)
        self._routes[stream.request_id] = index
        try:
            await self.replicas[index].add_request(stream, prompt_token_ids, params, priority, lora_request,
                                                   multi_modal_data, cache_salt)
        except BaseException:
            self._streams[index].discard(stream)
            self._routes.pop(stream.request_id, None)
            raise

    def abort_all(self, error: BaseException) -> None:
        for replica in self.replicas:
            replica.abort_all(error)

    def abort(self, request_id: str) -> None:
        index = self._routes.pop(request_id, None)
        if index is not None:
            self.replicas[index].abort(request_id)
