"""Issue 39, the grammar sandbox (``inference.api.structured_sandbox``): client grammars, regexes and schemas are compiled
in worker processes, each under a CPU-time budget, a few per tenant at once, results cached per cache scope; the
event loop that asks never stalls, however bad the input. Real worker processes, real llguidance."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from inference.shared.structured import spec_key
from inference.api.structured_sandbox import GrammarSandbox

# GBNF whose rules each wait on the next (the library converter's fixpoint marks one per pass: quadratic), within
# every cap (512 rules, under 64 KiB): ~0.5 s of CPU, so over a 0.05 s budget
CHAIN = "\n".join(["root ::= r0", *(f'r{i} ::= "a" "a" "a" "a" "a" "a" "a" "a" "a" "a" r{i + 1}' for i in range(500)),
                   'r500 ::= "b"'])
SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.fixture
def box():
    sandbox = GrammarSandbox(processes=2, budget_s=0.05, per_tenant=1)
    yield sandbox
    sandbox.close()


def compile_(box: GrammarSandbox, kind: str, spec: str, scope: str = "tenant:1", tenant: str = "1"):
    return box.compile(kind, spec, key=spec_key(kind, spec, scope), tenant=tenant)


async def loop_lag_during(coro, period_s: float = 0.005) -> tuple[object, float]:
    """Run ``coro`` while a ticker measures how late the loop wakes it; returns (result, worst lateness in s)."""
    worst = 0.0
    stop = False

    async def tick() -> None:
        nonlocal worst
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(period_s)
            worst = max(worst, time.perf_counter() - t - period_s)

    ticker = asyncio.create_task(tick())
    try:
        return await coro, worst
    finally:
        stop = True
        await ticker


async def test_a_compile_past_its_budget_is_ended_and_refused_and_the_loop_never_stalls(box):
    result, lag = await loop_lag_during(compile_(box, "grammar", CHAIN))
    assert result.outcome == "budget" and result.error is not None and "budget" in result.error
    assert lag < 0.05  # the work ran in another process: this loop kept turning (a thread stalled it ~0.5 s)
    # the worker that burnt the budget was ended (SIGPROF) and replaced: the next compile works
    ok = await compile_(box, "json", SCHEMA)
    assert ok.outcome == "ok" and ok.engine_form == SCHEMA
    deadline = time.monotonic() + 30  # pebble spawns the replacement in the background (seconds on a loaded box)
    while len(box.worker_pids()) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert len(box.worker_pids()) == 2


async def test_results_are_cached_per_cache_scope_only(box):
    first = await compile_(box, "regex", "[0-9]{3}", scope="tenant:1")
    again = await compile_(box, "regex", "[0-9]{3}", scope="tenant:1")
    other = await compile_(box, "regex", "[0-9]{3}", scope="tenant:2", tenant="2")
    assert (first.cached, again.cached, other.cached) == (False, True, False)  # no cross-tenant timing signal
    bad = [await compile_(box, "regex", "[a-") for _ in range(2)]
    assert [b.cached for b in bad] == [False, True] and all(b.outcome == "invalid" for b in bad)


async def test_one_tenant_runs_one_compile_at_a_time_and_others_pass_it(box):
    slow = [asyncio.create_task(compile_(box, "grammar", CHAIN + f"\n# {i}", tenant="A")) for i in range(3)]
    await asyncio.sleep(0.05)
    other = await compile_(box, "json", SCHEMA, scope="tenant:B", tenant="B")
    assert other.outcome == "ok"
    assert sum(t.done() for t in slow) <= 1  # A's compiles queue behind each other, B's did not wait for them
    assert [r.outcome for r in await asyncio.gather(*slow)] == ["budget"] * 3


async def test_a_cancelled_caller_keeps_its_tenant_slot_until_the_compile_ends(box):
    first = asyncio.create_task(compile_(box, "grammar", CHAIN, tenant="A"))
    await asyncio.sleep(0.02)
    first.cancel()
    t0 = time.monotonic()
    second = await compile_(box, "json", SCHEMA, scope="tenant:A", tenant="A")
    assert second.outcome == "ok" and time.monotonic() - t0 >= 0.02  # waited for the cancelled one's compile
    assert box.cached(spec_key("grammar", CHAIN, "tenant:1")) is not None  # its result was kept


def test_workers_die_with_the_api_process(tmp_path):
    """A killed api process leaves no sandbox worker behind (the parent-death signal)."""
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent("""
        import asyncio, sys, time
        from inference.api.structured_sandbox import GrammarSandbox

        async def main():
            box = GrammarSandbox(processes=2)
            await box.compile("regex", "a+", key="k", tenant="t")
            print(*box.worker_pids(), flush=True)
            time.sleep(60)

        if __name__ == "__main__":
            asyncio.run(main())
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            assert time.monotonic() < deadline, "sandbox workers outlived their api process"
            time.sleep(0.1)
    finally:
        proc.kill()


async def test_tenants_whose_compiles_hit_the_budget_share_one_worker_and_leave_the_other(box):
    """Two tenants flooding costly schemas (the fresh-eyes review: a third tenant's trivial schema then waited 1.3 s
    at the median behind them): once a tenant's compile was ended for its budget, all such tenants together hold at
    most ``processes - 1`` workers, so a third tenant's compile always finds one."""
    first = await asyncio.gather(compile_(box, "grammar", CHAIN + "\n# a0", tenant="A"),
                                 compile_(box, "grammar", CHAIN + "\n# b0", tenant="B"))
    assert [r.outcome for r in first] == ["budget", "budget"] and box.suspect("A") and box.suspect("B")
    flood = [asyncio.create_task(compile_(box, "grammar", CHAIN + f"\n# {t}{i}", tenant=t))
             for t in "AB" for i in range(1, 3)]
    await asyncio.sleep(0.02)
    assert box._suspect_slots.locked()  # one suspect compile runs; the other three wait for the suspects' worker
    other = await compile_(box, "json", SCHEMA, scope="tenant:C", tenant="C")
    assert other.outcome == "ok" and not all(t.done() for t in flood)
    assert [r.outcome for r in await asyncio.gather(*flood)] == ["budget"] * 4
    assert not box.suspect("C")
