"""The grammar compiler: each distinct constraint compiled once, on its worker threads (never the caller's),
however many ask at once; an asker that gives up drops only its own interest; a compile over its time budget
is refused at the deadline while its worker is replaced; the cache is bounded in bytes.

The mechanics run with a fake compile function (deterministic, instant); the llguidance cases (deep chains
that overflow a default thread stack, huge choice lists, the memory measure) with the real manager."""
from __future__ import annotations

import concurrent.futures
import ctypes
import gc
import os
import threading
import time
from types import SimpleNamespace

import pytest

from jaxserve.engine.structured_output import GrammarCompiler, StructuredOutputManager, StructuredOutputsLimits
from jaxserve.engine.structured_output.compiler import WORKER_PREFIX, worker_stack_bytes
from jaxserve.engine.structured_output.grammar import describe_compile_error, grammar_bytes
from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import StructuredOutputsParams


def regex(i) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"[a-z]{{{i}}}")


class FakeCompile:
    """A compile function that records its calls and blocks while ``gate`` is clear."""

    def __init__(self, nbytes: int = 100, gate: bool = True):
        self.nbytes, self.calls, self.threads = nbytes, [], []
        self.gate = threading.Event()
        if gate:
            self.gate.set()

    def __call__(self, params):
        self.calls.append(params.spec)
        self.threads.append(threading.current_thread().name)
        self.gate.wait(30)
        if "fail" in params.spec:
            raise InvalidRequestError(f"bad: {params.spec}", param="regex")
        return SimpleNamespace(nbytes=self.nbytes, spec=params.spec)


@pytest.fixture
def make():
    made = []

    def build(fake=None, workers=2, **limits):
        fake = fake or FakeCompile()
        compiler = GrammarCompiler(fake, StructuredOutputsLimits(**limits), workers=workers)
        made.append(compiler)
        return compiler, fake
    yield build
    for c in made:
        c.close()


# ---------------------------------------------------------------------------------------------- mechanics
def test_concurrent_askers_share_one_compile(make):
    compiler, fake = make(FakeCompile(gate=False))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = list(pool.map(lambda i: compiler.submit(regex(i % 3)), range(48)))
    time.sleep(0.05)
    fake.gate.set()
    results = [f.result(5) for f in futures]
    assert len(fake.calls) == 3 == compiler.stats()["compilations"]
    assert len({id(r) for r in results}) == 3
    assert all(name.startswith(WORKER_PREFIX) for name in fake.threads)
    assert compiler.compile(regex(1)) is results[1] and compiler.stats()["cache_hits"] >= 1


def test_a_failure_is_cached_and_each_asker_gets_its_own_exception(make):
    compiler, fake = make()
    bad = StructuredOutputsParams(regex="fail")
    errors = []
    for _ in range(3):
        with pytest.raises(InvalidRequestError, match="bad: fail") as e:
            compiler.compile(bad)
        errors.append(e.value)
    assert len(fake.calls) == 1 and len({id(e) for e in errors}) == 3
    assert compiler.ready(bad)
    with pytest.raises(InvalidRequestError):
        compiler.get(bad)
    assert compiler.get(regex(9)) is None and not compiler.ready(regex(9))


def test_a_cancelled_asker_drops_a_queued_compile_but_not_anothers(make):
    compiler, fake = make(FakeCompile(gate=False), workers=1)
    running = compiler.submit(regex(1))                      # holds the only worker
    while not fake.calls:
        time.sleep(0.001)
    lonely = compiler.submit(regex(2))
    shared_a, shared_b = compiler.submit(regex(3)), compiler.submit(regex(3))
    assert lonely.cancel() and shared_a.cancel()
    fake.gate.set()
    assert shared_b.result(5).spec == regex(3).spec
    running.result(5)
    assert fake.calls == [regex(1).spec, regex(3).spec]
    assert compiler.stats()["cancelled"] == 1


