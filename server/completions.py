"""POST /v1/completions: check the request, tokenize each prompt (text or token ids) and build its n choices'
SamplingParams, submit, and answer whole or streamed (``completion_response``)."""
from __future__ import annotations

from typing import Any

from .beam_search import beam_search_run
from .completion_response import CompletionRenderer
from .engine_runs import Prompt
from .errors import bad_request
from .request_types import CompletionRequest
from .response_types import response_ids
from .sampling import compile_structured_outputs, request_constraint, resolve_max_tokens, sampling_params
from .serving import Serving
from .streaming import submit
from .validation import check_completion_request

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


async def create_completion(serving: Serving, req: CompletionRequest, receive,
                            header_request_id: str | None = None) -> Any:
    batch = check_completion_request(serving, req)
    requested = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
    echo_only = req.echo and requested == 0      # the engine still samples one token; it is not returned
    if echo_only:
        requested = 1
    request_id, engine_id = response_ids("cmpl", header_request_id, req.request_id)
    constraint = request_constraint(req)
    prompts: list[Prompt] = []
    for p_idx, p in enumerate(batch):
        if isinstance(p, str):
            ids = await serving.prompts.encode(p, add_special_tokens=req.add_special_tokens)
            text = p
        else:
            serving.prompts.check_token_ids(p, "prompt")
            ids, text = p, None
        if not ids:
            raise bad_request("the prompt is empty: give at least one token", "prompt")
        kept = serving.prompts.truncate(ids, req.truncate_prompt_tokens)
        if len(kept) < len(ids):
            ids, text = kept, None          # echo renders the tokens the model saw
        prompt = Prompt(ids, text, priority=req.priority, cache_salt=req.cache_salt,
                        lora_request=serving.loras.for_request(req))
        max_tokens = resolve_max_tokens(serving, len(ids), requested, "prompt")
        prompt.beam_search = beam_search_run(serving, req, max_tokens=max_tokens, logprobs=req.logprobs)
        if prompt.beam_search is not None:
            params = [prompt.beam_search.choice_params()] * req.n
        else:
            params = sampling_params(serving, req, max_tokens=max_tokens, logprobs=req.logprobs,
                                     constraint=constraint, score_prompt=req.scores_prompt())
        serving.runs.add_choices(prompt, params, engine_id, first_index=p_idx * req.n)
        prompts.append(prompt)
    await compile_structured_outputs(serving, prompts, receive)
    renderer = CompletionRenderer(serving, req, prompts, request_id, echo_only)
    return await submit(serving.runs, prompts, receive, renderer, req.stream)
