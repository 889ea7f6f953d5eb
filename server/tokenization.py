"""POST /tokenize and /detokenize (vLLM's): a prompt or chat messages to token ids, token ids to text."""
from __future__ import annotations

from .request_types import DetokenizeRequest, TokenizeRequest
from .response_types import DetokenizeResponse, TokenizeResponse
from .serving import Serving
from .validation import check_model, check_tokenize_request


async def tokenize_prompt(serving: Serving, req: TokenizeRequest) -> TokenizeResponse:
    tools = check_tokenize_request(serving, req)
    prompts = serving.prompts
    if req.messages is not None:
        text = await prompts.render_chat(req.messages, add_generation_prompt=req.add_generation_prompt,
                                         continue_final_message=req.continue_final_message,
                                         chat_template=req.chat_template,
                                         chat_template_kwargs=req.chat_template_kwargs, tools=tools)
        ids = await prompts.encode(text, add_special_tokens=bool(req.add_special_tokens), what="messages")
    else:
        ids = await prompts.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    strs = serving.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(len(ids), serving.max_model_len, ids, strs)


def detokenize_tokens(serving: Serving, req: DetokenizeRequest) -> DetokenizeResponse:
    check_model(serving, req.model)
    serving.prompts.check_token_ids(req.tokens, "tokens")
    return DetokenizeResponse(serving.tokenizer.decode(req.tokens))
