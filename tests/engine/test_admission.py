"""The engine's boundary: prompt-length validation and the async front's admission (--max-waiting-requests)."""
import pytest

from jaxserve.config import EngineConfig, SchedulerConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.llm_engine import validate_prompt_length
from jaxserve.errors import InvalidRequestError, QueueFullError


def test_validate_prompt_length_messages():
    with pytest.raises(InvalidRequestError, match=r"^prompt has 9000 tokens, max_model_len is 8192$"):
        validate_prompt_length(9000, None, 8192)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        validate_prompt_length([], None, 8192)
    with pytest.raises(InvalidRequestError, match=r"8000 tokens and max_tokens is 500: 8500 tokens exceed"):
        validate_prompt_length(8000, 500, 8192)
    validate_prompt_length([1] * 8192, None, 8192)
    validate_prompt_length(8000, 192, 8192)


class IdleEngine:
    """What the async front reads of an LLMEngine, for an engine that runs and queues nothing."""

    def __init__(self, max_num_seqs, max_waiting_requests):
        self.config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                             max_waiting_requests=max_waiting_requests))
        self.running = 0

    def stats(self):
        return {"num_running": self.running, "num_waiting": 0}

    def has_unfinished_requests(self):
        return False

    def shutdown(self):
        pass


@pytest.fixture
def front():
    fronts = []

    def make(max_num_seqs=8, max_waiting_requests=4):
        f = AsyncLLMEngine(None, engine=IdleEngine(max_num_seqs, max_waiting_requests))
        fronts.append(f)
        return f
    yield make
    for f in fronts:
        f.shutdown(drain_timeout=0)


def admitted_in_a_burst(front) -> int:
    """Single requests arriving faster than the loop thread takes them in (they stay pending)."""
    n = 0
    while True:
        try:
            front.check_admission(1)
        except QueueFullError:
            return n
        front._pending += 1
        n += 1


def test_requests_the_next_step_schedules_count_as_running(front):
    f = front(max_num_seqs=8, max_waiting_requests=4)
    f.check_admission(5)                                # n=5 on an idle server: 5 run at once, none waits
    f.check_admission(12)                               # 8 run, 4 wait
    assert admitted_in_a_burst(f) == 12
    f = front(max_num_seqs=8, max_waiting_requests=4)
    f.engine.running = 8
    f._stats = f.engine.stats()
    assert admitted_in_a_burst(f) == 4                  # no free seat: only the waiting room is left
    with pytest.raises(QueueFullError, match="retry later"):
        f.check_admission(5)


def test_a_request_that_can_never_fit_is_a_400_naming_the_limits(front):
    f = front(max_num_seqs=8, max_waiting_requests=4)
    with pytest.raises(InvalidRequestError, match=r"13 sequences .* 8 running \(--max-num-seqs\) \+ 4 waiting "
                                                  r"\(--max-waiting-requests\)"):
        f.check_admission(13)


def test_no_limit_admits_anything(front):
    f = front(max_num_seqs=8, max_waiting_requests=None)
    f._pending = 10_000
    f.check_admission(10_000)
