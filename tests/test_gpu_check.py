"""benchmarks/diagnostics/gpu_check.tie_gap: a float32 variant that leaves the reference path's greedy tokens only where the
reference had a near-tie (and took the runner-up) passes; any other divergence fails."""
from jaxserve.benchmarks.diagnostics.gpu_check import TIE_EPS, tie_gap
from jaxserve.outputs import Logprob


def _lp(**by_token):
    return {int(t[1:]): Logprob(v) for t, v in by_token.items()}


def test_runner_up_within_eps_is_a_tie():
    ref = _lp(t97418=-8.469693, t99873=-8.470695)            # the H200 case of 2026-11-30
    gap = tie_gap(ref, 99873)
    assert gap is not None and 0 < gap < TIE_EPS


def test_other_token_or_wide_gap_is_a_divergence():
    ref = _lp(t1=-1.0, t2=-1.5, t3=-1.6)
    assert tie_gap(ref, 3) is None                           # not the runner-up
    assert tie_gap(ref, 2) == 0.5 and tie_gap(ref, 2) >= TIE_EPS
    assert tie_gap(_lp(t1=-0.1), 1) is None                  # no runner-up recorded
