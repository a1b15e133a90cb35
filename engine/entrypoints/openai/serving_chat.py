"""``POST /v1/chat/completions``: messages rendered with the chat template, then generated.

Streaming follows OpenAI's chunk order per choice: a ``{"role": "assistant"}`` delta
first, then content deltas, then an empty delta carrying ``finish_reason``; with
``stream_options.include_usage`` a last chunk with no choices carries the usage.

Structured output (``response_format``, ``guided_*``, ``structured_outputs``) constrains
every choice; the server's ``--structured-outputs-config`` fills what the request leaves
unset. A JSON schema compiled with keywords relaxed (ones no backend enforces) names them
in the ``x-structured-output-relaxed`` response header; with ``strict`` it is a 400.

With ``tools`` (and ``tool_choice`` other than "none") the tools go to the chat template
and each choice's text is split into ``content`` and ``tool_calls`` by a
:class:`ToolCallHandler`: "required" and a named function are enforced by a JSON schema,
"auto" is read by the server's tool-call parser (``--tool-call-parser``). Streamed tool
calls follow OpenAI's shape: a call's first piece carries its id, type and name, later
pieces extend its ``arguments``. The legacy ``functions`` / ``function_call`` are a 400.

With ``--reasoning-parser`` each choice's text is first split into its reasoning
(``message.reasoning_content`` and vLLM's newer ``message.reasoning``, the same value;
streamed as ``delta.reasoning_content`` / ``delta.reasoning``) and the rest; tool calls are
read from the rest only (the engine core likewise constrains only the tokens after the
reasoning).

Images (``image_url`` content parts; :mod:`engine.multimodal.chat`) are loaded with the
server's :class:`~engine.multimodal.media.MediaConnector` (``--allowed-media-domains``,
``--allowed-local-media-path``, ``--media-io-timeout``), concurrently and off the event
loop; the messages get the model's placeholders (or typed parts, for templates that iterate
them), the model's processor expands the prompt (off the event loop), and the engine
takes that processed prompt as it is. Every bad image (refused URL, too large, corrupt, more than
``--limit-mm-per-prompt``, an image to a text-only model) is a 400 before anything runs.

The steps are reusable (``/v1/responses`` runs through them): :meth:`OpenAIServingChat.
prepare` validates a request and builds its engine job, :meth:`~OpenAIServingChat.choice`
reads a finished output, :meth:`~OpenAIServingChat.iterate_deltas` a streamed one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import jinja2
from fastapi.responses import JSONResponse, Response

from engine.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine.core.sampling_params import RequestOutputKind
from engine.core.tokenizer import TokenDecoder
from engine.entrypoints.openai.errors import bad_request, from_value_error
from engine.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatMessageParam,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    UsageInfo,
    now_s,
    random_id,
)
from engine.entrypoints.openai.serving_base import (
    SSE_DONE,
    EventStreamResponse,
    GenerationJob,
    OpenAIServing,
    PromptInput,
    clamp_logprob,
    run_until_disconnect,
    sse,
    sse_error,
    structured_output_failure,
    token_text,
)
from engine.entrypoints.openai.serving_beam import beam_search_params, collect_beam_search
from engine.entrypoints.openai.serving_completion import (
    serialize_prompt_logprobs,
    server_structured_outputs,
)
from engine.multimodal.chat import (
    aload_media_items,
    chat_template_source,
    check_media_limits,
    content_format_for,
    extract_chat_media,
    has_media_parts,
)
from engine.multimodal.media import connector_from_config
from engine.structured_output.enforcement import relaxed_keywords
from engine.structured_output.openai_fields import relaxed_headers
from engine.structured_output.reasoning import (
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)
from engine.structured_output.tool_calls import ToolCallStream
from engine.structured_output.tool_choice import ToolCallHandler

# Arguments the renderer passes itself; chat_template_kwargs must not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "chat_template", "tools", "documents",
    "add_generation_prompt", "continue_final_message", "tokenize", "return_dict",
    "content_format",
})


@dataclass
class ChatPrompt:
    """A conversation rendered for the engine: its text, token ids (images expanded to
    their embedding tokens) and, with images, the processed multimodal prompt."""

    text: str
    token_ids: list[int]
    mm_prompt: Any = None  # engine.multimodal.prompt.MultiModalPrompt (None: text only)


@dataclass
class _Options:
    request_id: str
    created: int
    n: int
    top_logprobs: int | None  # None: no logprobs
    tools: ToolCallHandler | None = None  # None: no tools (the text is the content)
    reasoning: ReasoningParser | None = None  # None: no reasoning split
    model: str = ""  # the response's ``model``: the base model's name or the adapter's

    def finish_reason(self, reason: str | None, tools_called: bool) -> str | None:
        """OpenAI reports "tool_calls" when the model chose to call (auto / required); a
        named function was forced, so its choice keeps "stop"."""
        if (reason == "stop" and tools_called and self.tools is not None
                and self.tools.choice.mode in ("auto", "required")):
            return "tool_calls"
        return reason


@dataclass
class PreparedChat:
    """A validated chat request, ready to run: its engine job, how to read its outputs,
    the response headers (``x-structured-output-relaxed``) and beam search (None:
    sampling)."""

    job: GenerationJob
    options: _Options
    headers: dict[str, str]
    beam: Any = None


@dataclass
class DeltaBatch:
    """What one engine output adds to a streamed chat request: the choices with new
    content (reasoning, text, tool-call pieces or logprobs), the choices that finished
    (an empty delta with finish_reason), and the output itself (token counts, cache)."""

    content: list[ChatStreamChoice]
    finished: list[ChatStreamChoice]
    output: RequestOutput
    new_tokens: int


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        name = self.settings.reasoning_parser
        self.reasoning_parser = (get_reasoning_parser(name, self.tokenizer)
                                 if name is not None else None)
        model_config = getattr(getattr(self.engine, "config", None), "model", None)
        self.media_connector = connector_from_config(model_config)

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     receive: Callable) -> Response:
        prepared = await self.prepare(request)
        job, options, beam = prepared.job, prepared.options, prepared.beam
        if request.stream:
            stream_options = request.stream_options
            include_usage = bool(stream_options and stream_options.include_usage)
            continuous = bool(stream_options and stream_options.continuous_usage_stats)
            streamed = EventStreamResponse(self._stream(job, options, include_usage, continuous))
            streamed.headers.update(prepared.headers)
            return streamed
        work = self.collect(job) if beam is None else collect_beam_search(self, job, beam)
        output = await run_until_disconnect(work, receive)
        choices = [self.choice(c, options)
                   for c in sorted(output.outputs, key=lambda c: c.index)]
        prompt_tokens = len(job.prompt.token_ids)
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        response = ChatCompletionResponse(
            id=options.request_id, created=options.created, model=options.model,
            choices=choices,
            usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            total_tokens=prompt_tokens + completion_tokens),
            prompt_logprobs=(serialize_prompt_logprobs(job.prompt_logprobs)
                             if request.prompt_logprobs is not None else None),
            kv_transfer_params=output.kv_transfer_params)
        return JSONResponse(response.model_dump(mode="json"), headers=prepared.headers)

    async def prepare(self, request: ChatCompletionRequest,
                      endpoint: str = "/v1/chat/completions",
                      request_id: str | None = None) -> PreparedChat:
        """Validate ``request`` and build its engine job (every 400 is raised here, before
        any response starts). The Responses API (``serving_responses``) runs its requests,
        translated to chat requests, through this same step."""
        lora = self.check_model(request.model)
        await self.check_alive()
        self.log_ignored_fields(request, endpoint)
        _reject_unsupported(request)
        structured = self.structured_outputs(request)  # validates tools / tool_choice too
        structured = server_structured_outputs(structured, self.engine)
        handler = self._tool_handler(request)
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self.check_logprobs_limit(request.top_logprobs, "top_logprobs")
        self.check_logprobs_limit(request.prompt_logprobs, "prompt_logprobs")
        chat = await self.render_prompt(request.messages, request.chat_template,
                                        request.add_generation_prompt,
                                        request.continue_final_message,
                                        request.chat_template_kwargs,
                                        request.add_special_tokens,
                                        tools=request.tools if handler is not None else None)
        prompt = PromptInput(chat.token_ids, chat.text)
        truncate = request.truncate_prompt_tokens
        if truncate is not None and truncate >= 1 and len(prompt.token_ids) > truncate:
            if chat.mm_prompt is not None:
                raise bad_request("truncate_prompt_tokens cannot cut a prompt with images "
                                  "(their tokens would be cut apart)", "truncate_prompt_tokens")
            prompt = PromptInput(prompt.token_ids[-truncate:])
        if request.max_completion_tokens is not None:
            requested, param = request.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = request.max_tokens, "max_tokens"
        max_tokens = self.resolve_max_tokens(len(prompt.token_ids), requested, param, minimum=1,
                                             prompt_param="messages")
        options = _Options(
            request_id=request_id or random_id("chatcmpl"), created=now_s(),
            n=1 if request.n is None else request.n,
            top_logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            tools=handler, reasoning=self.reasoning_parser,
            model=self.response_model_name(lora))
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = self.sampling_params(request, max_tokens=max_tokens,
                                      logprobs=options.top_logprobs,
                                      prompt_logprobs=request.prompt_logprobs, output_kind=kind,
                                      structured_outputs=structured)
        if handler is not None:
            params = handler.adjust_params(params)
        if (self.reasoning_parser is not None and self.reasoning_parser.marker_tokens_special
                and params.skip_special_tokens):  # keep special-token markers in the text
            params = params.clone(skip_special_tokens=False)
        job = GenerationJob(0, options.request_id, prompt, params, request.priority,
                            request.cache_salt, lora_request=lora,
                            mm_prompt=chat.mm_prompt)
        if chat.mm_prompt is not None and request.use_beam_search:
            raise bad_request("use_beam_search is not supported with images",
                              "use_beam_search")
        relaxed = relaxed_keywords(params.structured_outputs)  # the 400 is validate_job's
        self.validate_job(job, request)
        beam = beam_search_params(request, job)  # use_beam_search; None: sampling
        headers = relaxed_headers(relaxed)
        self.metrics.observe_structured_output(relaxed)
        return PreparedChat(job, options, headers, beam)

    def _tool_handler(self, request: ChatCompletionRequest) -> ToolCallHandler | None:
        """The request's tool handling; None when there are no tools or they are off."""
        if not request.tools and request.tool_choice in (None, "none"):
            return None
        try:
            handler = ToolCallHandler.from_request(request.tools, request.tool_choice,
                                                   parser=self.settings.tool_call_parser)
        except ValueError as exc:
            param = "tool_choice" if request.tool_choice is not None else "tools"
            raise from_value_error(exc, param) from exc
        return None if handler.choice.mode == "none" else handler

    def choice(self, completion: CompletionOutput, options: _Options) -> ChatCompletionChoice:
        """One finished choice: its text split into content and tool calls."""
        if (failure := structured_output_failure(completion)) is not None:
            raise failure
        reasoning, text = None, completion.text
        if options.reasoning is not None:
            reasoning, text = options.reasoning.extract_reasoning(text)
        message, called = ChatMessage(content=text), False
        if options.tools is not None and text is not None:  # calls come after the reasoning
            extracted = options.tools.extract(text)
            called = extracted.tools_called
            message = ChatMessage(content=extracted.content,
                                  tool_calls=[call.to_openai() for call in extracted.tool_calls])
        message.reasoning_content = message.reasoning = reasoning
        return ChatCompletionChoice(
            index=completion.index, message=message, logprobs=self._logprobs(completion, options),
            finish_reason=options.finish_reason(completion.finish_reason, called),
            stop_reason=completion.stop_reason)

    _choice = choice  # the older name

    async def render_prompt(self, messages: list[ChatMessageParam],
                            chat_template: str | None, add_generation_prompt: bool,
                            continue_final_message: bool, template_kwargs: dict | None,
                            add_special_tokens: bool,
                            tools: list[dict] | None = None) -> ChatPrompt:
        """The conversation as the engine's prompt: rendered, tokenized and, when it holds
        images, with them loaded and expanded. Every problem is the client's 400."""
        dicts = [m.to_template_dict() if isinstance(m, ChatMessageParam) else m
                 for m in messages]
        if not has_media_parts(dicts):
            text = await self.render(dicts, chat_template, add_generation_prompt,
                                     continue_final_message, template_kwargs, tools=tools)
            return ChatPrompt(text, await self.tokenize(text, add_special_tokens))
        multimodal = getattr(self.engine.processor, "multimodal", None)
        mm_processor = getattr(multimodal, "mm_processor", None)
        if mm_processor is None:
            raise bad_request(f"model {self.model_name!r} does not accept images (it takes "
                              "text only)", "messages")
        try:
            source = chat_template_source(self.tokenizer, chat_template)
        except ValueError as exc:
            raise from_value_error(exc, "chat_template") from exc
        content_format = content_format_for(source)
        try:
            dicts, items = extract_chat_media(dicts, mm_processor.placeholder,
                                              content_format == "openai")
            check_media_limits(items, getattr(multimodal, "limits", None),
                               getattr(multimodal, "modalities", None))
            data = await aload_media_items(items, self.media_connector)
        except ValueError as exc:  # MediaError included
            raise from_value_error(exc, "messages") from exc
        text = await self.render(dicts, chat_template, add_generation_prompt,
                                 continue_final_message, template_kwargs, tools=tools,
                                 content_format=content_format)
        try:  # the model's processor (resize, patching), off the event loop
            expanded = await asyncio.to_thread(multimodal.process, text, data,
                                               add_special_tokens)
        except ValueError as exc:
            raise from_value_error(exc, "messages") from exc
        return ChatPrompt(text, list(expanded.token_ids), expanded)

    async def render(self, messages: list[ChatMessageParam] | list[dict[str, Any]],
                     chat_template: str | None,
                     add_generation_prompt: bool, continue_final_message: bool,
                     template_kwargs: dict | None,
                     tools: list[dict] | None = None, content_format: str = "string") -> str:
        """The conversation as prompt text; template problems are the client's 400s."""
        kwargs = dict(template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs))
        if reserved:
            raise bad_request(f"chat_template_kwargs must not set {', '.join(reserved)}",
                              "chat_template_kwargs")
        if content_format != "string":
            kwargs["content_format"] = content_format
        try:
            return self.engine.processor.apply_chat_template(
                [m.to_template_dict() if isinstance(m, ChatMessageParam) else m
                 for m in messages], chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, tools=tools,
                continue_final_message=continue_final_message, **kwargs)
        except ValueError as exc:
            raise from_value_error(exc, "messages") from exc
        except jinja2.TemplateError as exc:
            raise bad_request(f"the chat template failed to render: {exc}",
                              "chat_template") from exc

    def _logprobs(self, completion: CompletionOutput, options: _Options
                  ) -> ChatChoiceLogprobs | None:
        if options.top_logprobs is None:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs or [],
                             options.top_logprobs, self.decoder)

    # -- streaming ------------------------------------------------------------------------
    async def iterate_deltas(self, job: GenerationJob, options: _Options
                             ) -> AsyncIterator[DeltaBatch]:
        """The job's (a DELTA job's) outputs as chat deltas: reasoning split, tool-call
        pieces parsed, per choice; a structured-output failure is raised."""
        handler = options.tools
        streams: dict[int, ToolCallStream] = (
            {i: handler.stream() for i in range(options.n)} if handler is not None else {})
        reasoning_streams: dict[int, ReasoningStream] = (
            {i: options.reasoning.stream() for i in range(options.n)}
            if options.reasoning is not None else {})
        async with contextlib.aclosing(self.iterate(job)) as outputs:
            async for output in outputs:
                content, finished, new_tokens = [], [], 0
                for c in output.outputs:
                    if (failure := structured_output_failure(c)) is not None:
                        raise failure
                    new_tokens += len(c.token_ids)
                    logprobs = self._logprobs(c, options)
                    delta = _delta(streams.get(c.index), reasoning_streams.get(c.index), c)
                    if (delta.content or delta.tool_calls or delta.reasoning_content
                            or (logprobs is not None and logprobs.content)):
                        content.append(ChatStreamChoice(
                            index=c.index, delta=delta, logprobs=logprobs))
                    if c.finish_reason is not None:
                        stream = streams.get(c.index)
                        called = stream is not None and stream.tools_called
                        finished.append(ChatStreamChoice(
                            index=c.index, delta=DeltaMessage(),
                            finish_reason=options.finish_reason(c.finish_reason, called),
                            stop_reason=c.stop_reason))
                yield DeltaBatch(content, finished, output, new_tokens)

    async def _stream(self, job: GenerationJob, options: _Options, include_usage: bool,
                      continuous_usage: bool) -> AsyncIterator[str]:
        prompt_tokens = len(job.prompt.token_ids)
        completion_tokens = 0

        def usage() -> UsageInfo:
            return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                             total_tokens=prompt_tokens + completion_tokens)

        def chunk(choices: list[ChatStreamChoice], with_usage: bool) -> str:
            return sse(ChatCompletionStreamResponse(
                id=options.request_id, created=options.created, model=options.model,
                choices=choices, usage=usage() if with_usage else None).model_dump(
                    mode="json", exclude_none=True))

        try:
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                      content=""))
                         for i in range(options.n)], continuous_usage)
            async with contextlib.aclosing(self.iterate_deltas(job, options)) as batches:
                async for batch in batches:
                    completion_tokens += batch.new_tokens
                    for choices in (batch.content, batch.finished):  # finish on its own
                        if choices:
                            yield chunk(choices, continuous_usage)
            if include_usage:
                yield chunk([], True)
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            yield sse_error(exc)
        yield SSE_DONE


