"""The start-up timeline (jaxserve/utils/startup_timeline.py): one INFO line per phase, nested phases not
counted twice, and the phases an offline LLM's start-up logs."""
import logging
import re
import threading
import time

from jaxserve.utils import startup_timeline

from support.tiny_models import tiny_llm


def phase_lines(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.search(startup_timeline.LINE, line)
        if m:
            found.setdefault(m.group(1), []).append(line)
    return found


def test_a_nested_phase_is_not_counted_in_its_parent(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.startup")
    with startup_timeline.phase("weights") as weights:
        time.sleep(0.05)
        with startup_timeline.phase("config/tokenizer"):
            with startup_timeline.phase("config/tokenizer"):       # the same phase again: part of the open one
                time.sleep(0.2)
        weights.nbytes = 3 * 10**9
    seen = {name: (s, detail) for name, s, detail in startup_timeline.timeline()[-2:]}
    assert seen["config/tokenizer"][0] >= 0.2 and 0.05 <= seen["weights"][0] < 0.2
    assert re.fullmatch(r"3\.00 GB, [0-9.]+ GB/s", seen["weights"][1])
    lines = phase_lines(caplog.text)
    assert len(lines["config/tokenizer"]) == 1 and "GB/s)" in lines["weights"][0]


def test_a_failed_phase_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.startup")
    try:
        with startup_timeline.phase("weights"):
            raise ValueError("bad shard")
    except ValueError:
        pass
    assert "weights" not in phase_lines(caplog.text)


def test_an_offline_llm_logs_every_engine_phase(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.startup")
    tiny_llm()
    lines = phase_lines(caplog.text)
    for name in ("device init", "config/tokenizer", "weights", "KV cache", "warm-up"):
        assert len(lines.get(name, ())) == 1, caplog.text
    assert re.search(r"\([0-9.]+ GB, [0-9.]+ GB/s\)", lines["weights"][0])
    assert startup_timeline.seconds_since_process_start() > 0


def test_a_phase_on_another_thread_is_overlapped_and_not_in_the_total(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.startup")
    total_before = startup_timeline.summary().rpartition("; ")[2]

    def build():
        with startup_timeline.phase("config/tokenizer"):
            time.sleep(0.25)
    side = threading.Thread(target=build)
    side.start()
    side.join()
    assert phase_lines(caplog.text)["config/tokenizer"][0].endswith("(overlapped)")
    summary = startup_timeline.summary()
    # (another engine's tokenizer thread, left from an earlier test in this worker, may add its own after it)
    assert re.search(r"config/tokenizer 0\.[23] s \(overlapped\)(; total|, )", summary)
    assert summary.rpartition("; ")[2] == total_before
