"""Unit tests of the scheduler: budget, chunking, seats, preemption, policies, prefix reuse."""

import logging
import zlib

import pytest

from llmc.errors import ConfigError, RequestError
from llmc.runtime.request import Request, RequestStatus
from llmc.runtime.scheduler import ScheduledBatch, Scheduler, SchedulerConfig


def make_scheduler(**overrides) -> Scheduler:
    settings = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                    num_blocks=32)
    settings.update(overrides)
    return Scheduler(SchedulerConfig(**settings))


def make_request(request_id: str, num_prompt: int, max_tokens: int = 4, arrival: float = 0.0,
                 priority: int = 0, first_token: int | None = None) -> Request:
    """Prompts of different ids share no prefix unless `first_token` says so."""
    if first_token is None:
        first_token = 1000 * (1 + zlib.crc32(request_id.encode()) % 10_000)
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(request_id, prompt, max_tokens, arrival_time=arrival, priority=priority)


def step(scheduler: Scheduler) -> tuple[ScheduledBatch, list[Request]]:
    """One engine step; the 'model' samples 7 + the number of tokens so far."""
    batch = scheduler.schedule()
    sampled = {item.request.request_id: [7 + item.request.num_tokens]
               for item in batch.requests if item.is_last_chunk}
    finished = scheduler.update(batch, sampled)
    scheduler.check_invariants()
    return batch, finished


def shape(batch: ScheduledBatch) -> list[tuple[str, int, bool]]:
    return [(item.request.request_id, item.num_new_tokens, item.is_last_chunk)
            for item in batch.requests]


def run_to_completion(scheduler: Scheduler, max_steps: int = 500) -> int:
    for num_steps in range(1, max_steps + 1):
        step(scheduler)
        if not scheduler.has_unfinished_requests():
            return num_steps
    raise AssertionError("requests did not finish")


def assert_all_free(scheduler: Scheduler) -> None:
    scheduler.check_invariants()
    pool = scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_count == 0 for block in pool.blocks)


def test_prefill_then_decodes_until_length():
    scheduler = make_scheduler()
    request = make_request("a", num_prompt=10, max_tokens=3)
    scheduler.add_request(request)
    batch, finished = step(scheduler)
    assert shape(batch) == [("a", 10, True)] and batch.num_batched_tokens == 10
    assert request.status is RequestStatus.RUNNING and len(request.block_ids) == 3
    assert request.output_token_ids == [17] and finished == []
    batch, _ = step(scheduler)
    assert shape(batch) == [("a", 1, True)] and batch.num_decodes == 1
    batch, finished = step(scheduler)
    assert finished == [request] and request.status is RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [17, 18, 19] and request.block_ids == []
    assert not scheduler.has_unfinished_requests()
    assert_all_free(scheduler)


def test_long_prompt_is_chunked_by_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", num_prompt=20, max_tokens=2))
    chunks = [shape(step(scheduler)[0]) for _ in range(4)]
    assert chunks == [[("a", 8, False)], [("a", 8, False)], [("a", 4, True)], [("a", 1, True)]]


def test_last_prefill_that_does_not_fit_is_chunked():
    scheduler = make_scheduler(max_num_batched_tokens=12)
    scheduler.add_request(make_request("a", num_prompt=6))
    scheduler.add_request(make_request("b", num_prompt=10))
    scheduler.add_request(make_request("c", num_prompt=3))
    batch, _ = step(scheduler)
    assert shape(batch) == [("a", 6, True), ("b", 6, False)]
    assert scheduler.requests["b"].status is RequestStatus.RUNNING
    assert len(scheduler.requests["b"].block_ids) == 2  # blocks for the chunk only
    batch, _ = step(scheduler)  # decode first, then b's rest, then c
    assert shape(batch) == [("a", 1, True), ("b", 4, True), ("c", 3, True)]
    assert batch.num_decodes == 1 and batch.num_batched_tokens == 8