def test_an_over_budget_compile_is_refused_at_the_deadline_and_its_worker_replaced(make):
    compiler, fake = make(FakeCompile(gate=False), workers=1, compile_timeout_s=1.0)
    slow = StructuredOutputsParams(regex="slow")
    t = time.perf_counter()
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(slow)
    assert 0.9 < time.perf_counter() - t < 5.0
    assert "compile_timeout_s=1.0" in e.value.message and "--structured-outputs-config" in e.value.message
    assert e.value.param == "regex"
    with pytest.raises(InvalidRequestError, match="compile_timeout_s"):       # cached: no second compile
        compiler.compile(slow)
    fake.gate.set()     # (the replacement worker runs the next one at once; the abandoned one finishes too)
    assert compiler.compile(regex(5)).spec == regex(5).spec
    deadline = time.monotonic() + 10
    while compiler._abandoned and time.monotonic() < deadline:      # (get raises the refusal meanwhile)
        time.sleep(0.01)
    assert compiler.get(slow).spec == "slow"                # the finished compile replaced the refusal
    stats = compiler.stats()
    assert stats["timeouts"] == 1 and stats["compilations"] == 2 and fake.calls.count("slow") == 1
    assert len(compiler._threads) == 1 and compiler._abandoned == 0


def test_the_cache_is_bounded_in_bytes_least_recently_used_first(make):
    key_bytes = len(regex(10).spec)
    compiler, fake = make(FakeCompile(nbytes=1000), grammar_cache_bytes=3 * (1000 + key_bytes) + 10)
    for i in range(10, 13):
        compiler.compile(regex(i))
    compiler.compile(regex(10))                              # touched: the most recent
    compiler.compile(regex(13))                              # evicts 11
    assert compiler.ready(regex(10)) and not compiler.ready(regex(11)) and compiler.ready(regex(13))
    stats = compiler.stats()
    assert stats["cache_entries"] == 3 and stats["evictions"] == 1
    assert stats["cache_bytes"] <= 3 * (1000 + key_bytes) + 10
    huge, _ = make(FakeCompile(nbytes=10_000), grammar_cache_bytes=5000)
    assert huge.compile(regex(1)).nbytes == 10_000 and not huge.ready(regex(1))   # served, not kept


def test_the_size_checks_refuse_before_the_queue(make):
    small, fake2 = make(max_choice_options=10)
    future = small.submit(StructuredOutputsParams(choice=[str(i) for i in range(11)]))
    assert future.done()
    with pytest.raises(InvalidRequestError, match="max_choice_options"):
        future.result()
    assert not fake2.calls


def test_a_schema_too_deep_to_encode_is_refused_by_its_future(make):
    compiler, fake = make()
    schema: dict = {}
    for _ in range(5000):
        schema = {"a": schema}
    with pytest.raises(InvalidRequestError, match="max_json_schema_depth"):
        compiler.submit(StructuredOutputsParams(json=schema)).result(5)
    assert not fake.calls


class RandomCompile:
    """Sleeps a random while (some compiles past the budget), fails some keys."""

    def __init__(self, seed: int):
        import random
        self.rng, self.lock, self.calls = random.Random(seed), threading.Lock(), 0

    def __call__(self, params):
        with self.lock:
            self.calls += 1
            pause = self.rng.choice([0.0, 0.001, 0.01, 0.08])
        time.sleep(pause)
        if params.spec.endswith("7}"):
            raise InvalidRequestError("seven", param="regex")
        return SimpleNamespace(nbytes=500)


def test_random_askers_cancels_and_timeouts_leave_nothing_behind(make):
    import random
    compiler, fake = make(RandomCompile(0), workers=2, compile_timeout_s=0.05, grammar_cache_bytes=4000)
    rng = random.Random(1)
    futures = []

    def ask(i):
        f = compiler.submit(regex(rng.randrange(40)))
        if rng.random() < 0.3:
            f.cancel()
        return f

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = list(pool.map(ask, range(400)))
    for f in futures:
        if not f.cancelled():
            try:
                f.result(10)
            except InvalidRequestError as e:
                assert "seven" in e.message or "compile_timeout_s" in e.message
    deadline = time.monotonic() + 10
    while (compiler._running or compiler._abandoned) and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = compiler.stats()
    assert not compiler._jobs and not compiler._queue and not compiler._running and compiler._abandoned == 0
    assert len(compiler._threads) == 2 and stats["cache_bytes"] <= 4000
    assert stats["compilations"] == fake.calls <= 400