def _reject_unsupported(request: ChatCompletionRequest) -> None:
    if request.functions or request.function_call not in (None, "none"):
        raise bad_request("the legacy functions / function_call are not supported; use "
                          "tools and tool_choice", "functions")


def _delta(stream: ToolCallStream | None, reasoning_stream: ReasoningStream | None,
           completion: CompletionOutput) -> DeltaMessage:
    """The streamed piece of one choice: reasoning (with a reasoning parser), then plain
    text, or content + tool-call pieces (the streams are flushed when the choice
    finishes)."""
    text, finished = completion.text, completion.finish_reason is not None
    if reasoning_stream is None:
        delta = _content_delta(stream, text, finished)
    else:
        reasoning, content = reasoning_stream.feed(text) if text else (None, None)
        if finished:
            more_reasoning, more_content = reasoning_stream.finish()
            reasoning = (reasoning or "") + (more_reasoning or "") or None
            content = (content or "") + (more_content or "") or None
        delta = _content_delta(stream, content or "", finished)
        delta.reasoning_content = delta.reasoning = reasoning
    return delta


def _content_delta(stream: ToolCallStream | None, text: str, finished: bool) -> DeltaMessage:
    if stream is None:
        return DeltaMessage(content=text or None)
    piece = stream.feed(text) if text else None
    if finished:
        rest = stream.finish()
        if piece is None:
            piece = rest
        else:
            piece.extend(rest)
    if piece is None:
        return DeltaMessage()
    return DeltaMessage(content=piece.content or None,
                        tool_calls=[t.to_openai() for t in piece.tool_calls] or None)


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], num_top: int,
                  decoder: TokenDecoder | None) -> ChatChoiceLogprobs:
    """OpenAI chat logprobs: per token its text, logprob, UTF-8 bytes and the
    ``num_top`` most likely alternatives (most likely first)."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        text = token_text(chosen, token_id, decoder)
        ranked = sorted(position.items(), key=lambda item: -item[1].logprob)[:num_top]
        top = []
        for tid, lp in ranked:
            alt = token_text(lp, tid, decoder)
            top.append(ChatTopLogprob(token=alt, logprob=clamp_logprob(lp.logprob),
                                      bytes=list(alt.encode("utf-8"))))
        content.append(ChatTokenLogprob(
            token=text, logprob=clamp_logprob(chosen.logprob) if chosen else -9999.0,
            bytes=list(text.encode("utf-8")), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)