def test_budget_equal_to_max_model_len_prefills_whole_prompts():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_model_len=32)
    scheduler.add_request(make_request("a", num_prompt=30, max_tokens=2))
    assert shape(step(scheduler)[0]) == [("a", 30, True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_model_len=16,
                               enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", num_prompt=10))
    scheduler.add_request(make_request("b", num_prompt=10))
    assert shape(step(scheduler)[0]) == [("a", 10, True)]  # b needs 10, 6 left: no chunk
    assert shape(step(scheduler)[0]) == [("a", 1, True), ("b", 10, True)]
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=8, max_model_len=16, enable_chunked_prefill=False)


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", num_prompt=4, max_tokens=2))
    batch, _ = step(scheduler)
    assert [item.request.request_id for item in batch.requests] == ["r0", "r1"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1
    batch, finished = step(scheduler)  # r0, r1 finish; no seat during scheduling
    assert len(finished) == 2 and shape(batch) == [("r0", 1, True), ("r1", 1, True)]
    assert shape(step(scheduler)[0]) == [("r2", 4, True)]


def test_running_prefill_chunk_continues_before_new_requests():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", num_prompt=12))
    step(scheduler)
    scheduler.add_request(make_request("b", num_prompt=4))
    batch, _ = step(scheduler)
    assert shape(batch) == [("a", 4, True), ("b", 4, True)]
    assert batch.num_decodes == 0


def test_preemption_recomputes_the_latest_arrival(caplog):
    # 4 blocks of 4 tokens: a and b prefill 7 tokens each (2 blocks each); a's 2nd decode needs a
    # 3rd block, so b (the latest arrival) is preempted.
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=16)
    first = make_request("a", num_prompt=7, max_tokens=6, arrival=0.0)
    second = make_request("b", num_prompt=7, max_tokens=6, arrival=1.0, first_token=200)
    scheduler.add_request(first)
    scheduler.add_request(second)
    step(scheduler)
    step(scheduler)
    with caplog.at_level(logging.WARNING, logger="llmc"):
        batch, _ = step(scheduler)
    assert batch.preempted == [second] and shape(batch) == [("a", 1, True)]
    assert second.status is RequestStatus.WAITING and second.block_ids == []
    assert second.num_computed_tokens == 0 and second.output_token_ids == [14, 15]
    assert second.num_preemptions == 1 and scheduler.stats()["num_preemptions"] == 1
    assert list(scheduler.waiting) == [second]
    [record] = caplog.records
    assert "1 preemptions so far" in record.message
    for knob in ("gpu_memory_utilization", "num_kv_blocks", "max_num_seqs",
                 "max_num_batched_tokens", "tensor_parallel_size"):
        assert knob in record.message
    run_to_completion(scheduler)
    assert second.output_token_ids == [14, 15, 16, 17, 18, 19]  # as if never preempted
    assert first.output_token_ids == [14, 15, 16, 17, 18, 19]
    assert_all_free(scheduler)


def test_preempted_request_reprefills_prompt_and_generated_tokens():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=16,
                               enable_prefix_caching=False)
    first = make_request("a", num_prompt=7, max_tokens=6, arrival=0.0)
    second = make_request("b", num_prompt=7, max_tokens=6, arrival=1.0, first_token=200)
    scheduler.add_request(first)
    scheduler.add_request(second)
    for _ in range(3):
        step(scheduler)  # b preempted at step 3 with 9 tokens
    while second.status is RequestStatus.WAITING:
        batch, _ = step(scheduler)
    assert [(request_id, num) for request_id, num, _ in shape(batch)][-1] == ("b", 9)
    assert batch.requests[-1].is_last_chunk


def test_request_preempts_itself_when_it_is_the_lowest_priority():
    # 3 blocks of 4: a holds 1 (3 tokens, room to grow), b holds 2 (8 tokens, full). b's decode
    # needs a 3rd block; b is the latest arrival, so it preempts itself and a keeps running.
    scheduler = make_scheduler(num_blocks=3, max_num_batched_tokens=16)
    first = make_request("a", num_prompt=3, max_tokens=4, arrival=0.0)
    second = make_request("b", num_prompt=8, max_tokens=2, arrival=1.0)
    scheduler.add_request(first)
    scheduler.add_request(second)
    batch, _ = step(scheduler)
    assert shape(batch) == [("a", 3, True), ("b", 8, True)]
    batch, _ = step(scheduler)
    assert batch.preempted == [second] and shape(batch) == [("a", 1, True)]
    assert scheduler.running == [first] and list(scheduler.waiting) == [second]
    run_to_completion(scheduler)
    assert second.output_token_ids == [15, 16] and second.num_preemptions == 1
    assert_all_free(scheduler)


def test_decodes_are_ordered_before_prefills_and_counted():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", num_prompt=4))
    step(scheduler)
    scheduler.add_request(make_request("b", num_prompt=5))
    scheduler.add_request(make_request("c", num_prompt=1))  # a one-token prompt is decode-shaped
    batch, _ = step(scheduler)
    assert shape(batch) == [("a", 1, True), ("c", 1, True), ("b", 5, True)]
    assert batch.num_decodes == 2 and all(item.is_decode for item in batch.requests[:2])