def test_a_compiler_that_keeps_verdicts_only():
    compiler = GrammarCompiler(FakeCompile(nbytes=1 << 30), StructuredOutputsLimits(), retain=False)
    try:
        assert compiler.compile(regex(1)) is None and compiler.ready(regex(1))
        assert compiler.stats()["cache_bytes"] < 4096
    finally:
        compiler.close()


def test_a_stack_the_system_will_not_map_is_halved_until_it_does(make, caplog):
    compiler, fake = make()
    compiler.stack_bytes = 1 << 46                  # past what any machine maps for a thread
    with caplog.at_level("WARNING", logger="jaxserve.engine.structured_output.compiler"):
        assert compiler.compile(regex(1)).spec == regex(1).spec
    if compiler.stack_bytes < 1 << 46:              # (a system that overcommits everything mapped it)
        assert compiler.stack_bytes >= 32 << 20 and "grammar worker" in caplog.text
    assert threading.stack_size() == 0              # the process-wide setting is restored


def test_the_worker_stack_grows_with_the_limits():
    default = worker_stack_bytes(StructuredOutputsLimits())
    assert default >= 256 << 20
    assert worker_stack_bytes(StructuredOutputsLimits(max_grammar_rules=100_000)) > default


# ---------------------------------------------------------------------------------------------- llguidance
@pytest.fixture(scope="module")
def tok():
    from jaxserve.models.tokenizers import embedded_tokenizer
    return embedded_tokenizer()


@pytest.fixture(scope="module")
def manager(tok):
    m = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,))
    m.compile(StructuredOutputsParams(choice=["warm"]))    # builds the llguidance tokenizer
    yield m
    m.compiler.close()


def chain_grammar(n: int) -> str:
    return "\n".join(["start: r0", *(f'r{i}: "a" r{i + 1}' for i in range(n)), f'r{n}: "b"'])


def defs_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def accepts(manager, params, text: str, tok) -> bool:
    m = manager.compile(params).deep_copy()
    return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()


def test_compiles_run_once_per_constraint_and_never_on_the_callers_thread(manager):
    before = manager.compiler.stats()
    specs = [StructuredOutputsParams(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
             for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: manager.compile(specs[i % 4]), range(32)))
    after = manager.compiler.stats()
    assert after["compilations"] - before["compilations"] == 4
    assert sum(after["compile_threads"].values()) == after["compilations"]
    assert all(name.startswith(WORKER_PREFIX) for name in after["compile_threads"])


def test_a_3000_rule_chain_compiles_on_a_worker(manager, tok):
    """A chain this deep overflows a default 8 MB thread stack inside llguidance (a segmentation fault)."""
    params = StructuredOutputsParams(grammar=chain_grammar(3000))
    t = time.perf_counter()
    manager.compile(params)
    assert time.perf_counter() - t < 10
    assert accepts(manager, params, "a" * 3000 + "b", tok)


def test_a_2000_deep_defs_chain_is_refused_and_compiles_on_a_worker_when_allowed(tok):
    params = StructuredOutputsParams(json=defs_chain(2000))
    deep = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,),
                                   limits=StructuredOutputsLimits(max_json_schema_depth=8000,
                                                                  compile_timeout_s=60.0))   # a loaded 2-core CI
    default = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,))
    try:
        with pytest.raises(InvalidRequestError, match="max_json_schema_depth"):
            default.compile(params)
        assert default.compiler.stats()["compilations"] == 1      # refused by the pre-check, in the worker
        t = time.perf_counter()
        deep.compile(params)
        assert time.perf_counter() - t < 60
        assert accepts(deep, params, '{"n":' * 3 + "1" + "}" * 3, tok) is False     # an incomplete chain
    finally:
        deep.compiler.close()
        default.compiler.close()


def test_a_100000_option_choice_is_refused_fast_without_a_panic(manager):
    params = StructuredOutputsParams(choice=[f"option number {i}" for i in range(100_000)])
    before = manager.compiler.stats()["compilations"]
    t = time.perf_counter()
    with pytest.raises(InvalidRequestError) as e:
        manager.compile(params)
    assert time.perf_counter() - t < 1.0
    assert "max_choice_options" in e.value.message and "panic" not in e.value.message
    assert manager.compiler.stats()["compilations"] == before


