"""The async client (``orchestrator.aio_client``) against an in-process stack: same answers as
the blocking client, cancellation frees slots, reload and push_weights, errors as SpecsplitError."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from orchestrator.aio_client import AsyncSpecsplitClient
from orchestrator.client import ReloadFailed, SpecsplitClient, SpecsplitError
from runtime.checkpoint import index_checkpoint, load_tensors
from tests.integration.inproc_stack import ADMIN, GEN, TIMEOUT, make_models, start_stack, wait_until
from tests.ports import free_port

pytestmark = pytest.mark.integration

PROMPT = [256, 104, 105, 32, 116, 104, 101, 114, 101]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("aio_models"))


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    s = start_stack(models, tmp_path_factory.mktemp("aio_staging"))
    yield s
    s.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120.0))


def test_generate_and_generate_text_equal_the_blocking_client(stack):
    with SpecsplitClient(stack.address, timeout=TIMEOUT, token=GEN) as sync:
        want = sync.generate_text(PROMPT, 24, ignore_eos=True, k=3)

    async def main():
        async with AsyncSpecsplitClient(stack.address, timeout=TIMEOUT, token=GEN) as c:
            res = await c.generate_text(PROMPT, 24, ignore_eos=True, k=3)
            events = [ev async for ev in c.generate(PROMPT, 24, ignore_eos=True, k=3)]
            return res, events

    res, events = run(main())
    assert (res.tokens, res.text, res.finish_reason) == (want.tokens, want.text, "length")
    assert res.usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 24} and res.chunks == want.chunks
    assert events[-1].final and not any(ev.final for ev in events[:-1])
    assert tuple(t for ev in events[:-1] for t in ev.tokens) == want.tokens == events[-1].tokens
    assert events[-1].drafted > 0 and events[-1].rounds == len(events) - 2   # chunks: prefill, rounds


def test_wait_ready_connects_or_says_unavailable(stack):
    closed = free_port()                             # nothing listens there

    async def main():
        async with AsyncSpecsplitClient(stack.address, timeout=TIMEOUT) as c:
            assert await c.wait_ready() is c
        async with AsyncSpecsplitClient(f"127.0.0.1:{closed}", timeout=TIMEOUT) as c:
            try:
                await c.wait_ready(0.5)
            except SpecsplitError as exc:
                return exc.code
        return None

    assert run(main()) == grpc.StatusCode.UNAVAILABLE


def test_leaving_the_stream_early_cancels_and_frees_the_slots(stack):
    async def main():
        async with AsyncSpecsplitClient(stack.address, timeout=TIMEOUT, token=GEN) as c:
            stream = c.generate(PROMPT, 200, ignore_eos=True)
            first = await anext(stream)
            await stream.aclose()
            return first

    assert not run(main()).final
    with SpecsplitClient(stack.address, timeout=TIMEOUT) as sync:
        wait_until(lambda: sync.status()["target"]["used_slots"] == 0 and sync.status()["draft"]["used_slots"] == 0,
                   "the cancelled request's slots to be released")


def test_status_and_health(stack):
    async def main():
        async with AsyncSpecsplitClient(stack.address, timeout=TIMEOUT) as c:
            return await c.status(), await c.health()

    status, health = run(main())
    with SpecsplitClient(stack.address, timeout=TIMEOUT) as sync:
        want = sync.status()
    assert set(status) == set(want) and status["target"]["weights_version"] == want["target"]["weights_version"]
    assert health == "SERVING"


def test_errors_are_specsplit_errors_and_tokens_are_checked(stack):
    async def main():
        async with AsyncSpecsplitClient(stack.address, timeout=TIMEOUT, token="wrong") as c:
            with pytest.raises(SpecsplitError) as gen_err:
                await c.generate_text(PROMPT, 4)
            with pytest.raises(ReloadFailed) as reload_err:
                await c.with_token(GEN).reload("/nonexistent", "x")
            with pytest.raises(SpecsplitError) as bad_arg:
                await c.with_token(GEN).generate_text(PROMPT, 0)
            view = c.with_token(GEN)
            await view.close()                               # a view leaves the shared channel open
            ok = await c.with_token(GEN).generate_text(PROMPT, 2)
            return gen_err.value, reload_err.value, bad_arg.value, ok

    gen_err, reload_err, bad_arg, ok = run(main())
    assert gen_err.code == grpc.StatusCode.UNAUTHENTICATED
    assert reload_err.code == grpc.StatusCode.PERMISSION_DENIED and reload_err.events == ()
    assert bad_arg.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in bad_arg.details
    assert len(ok.tokens) == 2


def test_reload_and_push_weights(stack, models):
    tensors = {**load_tensors(index_checkpoint(models["A"])),
               **load_tensors(index_checkpoint(models["A"] / "mtp.safetensors"))}
    config = json.loads((models["A"] / "config.json").read_text())

    async def main():
        async with AsyncSpecsplitClient(stack.address, timeout=TIMEOUT, token=ADMIN) as c:
            before = await c.generate_text(PROMPT, 16, ignore_eos=True)
            events = await c.reload(str(models["B"]), "B", mode="in_place")
            after_b = await c.generate_text(PROMPT, 16, ignore_eos=True)
            pushed = await c.push_weights(tensors, config, "A-pushed", chunk_bytes=8192)
            after_a = await c.generate_text(PROMPT, 16, ignore_eos=True)
            status = await c.status()
            return before, events, after_b, pushed, after_a, status

    before, events, after_b, pushed, after_a, status = run(main())
    assert events[-1].done and events[-1].weights_version == "B" and {"validate", "load"} <= {e.phase for e in events}
    assert after_b.weights_version == "B" and after_b.tokens != before.tokens
    assert pushed.weights_version == "A-pushed" and pushed.num_tensors == len(tensors) and pushed.events[-1].done
    assert after_a.tokens == before.tokens and after_a.weights_version == "A-pushed"
    assert status["target"]["weights_version"] == status["draft"]["weights_version"] == "A-pushed"