def test_priority_policy_orders_admission_and_victims():
    scheduler = make_scheduler(policy="priority", max_num_seqs=2, num_blocks=4,
                               max_num_batched_tokens=16)
    low = make_request("low", num_prompt=7, max_tokens=6, arrival=0.0, priority=5)
    high = make_request("high", num_prompt=7, max_tokens=6, arrival=1.0, priority=0,
                        first_token=200)
    late = make_request("late", num_prompt=2, max_tokens=1, arrival=2.0, priority=1)
    for request in (low, high, late):
        scheduler.add_request(request)
    assert list(scheduler.waiting) == [high, late, low]
    batch, _ = step(scheduler)
    assert [item.request for item in batch.requests] == [high, late]
    assert scheduler.running == [high]  # late finished (max_tokens=1)
    step(scheduler)  # low is admitted
    assert scheduler.running == [high, low]
    batch, _ = step(scheduler)  # high needs a 3rd block: low is the lowest priority
    assert batch.preempted == [low] and low.status is RequestStatus.WAITING
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_priority_preempted_request_waits_in_priority_order():
    scheduler = make_scheduler(policy="priority", num_blocks=4, max_num_batched_tokens=16)
    first = make_request("a", num_prompt=7, max_tokens=6, arrival=0.0, priority=1)
    second = make_request("b", num_prompt=7, max_tokens=6, arrival=1.0, priority=2)
    scheduler.add_request(first)
    scheduler.add_request(second)
    step(scheduler)
    step(scheduler)
    urgent = make_request("u", num_prompt=14, max_tokens=1, arrival=2.0, priority=0)
    relaxed = make_request("r", num_prompt=2, max_tokens=1, arrival=3.0, priority=9)
    scheduler.add_request(urgent)
    scheduler.add_request(relaxed)
    batch, _ = step(scheduler)
    assert batch.preempted == [second]
    assert list(scheduler.waiting) == [urgent, second, relaxed]


def test_abort_frees_blocks_at_once():
    scheduler = make_scheduler()
    running = make_request("run", num_prompt=9)
    scheduler.add_request(running)
    batch = scheduler.schedule()
    scheduler.add_request(make_request("wait", num_prompt=3))
    assert scheduler.abort_request("run") is running  # between schedule and update
    assert running.status is RequestStatus.FINISHED_ABORTED and running.block_ids == []
    assert scheduler.update(batch, {"run": [1]}) == []  # skipped: already finished
    assert scheduler.abort_request("wait").status is RequestStatus.FINISHED_ABORTED
    assert scheduler.abort_request("wait") is None and scheduler.abort_request("nope") is None
    assert not scheduler.has_unfinished_requests()
    assert_all_free(scheduler)


def test_finish_request_for_engine_detected_stops():
    scheduler = make_scheduler()
    request = make_request("a", num_prompt=5, max_tokens=10)
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert request.status is RequestStatus.FINISHED_STOPPED and request.is_finished
    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)  # already gone: ignored
    with pytest.raises(ValueError, match="FINISHED"):
        scheduler.finish_request("a", RequestStatus.RUNNING)
    assert_all_free(scheduler)


@pytest.mark.parametrize(
    ("num_prompt", "max_tokens", "message"),
    [(60, 5, "exceeds max_model_len"), (0, 5, "empty prompt"), (4, 0, "max_tokens")],
)
def test_requests_that_can_never_run_are_rejected(num_prompt, max_tokens, message):
    scheduler = make_scheduler()
    with pytest.raises(RequestError, match=message):
        scheduler.add_request(make_request("x", num_prompt=num_prompt, max_tokens=max_tokens))
    assert not scheduler.has_unfinished_requests()


def test_rejects_more_blocks_than_the_cache_and_duplicates():
    scheduler = make_scheduler(num_blocks=4)  # 16 token slots
    with pytest.raises(RequestError, match="5 KV blocks"):
        scheduler.add_request(make_request("big", num_prompt=10, max_tokens=8))
    fits = make_request("fits", num_prompt=10, max_tokens=7)  # 16 KV tokens: the last is never fed
    scheduler.add_request(fits)
    with pytest.raises(RequestError, match="unique request id"):
        scheduler.add_request(make_request("fits", num_prompt=2))
    run_to_completion(scheduler)
    assert fits.num_output_tokens == 7
    assert_all_free(scheduler)


def test_prefix_reuse_leaves_the_last_token_to_compute():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", num_prompt=8, max_tokens=1, first_token=100))
    step(scheduler)
    same = make_request("same", num_prompt=8, max_tokens=1, first_token=100)
    longer = make_request("longer", num_prompt=9, max_tokens=1, arrival=1.0, first_token=100)
    scheduler.add_request(same)
    scheduler.add_request(longer)
    batch, _ = step(scheduler)
    # 8 cached tokens would leave nothing to compute: capped at ((8 - 1) // 4) * 4 = 4.
    assert shape(batch) == [("longer", 1, True), ("same", 4, True)]  # decode-shaped first
    assert same.num_cached_tokens == 4 and longer.num_cached_tokens == 8
    stats = scheduler.stats()
    assert stats["prefix_cache_queries"] == 8 + 8 + 9
    assert stats["prefix_cache_hits"] == 4 + 8
    assert_all_free(scheduler)


