"""``use_beam_search`` (vLLM's, in completions and chat): a prompt's ``n`` choices are the ``n`` best beams of a
beam search (jaxserve/beam_search.py) the server drives through the engine client, best first. Each step
submits one one-token request per live beam, all at once, so the engine runs them in one batch and the
prefix cache serves every beam the prompt's KV blocks; the answer comes when the search ends (streamed, each
choice arrives whole)."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

from jaxserve.beam_search import BeamSearch, BeamSearchSequence, check_beam_width, first_position, step_params
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

from .errors import bad_request
from .request_types import ChatCompletionRequest, CompletionRequest, SamplingFields
from .sampling import check_logprobs
from .serving import Serving
from .tool_parsers.choice import ToolPlan


class BeamSearchRun:
    """One prompt's beam search as the server runs it: its parameters, the model's EOS ids, the logprobs the
    answer shows (the steps ask for at least that many), and how its text is decoded."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: Sequence[int], logprobs: int | None,
                 skip_special_tokens: bool, tokenizer: Any):
        self.params = params
        self.eos_token_ids = tuple(eos_token_ids)
        self.logprobs = logprobs
        self.skip_special_tokens = skip_special_tokens
        self.tokenizer = tokenizer

    def choice_params(self) -> SamplingParams:
        """What each choice's metrics and logs show: a beam's token budget and its logprobs."""
        return SamplingParams(max_tokens=self.params.max_tokens, temperature=self.params.temperature,
                              ignore_eos=self.params.ignore_eos, logprobs=self.logprobs,
                              output_kind=RequestOutputKind.DELTA)

    async def stream(self, engine: Any, prompt: Any) -> AsyncIterator[tuple[Any, RequestOutput]]:
        """Search, then yield (choice, RequestOutput) for ``prompt``'s choices, choice i the i-th best beam.
        Closing it mid-step aborts that step's requests."""
        search = BeamSearch(prompt.token_ids, self.params, self.eos_token_ids)
        step = step_params(self.params, self.eos_token_ids, self.logprobs or 0)
        base = prompt.choices[0].request_id
        num_steps = 0
        while not search.done:
            outputs = await run_step(engine, [beam.tokens for beam in search.running], step,
                                     f"{base}-beam{num_steps}")
            search.advance([first_position(out) for out in outputs])
            num_steps += 1
        for choice, beam in zip(prompt.choices, search.result()):
            yield choice, self.output(prompt, choice, search.generated(beam), beam)

    def output(self, prompt: Any, choice: Any, generated: list[int], beam: BeamSearchSequence) -> RequestOutput:
        """A finished beam as its choice's one RequestOutput: the text without its EOS, the token ids with it
        only under include_stop_str_in_output (vLLM's rules)."""
        text_ids = generated[:-1] if beam.finish_reason == "stop" else generated
        token_ids = generated if self.params.include_stop_str_in_output else text_ids
        text = self.tokenizer.decode(text_ids, skip_special_tokens=self.skip_special_tokens)
        comp = CompletionOutput(choice.index, text, token_ids, beam.cum_logprob, beam.logprobs[:len(token_ids)],
                                beam.finish_reason, beam.stop_reason)
        return RequestOutput(choice.request_id, prompt.text, prompt.token_ids, None, [comp], True)


async def run_step(engine: Any, prompts: list[list[int]], params: SamplingParams, request_id: str) -> list[Any]:
    """One beam step: a request per prompt, submitted together; each one's last output. If one fails or the
    caller goes away, the others are cancelled (which aborts them in the engine)."""
    async def last_output(i: int, token_ids: list[int]) -> Any:
        out = None
        async for out in engine.generate(token_ids, params, f"{request_id}.{i}"):
            pass
        return out

    tasks = [asyncio.ensure_future(last_output(i, ids)) for i, ids in enumerate(prompts)]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# what beam search does not combine with: each would change a sampled output, and a beam takes every
# candidate the model ranks (field, whether the request sets it)
def _unsupported(req: SamplingFields) -> list[str]:
    sets = {
        "stop": bool(req.stop), "stop_token_ids": bool(req.stop_token_ids), "min_tokens": req.min_tokens > 0,
        "top_p": req.top_p not in (None, 1.0), "top_k": req.top_k not in (None, 0, -1),
        "min_p": req.min_p not in (None, 0.0), "presence_penalty": bool(req.presence_penalty),
        "frequency_penalty": bool(req.frequency_penalty),
        "repetition_penalty": req.repetition_penalty not in (None, 1.0),
        "prompt_logprobs": req.prompt_logprobs is not None, "response_format": req.response_format is not None
        and req.response_format.type != "text", "structured_outputs": req.structured_outputs is not None,
        "guided_json": req.guided_json is not None, "guided_regex": req.guided_regex is not None,
        "guided_choice": req.guided_choice is not None, "guided_grammar": req.guided_grammar is not None,
    }
    if isinstance(req, CompletionRequest):
        sets["echo"] = req.scores_prompt()          # echo with logprobs scores the prompt
    return [name for name, given in sets.items() if given]


def beam_search_run(serving: Serving, req: ChatCompletionRequest | CompletionRequest, *, max_tokens: int,
                    logprobs: int | None, tools: ToolPlan | None = None) -> BeamSearchRun | None:
    """The request's beam search (``n`` = the beam width), None without ``use_beam_search``; a 400 naming a
    width above what the server's --max-logprobs allows, or a field beam search cannot honour (among them
    a chat tool plan that constrains the output: named or required tool_choice)."""
    if not req.use_beam_search:
        return None
    constrained = tools is not None and tools.mode in ("named", "required")
    unsupported = _unsupported(req) + (["tool_choice"] if constrained else [])
    if unsupported:
        raise bad_request(f"use_beam_search does not combine with {unsupported[0]}: a beam search ranks every "
                          "token the model offers and ends a beam at EOS or max_tokens only", unsupported[0])
    check_logprobs(serving, req, logprobs)
    eos = serving.engine.facts().eos_token_ids
    try:
        check_beam_width(req.n, eos, serving.max_logprobs)
        params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                  temperature=0.0 if req.temperature is None else req.temperature,
                                  length_penalty=req.length_penalty,
                                  include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as e:
        message, param = str(e), str(e).split(" ", 1)[0]
        if param == "beam_width":    # the request calls the width n
            message, param = f"use_beam_search: n (the beam width) {message.split(' ', 1)[1]}", "n"
        raise bad_request(message, param) from e
    # a tool parser that reads special tokens (such as [TOOL_CALLS]) needs them in the text
    skip_special_tokens = req.skip_special_tokens and not (tools is not None and tools.needs_special_tokens)
    return BeamSearchRun(params, eos, logprobs, skip_special_tokens, serving.tokenizer)
