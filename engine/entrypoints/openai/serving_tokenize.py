"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes).

``/tokenize`` takes either ``prompt`` (text; special tokens such as BOS added by default)
or ``messages`` (rendered with the chat template, which already holds them, so none are
added by default) and returns the token ids, their count and ``max_model_len``.
"""

from __future__ import annotations

from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from engine.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization(OpenAIServingChat):
    """Reuses the chat handler's template rendering."""

    async def tokenize_request(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        self.log_ignored_fields(request, "/tokenize")
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of prompt (text) or messages (chat)", "prompt")
        if request.messages is not None:  # images are expanded to their tokens
            chat = await self.render_prompt(request.messages, request.chat_template,
                                            request.add_generation_prompt,
                                            request.continue_final_message,
                                            request.chat_template_kwargs,
                                            bool(request.add_special_tokens))
            ids = chat.token_ids
        else:
            assert request.prompt is not None
            ids = await self.tokenize(request.prompt, request.add_special_tokens is not False)
        strs = None
        if request.return_token_strs and self.tokenizer is not None:
            strs = self.tokenizer.convert_ids_to_tokens(ids)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=strs)

    async def detokenize_request(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        self.log_ignored_fields(request, "/detokenize")
        vocab = self.engine.processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"tokens contains id(s) {bad[:5]} outside the vocabulary [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=self.decode(request.tokens))
