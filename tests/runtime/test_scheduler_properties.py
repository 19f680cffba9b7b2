"""Property test: drive the scheduler like an engine would, with random load, and check each step.

The simulated engine keeps a fake KV cache so that prefix sharing, chunking and preemption are
checked for what matters. A slot holds what real KV depends on, the token ids up to and including
its position; every computed position a request attends to must hold exactly its own prefix, and
nobody may write into a block someone else also holds. The
"model" samples a deterministic function of the tokens so far, so every request's output must
equal its solo reference generation no matter how it was scheduled or preempted.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmc.errors import RequestError
from llmc.runtime.request import Request, RequestStatus
from llmc.runtime.scheduler import ScheduledBatch, Scheduler, SchedulerConfig

EOS = 13
MAX_STEPS = 3000
STEMS = ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3] * 3, list(range(20, 68)))


def sample_token(token_ids: list[int]) -> int:
    return (31 * token_ids[-1] + 7 * len(token_ids)) % 40 + 1


@dataclass
class RequestSpec:
    arrival_step: int
    prompt: list[int]
    max_tokens: int
    priority: int
    stops_at_eos: bool
    abort_step: int | None
    aborts_mid_step: bool


@dataclass
class Scenario:
    config: SchedulerConfig
    specs: list[RequestSpec]


@st.composite
def request_specs(draw, index: int, max_model_len: int) -> RequestSpec:
    """Mostly requests that fit; a few too long (rejected); stems make shared prefixes."""
    stem = STEMS[draw(st.integers(0, len(STEMS) - 1))]
    prompt = stem[: draw(st.integers(0, max_model_len // 2 + 2))]
    prompt = prompt + [100 + 50 * index + offset for offset in range(draw(st.integers(0, 5)))]
    if not prompt:
        prompt = [100 + 50 * index]
    return RequestSpec(
        arrival_step=draw(st.integers(0, 6)),
        prompt=prompt,
        max_tokens=draw(st.integers(1, max_model_len // 3 + 1)),
        priority=draw(st.integers(0, 3)),
        stops_at_eos=draw(st.booleans()),
        abort_step=draw(st.none() | st.none() | st.integers(0, 30)),
        aborts_mid_step=draw(st.booleans()),
    )


@st.composite
def scenarios(draw) -> Scenario:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 40))
    chunked = draw(st.booleans()) or draw(st.booleans())
    low_budget = 1 if chunked else max_model_len
    # From about half of what one longest request needs (some get rejected) to a roomy cache.
    num_blocks_one_request = -(-max_model_len // block_size)
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(low_budget, max_model_len + 16)),
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=draw(st.integers(num_blocks_one_request // 2 + 1, 2 * num_blocks_one_request)),
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_chunked_prefill=chunked,
    )
    num_requests = draw(st.integers(1, 10))
    specs = [draw(request_specs(index, max_model_len)) for index in range(num_requests)]
    return Scenario(config, specs)


def reference_output(spec: RequestSpec, max_model_len: int) -> list[int]:
    token_ids, output = list(spec.prompt), []
    while True:
        token = sample_token(token_ids)
        token_ids.append(token)
        output.append(token)
        if len(output) >= spec.max_tokens or len(token_ids) >= max_model_len:
            return output
        if spec.stops_at_eos and token == EOS:
            return output


def can_ever_run(spec: RequestSpec, config: SchedulerConfig) -> bool:
    num_total = len(spec.prompt) + spec.max_tokens
    num_blocks = -(-(num_total - 1) // config.block_size)
    return num_total <= config.max_model_len and num_blocks <= config.num_blocks


class SimulatedEngine:
    """Calls the scheduler the way the engine does and checks it after every call."""

    def __init__(self, scenario: Scenario):
        self.config = scenario.config
        self.specs = scenario.specs
        self.scheduler = Scheduler(self.config)
        self.kv: dict[int, list[int | None]] = {}  # block id -> per slot, fingerprint of its prefix
        self.fingerprints: dict[str, list[int]] = {}  # request id -> fingerprint of each prefix
        self.requests: dict[str, Request] = {}
        self.order: dict[str, int] = {}
        self.num_partial_chunks = 0

    def run(self) -> None:
        for step_index in range(MAX_STEPS):
            self.add_arrivals(step_index)
            self.abort(step_index, mid_step=False)
            batch = self.scheduler.schedule()
            self.check_batch(batch)
            self.forward(batch)
            self.abort(step_index, mid_step=True)
            self.update(batch)
            last_arrival = max(spec.arrival_step for spec in self.specs)
            if step_index >= last_arrival and not self.scheduler.has_unfinished_requests():
                return
        raise AssertionError(f"not finished after {MAX_STEPS} steps: {self.scheduler.stats()}")

    def add_arrivals(self, step_index: int) -> None:
        for index, spec in enumerate(self.specs):
            if spec.arrival_step != step_index:
                continue
            request = Request(f"r{index}", list(spec.prompt), spec.max_tokens,
                              arrival_time=step_index + index / 100, priority=spec.priority)
            try:
                self.scheduler.add_request(request)
            except RequestError:
                assert not can_ever_run(spec, self.config)
                continue
            assert can_ever_run(spec, self.config)
            self.requests[request.request_id] = request
            self.order[request.request_id] = len(self.order)

    def abort(self, step_index: int, mid_step: bool) -> None:
        for index, spec in enumerate(self.specs):
            if spec.abort_step == step_index and spec.aborts_mid_step == mid_step:
                self.scheduler.abort_request(f"r{index}")
        if not mid_step:
            self.scheduler.check_invariants()

    def policy_key(self, request: Request) -> tuple:
        arrival = (request.arrival_time, self.order[request.request_id])
        return (request.priority, *arrival) if self.config.policy == "priority" else arrival

    def check_batch(self, batch: ScheduledBatch) -> None:
        config, items = self.config, batch.requests
        assert batch.num_batched_tokens == sum(item.num_new_tokens for item in items)
        assert batch.num_batched_tokens <= config.max_num_batched_tokens
        assert len(items) <= config.max_num_seqs
        assert len({id(item.request) for item in items}) == len(items)
        assert all(item.is_decode for item in items[: batch.num_decodes])
        assert not any(item.is_decode for item in items[batch.num_decodes :])
        for item in items:
            request = item.request
            assert item.num_new_tokens >= 1 and request.status is RequestStatus.RUNNING
            end = request.num_computed_tokens + item.num_new_tokens
            assert item.is_last_chunk == (end == request.num_tokens) and end <= request.num_tokens
            if not config.enable_chunked_prefill:
                assert item.is_last_chunk
            self.num_partial_chunks += not item.is_last_chunk
            assert len(request.block_ids) == -(-end // config.block_size)
        for request in batch.preempted:
            assert request.status is RequestStatus.WAITING and not request.block_ids
            assert all(self.policy_key(item.request) < self.policy_key(request) for item in items)
        self.scheduler.check_invariants()

    def forward(self, batch: ScheduledBatch) -> None:
        """Check that attended positions hold the right tokens, then write the new ones."""
        block_size, pool = self.config.block_size, self.scheduler.block_pool
        for item in batch.requests:
            request = item.request
            fingerprints = self.prefix_fingerprints(request)
            start = request.num_computed_tokens
            for position in range(start + item.num_new_tokens):
                block_id = request.block_ids[position // block_size]
                slots = self.kv.setdefault(block_id, [None] * block_size)
                if position < start:
                    assert slots[position % block_size] == fingerprints[position]
                else:
                    assert pool.blocks[block_id].ref_count == 1  # never write a shared block
                    slots[position % block_size] = fingerprints[position]

    def prefix_fingerprints(self, request: Request) -> list[int]:
        """Entry p identifies token ids [0, p]: what real KV at position p depends on."""
        fingerprints = self.fingerprints.setdefault(request.request_id, [])
        for token_id in request.all_token_ids[len(fingerprints) :]:
            fingerprints.append(hash((fingerprints[-1] if fingerprints else None, token_id)))
        return fingerprints

    def update(self, batch: ScheduledBatch) -> None:
        sampled = {item.request.request_id: [sample_token(item.request.all_token_ids)]
                   for item in batch.requests if item.is_last_chunk}
        finished = self.scheduler.update(batch, sampled)
        for request in finished:
            assert request.status is RequestStatus.FINISHED_LENGTH and not request.block_ids
        for item in batch.requests:
            request = item.request
            spec = self.specs[int(request.request_id[1:])]
            if (request.status is RequestStatus.RUNNING and item.is_last_chunk
                    and spec.stops_at_eos and request.output_token_ids[-1] == EOS):
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        for request in self.scheduler.running:
            assert len(request.block_ids) == -(-request.num_computed_tokens
                                               // self.config.block_size)
        self.scheduler.check_invariants()

    def check_end(self) -> None:
        scheduler, pool = self.scheduler, self.scheduler.block_pool
        scheduler.check_invariants()
        assert not scheduler.has_unfinished_requests()
        assert pool.num_free_blocks == pool.num_blocks
        assert all(block.ref_count == 0 for block in pool.blocks)
        stats = scheduler.stats()
        assert 0 <= stats["prefix_cache_hits"] <= stats["prefix_cache_queries"]
        for request_id, request in self.requests.items():
            spec = self.specs[int(request_id[1:])]
            expected = reference_output(spec, self.config.max_model_len)
            assert request.is_finished and not request.block_ids
            cap = (request.num_prompt_tokens - 1) // self.config.block_size
            assert request.num_cached_tokens <= cap * self.config.block_size
            if request.status is RequestStatus.FINISHED_ABORTED:
                assert request.output_token_ids == expected[: request.num_output_tokens]
            else:
                assert request.output_token_ids == expected


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_scheduler_keeps_its_invariants_under_random_load(scenario: Scenario):
    engine = SimulatedEngine(scenario)
    engine.run()
    engine.check_end()
    stats = engine.scheduler.stats()
    event(f"preempted: {stats['num_preemptions'] > 0}")
    event(f"prefix hits: {stats['prefix_cache_hits'] > 0}")
    event(f"rejected: {len(engine.requests) < len(scenario.specs)}")
    event(f"chunked: {engine.num_partial_chunks > 0}")