def test_shared_prefix_blocks_are_ref_counted():
    scheduler = make_scheduler()
    first = make_request("a", num_prompt=9, max_tokens=8, first_token=100)
    scheduler.add_request(first)
    step(scheduler)
    second = make_request("b", num_prompt=9, max_tokens=8, first_token=100)
    scheduler.add_request(second)
    step(scheduler)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    pool = scheduler.block_pool
    assert [pool.blocks[block_id].ref_count for block_id in first.block_ids] == [2, 2, 1]
    scheduler.abort_request("a")
    assert [pool.blocks[block_id].ref_count for block_id in second.block_ids] == [1, 1, 1]
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_generated_tokens_are_cached_too():
    scheduler = make_scheduler()
    first = make_request("a", num_prompt=4, max_tokens=6)
    scheduler.add_request(first)
    run_to_completion(scheduler)  # computed tokens: 4 prompt + 5 generated = 2 full blocks
    follow_up = Request("b", first.all_token_ids[:8] + [1, 2], 1, arrival_time=1.0)
    scheduler.add_request(follow_up)
    batch, _ = step(scheduler)
    assert follow_up.num_cached_tokens == 8 and shape(batch) == [("b", 2, True)]


def test_update_rejects_missing_tokens():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", num_prompt=4, max_tokens=3))
    batch = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled tokens"):
        scheduler.update(batch, {})


def test_several_sampled_tokens_get_kv_next_step_and_stop_at_max_tokens():
    scheduler = make_scheduler()
    request = make_request("a", num_prompt=4, max_tokens=4)
    scheduler.add_request(request)
    assert scheduler.update(scheduler.schedule(), {"a": [1, 2]}) == []
    batch = scheduler.schedule()
    assert shape(batch) == [("a", 2, True)] and batch.num_decodes == 0
    assert scheduler.update(batch, {"a": [3, 4, 5]}) == [request]
    assert request.output_token_ids == [1, 2, 3, 4]  # truncated at max_tokens
    assert_all_free(scheduler)


def test_stats_and_config_validation():
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add_request(make_request("a", num_prompt=8))
    step(scheduler)
    stats = scheduler.stats()
    assert stats["num_total_blocks"] == 8 and stats["num_free_blocks"] == 6
    assert stats["kv_cache_usage"] == pytest.approx(0.25)
    assert stats["num_running"] == 1 and stats["num_waiting"] == 0
    with pytest.raises(ConfigError, match="policy"):
        make_scheduler(policy="lifo")
    with pytest.raises(ConfigError, match="block_size"):
        make_scheduler(block_size=0)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_waiting_for_a_lora_slot_lets_the_ones_behind_it_in(policy):
    """max_loras 1 with adapter 1 running: a request of adapter 2 waits (its adapter would have no slot), the
    base-model and adapter-1 requests behind it are admitted past it (vLLM v1), and it keeps its place: it is
    admitted first once adapter 1's requests have finished."""
    scheduler = make_scheduler(max_loras=1, policy=policy)
    requests = [make_request(name, 4, max_tokens=3, arrival=i) for i, name in enumerate("abcde")]
    for request, lora in zip(requests, [1, 2, None, 1, 2]):
        request.lora_int_id = lora
        scheduler.add_request(request)
    batch, _ = step(scheduler)
    assert [item.request.request_id for item in batch.requests] == ["a", "c", "d"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "e"]
    admitted = []
    while scheduler.has_unfinished_requests():
        waiting = [r.request_id for r in scheduler.waiting]
        step(scheduler)
        running_loras = {r.lora_int_id for r in scheduler.running if r.lora_int_id is not None}
        assert len(running_loras) <= 1
        still = {r.request_id for r in scheduler.waiting}
        admitted += [request_id for request_id in waiting if request_id not in still]
    assert admitted == ["b", "e"]


@pytest.mark.parametrize("threshold,expected", [
    (0, [[("long", 48, False)], [("long", 12, True), ("short", 10, True)]]),
    # vLLM's long_prefill_token_threshold 16: the long prompt takes 16 tokens a step, the short one goes at once
    (16, [[("long", 16, False)], [("long", 16, False), ("short", 10, True)], [("long", 16, False), ("short", 1, True)],
          [("long", 12, True), ("short", 1, True)]]),
])
def test_long_prefill_token_threshold_caps_each_chunk(threshold, expected):
    scheduler = make_scheduler(max_num_batched_tokens=48, max_model_len=128, num_blocks=64,
                               long_prefill_token_threshold=threshold)
    scheduler.add_request(make_request("long", 60, max_tokens=3))
    got = [shape(step(scheduler)[0])]
    scheduler.add_request(make_request("short", 10, max_tokens=3))
    got += [sorted(shape(step(scheduler)[0])) for _ in range(len(expected) - 1)]
    assert got == expected
    run_to_completion(scheduler)
    assert_all_free(scheduler)