def test_a_choice_matches_exactly_its_options_and_compiles_as_one_terminal(manager, tok):
    params = StructuredOutputsParams(choice=["a", "ab", "b c", 'q"uote', "ünï"])
    for option in params.choice:
        assert accepts(manager, params, option, tok), option
    for other in ("abc", "b", "", "a b"):
        assert not accepts(manager, params, other, tok), other
    big = StructuredOutputsParams(choice=[f"option number {i}" for i in range(10_000)])
    t = time.perf_counter()
    manager.compile(big)
    assert time.perf_counter() - t < 5
    assert accepts(manager, big, "option number 9999", tok)      # past llguidance's 2,000 items in a row


def test_a_schema_with_no_finite_instance_is_refused(manager):
    with pytest.raises(InvalidRequestError, match="no finite instance"):
        manager.compile(StructuredOutputsParams(json={"$ref": "#"}))


def test_a_panic_reads_as_a_size_problem_without_its_backtrace():
    msg = describe_compile_error("grammar", "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10"
                                            "\n<backtrace>\n   0: <unknown>\n   1: <unknown>")
    assert msg.startswith("the grammar is too large for the grammar compiler") and "backtrace" not in msg


def _heap_in_use() -> int:
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.parametrize("kind,make_params", [
    ("choice", lambda k: StructuredOutputsParams(choice=[f"option {k} number {i}" for i in range(3000)])),
    ("enum", lambda k: StructuredOutputsParams(json={"enum": [f"value {k} {i}" for i in range(3000)]})),
    ("optional", lambda k: StructuredOutputsParams(json={"type": "object", "properties": {
        f"p{k}_{i}": {"type": "string"} for i in range(400)}})),
    ("required", lambda k: StructuredOutputsParams(json={"type": "object", "properties": {
        f"p{k}_{i}": {"type": "integer"} for i in range(1000)}, "required": [f"p{k}_{i}" for i in range(1000)]})),
    ("chain", lambda k: StructuredOutputsParams(grammar=chain_grammar(1500) + f'\nx{k}: "{k}"')),
    ("small", lambda k: StructuredOutputsParams(json={"type": "object", "properties": {f"a{k}": {"type": "integer"}}})),
])
def test_the_cache_measure_bounds_the_heap_a_compiled_grammar_holds(manager, kind, make_params):
    """What the cache counts for a grammar is at least the C heap it keeps (glibc's in-use bytes, measured
    across compiling and keeping eight distinct grammars of a kind, freed with them)."""
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("needs glibc's mallinfo2")
    import llguidance
    builder = manager.builder
    params = [make_params(k) for k in range(8)]
    texts = [builder.grammar_text(p) for p in params]
    gc.collect()
    before = _heap_in_use()
    kept = [llguidance.LLMatcher(builder.tokenizer(), t, log_level=0) for t in texts]
    held = (_heap_in_use() - before) / len(kept)
    counted = sum(grammar_bytes(p.kind, len(t)) for p, t in zip(params, texts)) / len(kept)
    assert held <= counted, (kind, held, counted)
    assert counted < 20 * held + (1 << 20), (kind, held, counted)     # and not wildly above it
    del kept


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow     # a 200-grammar soak (~20 s)
def test_rss_stays_flat_over_200_distinct_large_grammars(tok):
    """200 distinct 2,000-option choice lists (each a few hundred KiB compiled, ~100 MiB in all) through a
    32 MiB cache: RSS grows by at most the cache plus 64 MiB of allocator slack."""
    budget = 32 << 20
    m = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,),
                                limits=StructuredOutputsLimits(grammar_cache_bytes=budget))
    try:
        m.compile(StructuredOutputsParams(choice=["warm"]))
        gc.collect()
        start = _rss()
        total = 0
        for k in range(200):
            total += m.submit(StructuredOutputsParams(
                choice=[f"option {k} number {i}" for i in range(2000)])).result().nbytes
        grown = _rss() - start
        stats = m.compiler.stats()
        assert total > 3 * budget and stats["evictions"] > 100 and stats["cache_bytes"] <= budget
        assert grown < budget + (64 << 20), grown / 2**20
    finally:
        m.compiler.close()


