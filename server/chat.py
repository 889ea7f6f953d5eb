"""POST /v1/chat/completions: check the request, render the chat template, build each choice's SamplingParams
(the tool plan's constraint included), submit, and answer whole or streamed (``chat_response``)."""
from __future__ import annotations

from typing import Any

from .beam_search import beam_search_run
from .chat_response import ChatRenderer
from .engine_runs import Prompt
from .reasoning import answer_thinking
from .errors import bad_request
from .request_types import ChatCompletionRequest
from .response_types import response_ids
from .sampling import compile_structured_outputs, request_constraint, resolve_max_tokens, sampling_params
from .serving import Serving
from .streaming import submit
from .validation import check_chat_request


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest, receive,
                                 header_request_id: str | None = None) -> Any:
    plan = check_chat_request(serving, req)
    image_urls: list[str] = []
    text = await serving.prompts.render_chat(
        req.messages, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, chat_template=req.chat_template,
        chat_template_kwargs=req.template_kwargs(), tools=plan.tools, documents=req.documents,
        image_urls=image_urls)
    # the template already holds BOS and friends: vLLM encodes it without adding special tokens unless asked
    images = serving.prompts.images
    if image_urls and images.splits_placeholder:
        ids = images.encode(text, req.add_special_tokens)
    else:
        ids = await serving.prompts.encode(text, add_special_tokens=req.add_special_tokens, what="messages")
    if not ids:
        raise bad_request("the messages rendered to an empty prompt", "messages")
    features = None
    if images is not None and (image_urls or images.processing.image_token_id in ids):
        ids, features = await serving.prompts.prepare_images(ids, image_urls)
    kept = serving.prompts.truncate(ids, req.truncate_prompt_tokens)
    if features and len(kept) < len(ids):
        raise bad_request("truncate_prompt_tokens cannot shorten a prompt with images (their token positions "
                          "would move): send fewer messages instead", "truncate_prompt_tokens")
    ids = kept
    prompt = Prompt(ids, text, priority=req.priority, cache_salt=req.cache_salt, mm_features=features,
                    lora_request=serving.loras.for_request(req))
    max_tokens = resolve_max_tokens(serving, len(ids), req.requested_max_tokens(), "messages")
    prompt.beam_search = beam_search_run(serving, req, max_tokens=max_tokens, logprobs=req.requested_logprobs(),
                                         tools=plan)
    if prompt.beam_search is not None:
        params = [prompt.beam_search.choice_params()] * req.n
    else:
        thinks = answer_thinking(serving.reasoning_parser_cls, req.chat_template_kwargs, req.reasoning_effort, text)
        constraint = request_constraint(req, plan, serving.reasoning_end_token_ids if thinks else None)
        params = sampling_params(serving, req, max_tokens=max_tokens, logprobs=req.requested_logprobs(),
                                 constraint=constraint, tools=plan)
    request_id, engine_id = response_ids("chatcmpl", header_request_id, req.request_id)
    serving.runs.add_choices(prompt, params, engine_id)
    await compile_structured_outputs(serving, [prompt], receive)
    renderer = ChatRenderer(serving, req, plan, prompt, request_id)
    return await submit(serving.runs, [prompt], receive, renderer, req.stream)
