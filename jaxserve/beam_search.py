"""Beam search on top of the engine, as vLLM does it: the front end drives the search, the engine runs ordinary
one-token requests. ``BeamSearch`` is one prompt's search; ``LLM.beam_search`` (``beam_search_offline``) and
the server (``server/beam_search.py``) feed it each step's engine outputs.

NOTE: the algorithm. Each step submits one request per live beam (the beam's tokens so far as its prompt,
``step_params``: max_tokens=1 and the top K logprobs, K = max(2, 1 + number of EOS ids) x beam width, HF's
``beams_to_keep``), all of a step at once so the engine runs them in one batch; the prefix cache serves every
beam the full KV blocks of the prompt and of the tokens beams share, so a step computes each beam's unshared
tail only. The candidates (a beam's summed logprob plus one of its returned tokens') are then ranked as HF
transformers' ``generate(num_beams=...)`` ranks them with its default ``early_stopping=False``: of the top K
candidates over all beams, those among the first ``beam_width`` that end (an EOS id, or the ``max_tokens``-th
token) join the finished hypotheses, scored ``summed logprob / generated length ** length_penalty`` (EOS
counted; the best ``beam_width`` are kept); the best ``beam_width`` that do not end are the next step's beams.
The search stops at ``max_tokens``, or once ``beam_width`` hypotheses are finished and the best live beam,
scored at its current length, does not beat the worst of them. (vLLM's own front end divides by the prompt's
length plus the generated one and searches to ``max_tokens`` always; HF's rule is the reference here.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from jaxserve.outputs import PositionLogprobs
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's): the prompt's and the generated token ids, the candidates the engine returned at each
    generated position ({token id: Logprob}), the summed logprob of the generated tokens, and once returned,
    its text and how it ended ("stop" at an EOS id, which ``stop_reason`` names; "length" at max_tokens)."""
    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best ``beam_width`` beams, best first (vLLM's)."""
    sequences: list[BeamSearchSequence]


def beam_score(cum_logprob: float, num_generated: int, length_penalty: float) -> float:
    """HF's score of a hypothesis: its summed logprob over its generated length to the power ``length_penalty``.
    A penalty so large that the power overflows (or vanishes) scores it 0 (or -inf), never an exception."""
    try:
        scale = float(num_generated) ** length_penalty
    except OverflowError:
        scale = math.inf
    if scale == 0.0:
        return -math.inf if cum_logprob < 0 else 0.0
    return cum_logprob / scale


def num_candidates(beam_width: int, eos_token_ids: Sequence[int]) -> int:
    """K, the logprobs a beam step asks for per beam (HF's ``beams_to_keep``): enough that ``beam_width``
    candidates remain when the best ones all end at an EOS id."""
    return max(2, 1 + len(set(eos_token_ids))) * beam_width


def step_params(params: BeamSearchParams, eos_token_ids: Sequence[int], logprobs: int = 0) -> SamplingParams:
    """A beam step's request: one token, the top K logprobs (or ``logprobs``, when the answer shows more),
    no text (beam search reads token ids)."""
    return SamplingParams(max_tokens=1, temperature=params.temperature, detokenize=False,
                          logprobs=max(num_candidates(params.beam_width, eos_token_ids), logprobs),
                          output_kind=RequestOutputKind.DELTA)


class BeamSearch:
    """One prompt's beam search (the NOTE above): ``running`` holds the live beams, whose tokens are the next
    step's prompts; ``advance`` takes that step's candidates; ``result`` the best beams once ``done``."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams, eos_token_ids: Sequence[int]):
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = num_candidates(params.beam_width, eos_token_ids)
        self.running = [BeamSearchSequence(list(prompt_token_ids), [])]
        self.finished: list[tuple[float, BeamSearchSequence]] = []     # (score, beam), best first
        self.num_generated = 0

    @property
    def done(self) -> bool:
        return not self.running

    def advance(self, step_logprobs: Sequence[PositionLogprobs | None]) -> None:
        """One step: ``step_logprobs[i]`` is what the engine returned for ``running[i]`` (None: nothing, the
        request ended without a token)."""
        assert len(step_logprobs) == len(self.running)
        width, length = self.params.beam_width, self.num_generated + 1
        at_budget = length >= self.params.max_tokens
        candidates = [(beam.cum_logprob + lp.logprob, i, token)
                      for i, (beam, position) in enumerate(zip(self.running, step_logprobs)) if position
                      for token, lp in position.items()]
        candidates.sort(key=lambda c: -c[0])       # stable: ties keep beam order, then the engine's
        running = []
        for rank, (cum, i, token) in enumerate(candidates[:self.num_candidates]):
            ends_at_eos = token in self.eos_token_ids
            if not (ends_at_eos or at_budget):
                if len(running) < width:
                    running.append(self._extend(i, token, cum, step_logprobs[i]))
            elif rank < width:        # only the top beam_width candidates may finish (HF's rule)
                beam = self._extend(i, token, cum, step_logprobs[i])
                beam.finish_reason, beam.stop_reason = ("stop", token) if ends_at_eos else ("length", None)
                self.finished.append((beam_score(cum, length, self.params.length_penalty), beam))
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[width:]
        self.running, self.num_generated = running, length
        if at_budget or not self._can_improve():
            self.running = []

    def _extend(self, i: int, token: int, cum_logprob: float, position: PositionLogprobs) -> BeamSearchSequence:
        beam = self.running[i]
        return BeamSearchSequence(beam.tokens + [token], beam.logprobs + [position], cum_logprob)

    def _can_improve(self) -> bool:
        """HF's early-stop heuristic (early_stopping=False): can the best live beam, scored at its current
        length, still beat the worst of ``beam_width`` finished hypotheses?"""
        if len(self.finished) < self.params.beam_width:
            return bool(self.running)
        if not self.running:
            return False
        best = beam_score(self.running[0].cum_logprob, self.num_generated, self.params.length_penalty)
        return best > self.finished[-1][0]

    def result(self) -> list[BeamSearchSequence]:
        """The best ``beam_width`` beams, best first: the finished ones, and any still live (a search cut short,
        e.g. its requests returned nothing) scored at their length and ended by "length"."""
        ranked = list(self.finished)
        for beam in self.running:
            ranked.append((beam_score(beam.cum_logprob, self.num_generated, self.params.length_penalty),
                           replace(beam, finish_reason="length")))
        ranked.sort(key=lambda f: -f[0])
        return [beam for _, beam in ranked[:self.params.beam_width]]

    def generated(self, beam: BeamSearchSequence) -> list[int]:
        return beam.tokens[self.num_prompt_tokens:]


def first_position(output: Any) -> PositionLogprobs | None:
    """A beam step's candidates: the logprobs of its one generated position (None: it generated nothing)."""
    logprobs = output.outputs[0].logprobs
    return logprobs[0] if logprobs else None


def check_beam_width(beam_width: int, eos_token_ids: Sequence[int], max_logprobs: int) -> None:
    """A beam step asks for K logprobs per beam; the engine returns at most ``max_logprobs``. Raises a
    ValueError naming the widest beam search this engine runs."""
    k = num_candidates(beam_width, eos_token_ids)
    if max_logprobs != -1 and k > max_logprobs:
        per_beam = k // beam_width
        raise ValueError(f"beam_width must be at most {max_logprobs // per_beam}: each beam step asks for the top "
                         f"{per_beam} x beam_width logprobs and max_logprobs is {max_logprobs}; got {beam_width}")


def beam_search_offline(generate: Callable[..., list[Any]], tokenizer: Any, facts: Any,
                        prompts: Sequence[Sequence[int]], params: BeamSearchParams,
                        concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """``LLM.beam_search`` of token-id ``prompts``: ``generate`` is ``LLM.generate``; ``facts`` the engine's
    EngineFacts (its EOS ids, max_model_len and max_logprobs). ``concurrency_limit`` prompts are searched at a
    time (all by default)."""
    eos = tuple(facts.eos_token_ids)
    check_beam_width(params.beam_width, eos, facts.config.max_logprobs)
    searches = []
    for ids in prompts:
        room = facts.max_model_len - len(ids)      # offline, generation stops at max_model_len
        if room < 1:
            raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room for a token under "
                             f"max_model_len {facts.max_model_len}")
        searches.append(BeamSearch(ids, replace(params, max_tokens=min(params.max_tokens, room)), eos))
    step = step_params(params, eos)
    group = concurrency_limit or len(searches) or 1
    for start in range(0, len(searches), group):
        live = searches[start:start + group]
        while live:
            beams = [beam.tokens for search in live for beam in search.running]
            outputs = iter(generate(beams, step, use_tqdm=False))
            for search in live:
                search.advance([first_position(next(outputs)) for _ in search.running])
            live = [search for search in live if not search.done]
    results = []
    for search in searches:
        best = search.result()
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens)
        results.append(BeamSearchOutput(best))
    return results
