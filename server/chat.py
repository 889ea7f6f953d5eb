"""POST /v1/chat/completions: check the request, render the chat template, build each choice's SamplingParams
(the tool plan's constraint included), submit, and answer whole or streamed (``chat_response``)."""
from __future__ import annotations

from typing import Any

from .chat_response import ChatRenderer
from .engine_runs import Prompt
from .errors import bad_request
from .request_types import ChatCompletionRequest
from .response_types import random_id
from .sampling import compile_structured_outputs, request_constraint, resolve_max_tokens, sampling_params
from .serving import Serving
from .streaming import submit
from .validation import check_chat_request


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest, receive) -> Any:
    plan = check_chat_request(serving, req)
    text = await serving.prompts.render_chat(
        req.messages, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, chat_template=req.chat_template,
        chat_template_kwargs=req.template_kwargs(), tools=plan.tools)
    # the template already holds BOS and friends: vLLM encodes it without adding special tokens again
    ids = await serving.prompts.encode(text, add_special_tokens=False, what="messages")
    if not ids:
        raise bad_request("the messages rendered to an empty prompt", "messages")
    prompt = Prompt(ids, text)
    max_tokens = resolve_max_tokens(serving, len(ids), req.requested_max_tokens(), "messages")
    params = sampling_params(serving, req, max_tokens=max_tokens, logprobs=req.requested_logprobs(),
                             constraint=request_constraint(req, plan), tools=plan)
    request_id = random_id("chatcmpl")
    serving.runs.add_choices(prompt, params, request_id)
    await compile_structured_outputs(serving, [prompt], receive)
    renderer = ChatRenderer(serving, req, plan, prompt, request_id)
    return await submit(serving.runs, [prompt], receive, renderer, req.stream)