# ---------------------------------------------------------------------------------------------- runtime failures
def constrained(rid: str, params) -> SimpleNamespace:
    from jaxserve.engine.request import RequestStatus
    return SimpleNamespace(request_id=rid, status=RequestStatus.RUNNING,
                           sampling_params=SimpleNamespace(structured_outputs=params))


def test_a_grammar_past_the_parsers_limits_fails_its_request_with_one_short_log_line(manager, caplog):
    """One rule of 2,500 alternatives passes every pre-check, then needs more items in a parser row than
    llguidance allows at the first token: the request must end with an error, not "stop" with ``option``."""
    import numpy as np
    params = StructuredOutputsParams(grammar="start: " + " | ".join(f'"option number {i}"' for i in range(2500)))
    req = constrained("req-wide", params)
    manager.add_request(req)
    mask = manager.fill_bitmask([(0, req.request_id)], 1)
    allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxserve.engine.structured_output.manager"):
        manager.advance([(req, 0)], {req.request_id: int(allowed[0])})
        assert manager.accept(req.request_id, int(allowed[0])) is True          # must finish now
    failure = manager.take_failure(req.request_id)
    assert failure is not None and "max_parser_row_items" in failure and "\n" not in failure
    assert manager.take_failure(req.request_id) is None                         # told once
    [record] = [r for r in caplog.records if r.levelname == "WARNING"]
    line = record.getMessage()
    assert "req-wide" in line and "max_parser_row_items" in line
    assert "\n" not in line and len(line) < 1500 and "option number 2499" not in line
    manager.remove(req.request_id)


def test_a_token_outside_the_grammar_is_a_failure_too(manager, tok):
    req = constrained("req-outside", StructuredOutputsParams(choice=["yes", "no"]))
    manager.add_request(req)
    assert manager.accept(req.request_id, tok.encode("maybe", add_special_tokens=False)[0]) is True
    assert "matcher failed" in manager.take_failure(req.request_id)
    manager.remove(req.request_id)
    ended = constrained("req-ended", StructuredOutputsParams(choice=["yes", "no"]))
    manager.add_request(ended)
    finished = [manager.accept(ended.request_id, t) for t in tok.encode("yes", add_special_tokens=False)]
    assert finished[-1] is True and manager.take_failure(ended.request_id) is None    # ended, not failed
    manager.remove(ended.request_id)


# ---------------------------------------------------------------------------------------------- the core's side
def test_the_engine_core_never_waits_for_a_compile(tok):
    """enqueue -> start_request: a compiled grammar gives the request its matcher at once; an uncompiled one
    leaves it waiting (WAITING_FOR_FSM) until take_compiled hands it back, ready or refused; removing a
    waiting request drops its interest, and a compile nobody waits for any more never runs."""
    m = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,), compile_workers=1)
    try:
        warm = StructuredOutputsParams(choice=["yes", "no"])
        m.compile(warm)
        assert m.start_request(constrained("r-warm", warm)) is True
        assert m.constrained_rows([SimpleNamespace(samples=1, request=SimpleNamespace(request_id="r-warm"))])

        slow = [StructuredOutputsParams(choice=[f"option {k} number {i}" for i in range(10_000)]) for k in range(2)]
        a, b = constrained("r-a", slow[0]), constrained("r-b", slow[1])
        refused = constrained("r-bad", StructuredOutputsParams(json={"$ref": "#"}))
        assert [m.start_request(r) for r in (a, b, refused)] == [False, False, False]
        assert m.num_waiting == 3
        m.remove("r-b")                                   # aborted while it waits behind r-a's compile
        got_ready, got_refused = [], []
        deadline = time.monotonic() + 30
        while (m.num_waiting or not got_ready) and time.monotonic() < deadline:
            ready, bad = m.take_compiled()
            got_ready += ready
            got_refused += bad
            time.sleep(0.01)
        assert got_ready == [a] and [r for r, _ in got_refused] == [refused]
        assert "no finite instance" in got_refused[0][1]
        assert m.constrained_rows([SimpleNamespace(samples=1, request=a)]) == [(0, "r-a")]
        stats = m.compiler.stats()
        assert stats["cancelled"] == 1 and not m.compiler.ready(slow[1])
        assert all(name.startswith(WORKER_PREFIX) for name in stats["compile_threads"])
    finally:
        m.compiler.close()
