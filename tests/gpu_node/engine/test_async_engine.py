import asyncio

import pytest

from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.errors import InvalidRequestError, RequestCancelledError
from scheduler.sequence import SamplingParams


@pytest.fixture
def async_engine(make_engine):
    engine = AsyncEngine(make_engine())
    engine.start()
    yield engine
    engine.shutdown()


async def collect(engine, rid, ids, params):
    outs = [out async for out in engine.generate(rid, ids, params)]
    return outs


async def test_concurrent_streams_match_the_sync_engine(async_engine, make_engine, chat_ids):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = {str(i): chat_ids(p) for i, p in enumerate(["Hi", "Name a fruit.", "What is 2 + 2?"])}
    expected = make_engine().generate(prompts, params)
    results = await asyncio.gather(
        *(collect(async_engine, rid, ids, params) for rid, ids in prompts.items())
    )
    for rid, outs in zip(prompts, results, strict=True):
        assert [t for o in outs for t in o.token_ids] == expected[rid]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert outs[-1].num_completion_tokens == 10


async def test_closing_the_stream_aborts_and_frees_pages(async_engine, chat_ids):
    stream = async_engine.generate(
        "long", chat_ids("Tell me a long story."), SamplingParams(max_tokens=200)
    )
    seen = 0
    async for out in stream:
        seen += len(out.token_ids)
        if seen >= 3:
            break
    await stream.aclose()
    for _ in range(100):
        stats = async_engine.stats()
        if stats.num_running == 0 and stats.num_free_pages == stats.num_pages:
            break
        await asyncio.sleep(0.05)
    assert stats.num_free_pages == stats.num_pages and stats.num_running == 0


async def test_invalid_request_raises_before_output(async_engine):
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        await collect(async_engine, "bad", [], SamplingParams())
    outs = await collect(
        async_engine, "ok", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)
    )
    assert outs[-1].num_completion_tokens == 2


async def test_a_request_that_breaks_while_being_added_fails_alone(
    async_engine, chat_ids, monkeypatch
) -> None:
    from gpu_node.errors import EngineError

    engine = async_engine.engine
    real_add = engine.add_request

    def add_request(request_id, *args, **kwargs):
        if request_id == "broken":
            raise RuntimeError("a bug while queueing")
        return real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_request)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    with pytest.raises(EngineError, match="could not add the request: a bug while queueing"):
        await collect(async_engine, "broken", chat_ids("Hi"), params)
    outs = await collect(async_engine, "fine", chat_ids("Hi"), params)  # the thread lives on
    assert outs[-1].finished and outs[-1].num_completion_tokens == 3


async def test_a_cancel_before_its_request_refuses_it_and_nothing_runs(async_engine):
    async_engine.abort("early")
    before = async_engine.stats().num_computed_tokens
    with pytest.raises(RequestCancelledError, match="request early was cancelled"):
        await collect(async_engine, "early", [1, 2, 3], SamplingParams(max_tokens=2))
    outs = await collect(
        async_engine, "later", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)
    )
    assert outs[-1].num_completion_tokens == 2
    for _ in range(100):  # the snapshot is taken just after the outputs go out
        if async_engine.stats().num_running == 0:
            break
        await asyncio.sleep(0.02)
    # Only "later" ran: its 3 prompt tokens, then one decode step for its second token.
    assert async_engine.stats().num_computed_tokens - before == 4
