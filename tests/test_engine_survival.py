"""A request can never kill the engine: whatever one request makes the engine
thread raise ends that request only (with the traceback logged); the others
go on and the next request succeeds. Only a failure of the model call itself
stops the engine, and that is logged with its cause."""

import asyncio
import logging

import pytest

from engine_utils import ToyTokenizer, collect, greedy, tiny_model
from mlxfast.engine import engine as engine_mod
from mlxfast.engine import sampler as sampler_mod
from mlxfast.engine.api import FinishEvent, Request, SamplingParams, TokenEvent
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine, RequestStream


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture
def eng(model):
    e = Engine(model, ToyTokenizer(), EngineConfig(num_blocks=128, block_size=8)).start()
    yield e
    e.shutdown()


def run_all(eng, requests):
    async def main():
        return await asyncio.gather(*(collect(eng, r) for r in requests))
    return asyncio.run(main())


def good(n=5):
    return Request([1, 2, 3, 4], greedy(n, ignore_eos=True))


def assert_survived(eng, results, bad_index, caplog, needle):
    for i, (toks, _, fin) in enumerate(results):
        if i == bad_index:
            assert fin.finish_reason == "error" and needle in fin.error
        else:
            assert fin.finish_reason == "length" and len(toks) == 5
    assert eng.alive and eng.error is None
    (toks, _, fin), = run_all(eng, [good()])  # the next request succeeds
    assert fin.finish_reason == "length" and len(toks) == 5
    assert any(needle in (r.exc_text or "") or needle in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=4, temperature=0.7, top_k=2 ** 63),  # overflowed the C int of the native sampler
    SamplingParams(max_tokens=4, temperature=0.7, top_k=-5),
    SamplingParams(max_tokens=4, temperature=float("nan")),
])
def test_out_of_range_sampling_params_end_only_their_request(eng, params, caplog):
    caplog.set_level(logging.ERROR, "mlxfast.engine")
    results = run_all(eng, [good(), Request([5, 6, 7], params), good()])
    assert_survived(eng, results, 1, caplog, "must be")


def test_unencodable_cache_salt_ends_only_its_request(eng, caplog):
    caplog.set_level(logging.ERROR, "mlxfast.engine")
    bad = Request([5, 6, 7], greedy(4), cache_salt="\ud800")
    results = run_all(eng, [good(), bad, good()])
    assert_survived(eng, results, 1, caplog, "UnicodeEncodeError")


def test_a_row_that_breaks_the_batched_sampler_ends_only_its_request(eng, monkeypatch, caplog):
    """The test hook: the sampler raises whenever the marked request's row is
    in the batch, as a bug tied to one request's parameters would."""
    caplog.set_level(logging.ERROR, "mlxfast.engine")
    real = sampler_mod.sample_async

    def faulty(logits, states, ahead=None):
        if any(s.params.seed == 666 for s in states):
            raise RuntimeError("injected sampler fault")
        return real(logits, states, ahead)

    # every draw of a step with a sampled row goes through sample_async:
    # sample() (the row-by-row retry, steps with drafts) and the pipelined
    # decode step, which calls it directly (a step of greedy rows only has
    # its head choose their tokens: no sampler)
    monkeypatch.setattr(sampler_mod, "sample_async", faulty)
    monkeypatch.setattr(engine_mod, "sample_async", faulty)
    bad = Request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.7, seed=666, ignore_eos=True))
    results = run_all(eng, [good(), bad, good()])
    assert_survived(eng, results, 1, caplog, "injected sampler fault")
    assert eng.allocator.num_free == eng.allocator.num_blocks  # the failed request freed its blocks


def test_output_processing_fault_ends_only_its_request(eng, monkeypatch, caplog):
    caplog.set_level(logging.ERROR, "mlxfast.engine")
    real = engine_mod.OutputProcessor

    class Faulty(real):
        def add(self, token):
            if self.stop == ["poison"]:
                raise KeyError("injected detokenizer fault")
            return super().add(token)

    monkeypatch.setattr(engine_mod, "OutputProcessor", Faulty)
    bad = Request([5, 6, 7], greedy(4, stop=["poison"], ignore_eos=True))
    results = run_all(eng, [good(), bad, good()])
    assert_survived(eng, results, 1, caplog, "injected detokenizer fault")


def test_model_failure_stops_the_engine_and_logs_its_cause(model, caplog):
    caplog.set_level(logging.ERROR, "mlxfast.engine")
    e = Engine(model, ToyTokenizer(), EngineConfig(num_blocks=64, block_size=8)).start()
    try:
        def boom(plan, **kw):
            raise RuntimeError("kernel exploded")
        e.runner.run = boom
        (_, _, fin), = run_all(e, [good()])
        assert fin.finish_reason == "error" and "kernel exploded" in fin.error
        assert not e.alive
        logged = [r for r in caplog.records if "the engine stopped" in r.getMessage()]
        assert logged and "kernel exploded" in logged[0].getMessage()
        assert "Traceback" in logged[0].getMessage()
    finally:
        e.shutdown()


# ---------------------------------------------------------------- stalled readers


class _Aborts:
    def __init__(self):
        self.aborted = []

    def abort(self, rid):
        self.aborted.append(rid)


def test_a_reader_that_stops_reading_is_cut_off_after_its_stall_timeout():
    async def main():
        eng = _Aborts()
        loop = asyncio.get_running_loop()
        s = RequestStream(eng, "r1", loop, stall_timeout_s=0.2, max_unread=10_000)
        s._put_all([TokenEvent(1, "a")])
        assert (await s.__anext__()).token_id == 1  # read: not stalled
        s._put_all([TokenEvent(2, "b")])
        await asyncio.sleep(0.3)  # the reader is away longer than the timeout
        s._put_all([TokenEvent(3, "c")])
        assert eng.aborted == ["r1"]
        s._put_all([TokenEvent(4, "d"), FinishEvent("abort")])  # what the engine sends after: dropped
        return [ev async for ev in s]
    events = asyncio.run(main())
    assert len(events) == 1 and events[0].finish_reason == "abort"
    assert "stopped reading" in events[0].error


def test_unread_events_are_bounded():
    async def main():
        eng = _Aborts()
        s = RequestStream(eng, "r2", asyncio.get_running_loop(), stall_timeout_s=3600, max_unread=50)
        for i in range(200):
            s._put_all([TokenEvent(i, "x")])
        assert eng.aborted == ["r2"]
        return [ev async for ev in s]
    events = asyncio.run(main())
    assert [type(e) for e in events] == [FinishEvent]


def test_a_reader_waiting_on_a_slow_engine_is_not_stalled():
    """Silence from the engine (a long prefill) is not the client's fault:
    only events left unread count."""
    async def main():
        eng = _Aborts()
        s = RequestStream(eng, "r3", asyncio.get_running_loop(), stall_timeout_s=0.1, max_unread=10)
        reader = asyncio.ensure_future(s.__anext__())
        await asyncio.sleep(0.3)
        s._put_all([TokenEvent(7, "z")])
        assert (await reader).token_id == 7
        s._put_all([FinishEvent("length")])
        rest = [ev async for ev in s]
        return eng.aborted, rest
    aborted, rest = asyncio.run(main())
    assert aborted == [] and rest[0].finish_reason == "length"
