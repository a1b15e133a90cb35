"""``POST /v1/responses`` (OpenAI's Responses API), run through the chat pipeline.

A Responses request is translated into a chat completion request and run by
:class:`~engine.entrypoints.openai.serving_chat.OpenAIServingChat` (its ``prepare`` step:
chat template, tools through the :class:`ToolCallHandler`, ``text.format`` as
``response_format`` structured outputs, sampling, every 400 before a response starts; its
``choice`` / ``iterate_deltas`` steps: reasoning split, tool-call parsing). The chat
results become Responses output items:

- ``input``: a string (one user message) or items: messages (role user / assistant /
  system / developer; content a string or ``input_text`` / ``output_text`` parts),
  ``function_call`` items (an assistant message's ``tool_calls``) and
  ``function_call_output`` items (``tool`` messages); ``reasoning`` items are dropped.
  ``input_image`` parts (an ``image_url`` string) go to a vision-language model like a
  chat message's images; other item and part types (files, item references) are a 400
  naming the item.
  ``instructions`` is a system message first (not carried over by
  ``previous_response_id``, as in OpenAI's API).
- ``tools``: function tools in the flat form ``{type: function, name, description,
  parameters, strict}``; other tool types are a 400. ``tool_choice`` "auto" / "none" /
  "required" / ``{type: function, name}``.
- ``text.format``: ``text``, ``json_object`` or ``json_schema`` ``{name, schema, strict}``.
- ``max_output_tokens``, ``temperature``, ``top_p``, ``parallel_tool_calls``, ``user``;
  ``metadata``, ``reasoning`` and ``truncation`` are accepted and echoed. ``background:
  true`` is a 400 (not supported).
- Output: a ``reasoning`` item (with ``--reasoning-parser``, when the model reasoned), a
  ``message`` item with one ``output_text`` part, and one ``function_call`` item per tool
  call. ``status`` is "incomplete" (``incomplete_details.reason`` "max_output_tokens")
  when the output was cut by the token limit. ``usage.output_tokens_details.
  reasoning_tokens`` counts the reasoning text re-tokenized (markers not included).
- ``stream: true``: server-sent events (``event: <type>`` and ``data: <json>``), each with
  an increasing ``sequence_number``, in OpenAI's order: ``response.created``,
  ``response.in_progress``, per output item ``response.output_item.added``, its content
  events (``response.content_part.added``, ``response.output_text.delta``* /
  ``response.reasoning_text.delta``*, their ``.done``, ``response.content_part.done``; a
  function call's ``response.function_call_arguments.delta``* / ``.done``),
  ``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``)
  with the whole response. An error once the stream has started is an ``error`` event.
  No ``[DONE]`` line (OpenAI sends none; the openai client needs none).

Stored responses (``store``, true by default): kept in memory, in this server process
only, at most ``--max-stored-responses`` of them (default 1000; the least recently used is
dropped first; 0 stores nothing). Each keeps its response object and its conversation (the
input messages, those of its ``previous_response_id`` chain included, plus its output), so
``previous_response_id`` prepends that conversation to a new request; an id that is not
stored (never, evicted, or ``store: false``) is a 404 naming ``previous_response_id``, as
OpenAI answers. ``GET /v1/responses/{id}`` returns a stored response and ``DELETE`` drops
it (404 for an unknown id).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from engine.entrypoints.openai.errors import APIError, bad_request
from engine.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from engine.entrypoints.openai.protocol_responses import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from engine.entrypoints.openai.serving_base import (
    EventStreamResponse,
    run_until_disconnect,
    to_api_error,
)
from engine.entrypoints.openai.serving_chat import OpenAIServingChat, PreparedChat

DEFAULT_MAX_STORED_RESPONSES = 1000
_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PART_TYPES = ("input_text", "output_text", "text")
# A chat request field a 400 names -> the Responses request field it came from.
_CHAT_TO_RESPONSES_PARAM = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                            "response_format": "text"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _not_found(what: str, response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"{what} with id '{response_id}' not found.", param)


# -- the store ----------------------------------------------------------------------------
@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as JSON
    conversation: list[dict[str, Any]]  # chat messages: the inputs, then the output


class ResponseStore:
    """Stored responses by id, at most ``capacity`` (least recently used dropped first)."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


# -- request translation ------------------------------------------------------------------
def _text_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content for the chat path: a string, or text parts joined; with
    ``input_image`` parts, chat content parts in order (the image as an ``image_url``
    part: its URL is loaded like a chat message's)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of input_text / "
                          "input_image parts", where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise bad_request(f"{where}.content[{j}] (an input_image) needs an image_url "
                                  "string (file_id is not supported)", where)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise bad_request(
                f"{where}.content[{j}] must be an input_text part {{type: input_text, text}} "
                f"or an input_image part {{type: input_image, image_url}}; got type {kind!r}",
                where)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses ``input`` as chat messages (400s name the bad item)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}, "
                                  f"got {role!r}", where)
            if "content" not in item:
                raise bad_request(f"{where} needs content", where)
            messages.append({"role": role, "content": _text_of(item["content"], where)})
        elif kind == "function_call":
            fields = {name: item.get(name) for name in ("call_id", "name", "arguments")}
            bad = [name for name, value in fields.items() if not isinstance(value, str)]
            if bad:
                raise bad_request(f"{where} (a function_call) needs string {', '.join(bad)}",
                                  where)
            call = {"id": fields["call_id"], "type": "function",
                    "function": {"name": fields["name"], "arguments": fields["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad_request(f"{where} (a function_call_output) needs a string call_id",
                                  where)
            if not isinstance(output, str):
                output = _text_of(output, where) if isinstance(output, list) else None
            if output is None:
                raise bad_request(f"{where} (a function_call_output) needs a string output",
                                  where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise bad_request(
                f"{where} has type {kind!r}; supported input items are message, "
                "function_call, function_call_output and reasoning", where)
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}] has type {tool.get('type')!r}; only function tools "
                              "are supported", "tools")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}] needs a non-empty string name", "tools")
        function = {"name": tool["name"]}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                          f"{{'type': 'function', 'name': ...}}; got {choice!r}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format json_schema needs a 'schema' object", "text")
        spec = {"name": fmt.get("name", "response"), "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(f"text.format type {kind!r} is not supported; use 'text', "
                      "'json_object' or 'json_schema'", "text")


# -- output translation -------------------------------------------------------------------
def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, item_id: str | None = None, status: str = "completed"
                 ) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def function_call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
                       status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def output_items(message: ChatMessage) -> list[dict[str, Any]]:
    items = []
    if message.reasoning_content:
        items.append(reasoning_item(message.reasoning_content))
    if message.content or not message.tool_calls:
        items.append(message_item(message.content or ""))
    for call in message.tool_calls:
        items.append(function_call_item(call["id"], call["function"]["name"],
                                        call["function"]["arguments"]))
    return items


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages of the next turn."""
    text = "".join(part["text"] for item in items if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


@dataclass
class _Turn:
    """One request on its way: what the response echoes and what the store keeps."""

    request: ResponsesRequest
    response_id: str
    conversation: list[dict[str, Any]]  # without the instructions
    prepared: PreparedChat
    created_at: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)


class OpenAIServingResponses:
    """The Responses API over a chat server (the same engine, template, parsers)."""

    def __init__(self, chat: OpenAIServingChat,
                 max_stored: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        self.chat = chat
        self.store = ResponseStore(max_stored)

    # -- routes ---------------------------------------------------------------------------
    async def create_response(self, request: ResponsesRequest, receive: Callable) -> Response:
        turn = await self._prepare(request)
        if request.stream:
            return EventStreamResponse(self._stream(turn))
        output = await run_until_disconnect(self.chat.collect(turn.prepared.job), receive)
        completion = output.outputs[0]
        choice = self.chat.choice(completion, turn.prepared.options)
        turn.items = output_items(choice.message)
        response = self._response(turn, choice.finish_reason, len(completion.token_ids),
                                  output.num_cached_tokens, choice.message.reasoning_content)
        self._store(turn, response)
        return JSONResponse(response, headers=turn.prepared.headers)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found("Response", response_id)
        return stored.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found("Response", response_id)
        return DeletedResponse(id=response_id).model_dump(mode="json")

    # -- steps ----------------------------------------------------------------------------
    async def _prepare(self, request: ResponsesRequest) -> _Turn:
        self.chat.check_model(request.model)
        self.chat.log_ignored_fields(request, "/v1/responses")
        if request.background:
            raise bad_request("background responses are not supported by this server; "
                              "leave background unset or false", "background")
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise _not_found("Previous response", request.previous_response_id,
                                 "previous_response_id")
            history = [dict(m) for m in stored.conversation]
        conversation = history + input_messages(request.input)
        messages = list(conversation)
        if request.instructions is not None:
            messages.insert(0, {"role": "system", "content": request.instructions})
        body: dict[str, Any] = {"model": request.model, "messages": messages,
                                "stream": bool(request.stream)}
        optional = {"max_completion_tokens": request.max_output_tokens,
                    "temperature": request.temperature, "top_p": request.top_p,
                    "user": request.user, "parallel_tool_calls": request.parallel_tool_calls,
                    "tools": chat_tools(request.tools),
                    "tool_choice": chat_tool_choice(request.tool_choice),
                    "response_format": response_format(request.text)}
        body.update({key: value for key, value in optional.items() if value is not None})
        if "tools" not in body and body.get("tool_choice") in ("auto", "none"):
            del body["tool_choice"]  # OpenAI's default with no tools: nothing to choose
        try:
            chat_request = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            error = exc.errors()[0]
            loc = error.get("loc", ())
            param = "input" if loc and loc[0] == "messages" else (str(loc[0]) if loc else None)
            raise bad_request(f"invalid {param or 'request'}: {error.get('msg')}",
                              param) from exc
        response_id = _new_id("resp")
        try:
            prepared = await self.chat.prepare(chat_request, "/v1/responses",
                                               request_id=response_id)
        except APIError as exc:  # name the Responses field, not the chat one
            exc.param = _CHAT_TO_RESPONSES_PARAM.get(exc.param, exc.param)
            raise
        return _Turn(request, response_id, conversation, prepared,
                     created_at=prepared.options.created)

    def _response(self, turn: _Turn, finish_reason: str | None, output_tokens: int,
                  cached_tokens: int, reasoning: str | None,
                  status: str | None = None) -> dict[str, Any]:
        request = turn.request
        incomplete = None
        if status is None:
            status = "completed"
            if finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
            elif finish_reason == "abort":
                status, incomplete = "incomplete", {"reason": None}
        input_tokens = len(turn.prepared.job.prompt.token_ids)
        usage = None
        if status != "in_progress":
            usage = ResponseUsage(
                input_tokens=input_tokens, input_tokens_details={"cached_tokens": cached_tokens},
                output_tokens=output_tokens,
                output_tokens_details={"reasoning_tokens": self._count_tokens(reasoning)},
                total_tokens=input_tokens + output_tokens)
        response = ResponseObject(
            id=turn.response_id, created_at=turn.created_at, status=status,
            incomplete_details=incomplete,
            model=self.chat.response_model_name(turn.prepared.job.lora_request),
            output=turn.items if status != "in_progress" else [],
            instructions=request.instructions, tools=request.tools or [],
            tool_choice=request.tool_choice or "auto",
            parallel_tool_calls=(request.parallel_tool_calls
                                 if request.parallel_tool_calls is not None else True),
            temperature=request.temperature, top_p=request.top_p,
            max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id, reasoning=request.reasoning,
            text=request.text or {"format": {"type": "text"}},
            truncation=request.truncation or "disabled",
            metadata=request.metadata or {},
            store=request.store if request.store is not None else True,
            user=request.user, usage=usage)
        return response.model_dump(mode="json")

    def _count_tokens(self, text: str | None) -> int:
        if not text or self.chat.tokenizer is None:
            return 0
        return len(self.chat.tokenizer.encode(text, add_special_tokens=False))

    def _store(self, turn: _Turn, response: dict[str, Any]) -> None:
        if turn.request.store is False:
            return
        conversation = turn.conversation + output_messages(turn.items)
        self.store.put(turn.response_id, StoredResponse(response, conversation))

    # -- streaming ------------------------------------------------------------------------
    async def _stream(self, turn: _Turn) -> AsyncIterator[str]:
        events = _EventWriter()
        items = _StreamedItems(events, turn.items)
        output_tokens, cached, finish_reason = 0, 0, None
        reasoning_parts: list[str] = []
        try:
            yield events.emit("response.created",
                              response=self._response(turn, None, 0, 0, None, "in_progress"))
            yield events.emit("response.in_progress",
                              response=self._response(turn, None, 0, 0, None, "in_progress"))
            prepared = turn.prepared
            batches = self.chat.iterate_deltas(prepared.job, prepared.options)
            async with contextlib.aclosing(batches) as deltas:
                async for batch in deltas:
                    output_tokens += batch.new_tokens
                    cached = batch.output.num_cached_tokens
                    for choice in batch.content:
                        delta = choice.delta
                        if delta.reasoning_content:
                            reasoning_parts.append(delta.reasoning_content)
                            yield items.reasoning(delta.reasoning_content)
                        if delta.content:
                            yield items.text(delta.content)
                        for call in delta.tool_calls or ():
                            yield items.tool_call(call)
                    for choice in batch.finished:
                        finish_reason = choice.finish_reason
            yield items.ensure_output() + items.close()
            response = self._response(turn, finish_reason, output_tokens, cached,
                                      "".join(reasoning_parts) or None)
            self._store(turn, response)
            kind = ("response.completed" if response["status"] == "completed"
                    else "response.incomplete")
            yield events.emit(kind, response=response)
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            error = to_api_error(exc)
            yield events.emit("error", code=str(error.status), message=error.message,
                              param=error.param)


class _EventWriter:
    """Server-sent events with increasing sequence numbers."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def emit(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"


class _StreamedItems:
    """Streamed deltas as output items: each method returns the events (SSE text) that
    open, extend and close items; an item of another kind closes the open one."""

    def __init__(self, events: _EventWriter, items: list[dict[str, Any]]) -> None:
        self.events = events
        self.items = items  # finished items, in output order
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.open_kind: str | None = None
        self.open_index: int | None = None  # chat tool-call index of an open function call
        self.parts: list[str] = []

    @property
    def output_index(self) -> int:
        return len(self.items)

    def _start(self, kind: str, item: dict[str, Any]) -> str:
        out = self.close()
        self.open, self.open_kind, self.parts = item, kind, []
        added = dict(item, status="in_progress")
        if kind == "message" or kind == "reasoning":
            added["content"] = []
        out += self.events.emit("response.output_item.added", output_index=self.output_index,
                                item=added)
        part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                if kind == "message" else {"type": "reasoning_text", "text": ""})
        if kind in ("message", "reasoning"):
            out += self.events.emit("response.content_part.added", item_id=item["id"],
                                    output_index=self.output_index, content_index=0, part=part)
        return out

    def reasoning(self, text: str) -> str:
        out = "" if self.open_kind == "reasoning" else self._start("reasoning",
                                                                   reasoning_item(""))
        self.parts.append(text)
        return out + self.events.emit("response.reasoning_text.delta",
                                      item_id=self.open["id"], output_index=self.output_index,
                                      content_index=0, delta=text)

    def text(self, text: str) -> str:
        out = "" if self.open_kind == "message" else self._start("message", message_item(""))
        self.parts.append(text)
        return out + self.events.emit("response.output_text.delta", item_id=self.open["id"],
                                      output_index=self.output_index, content_index=0,
                                      delta=text, logprobs=[])

    def tool_call(self, call: dict[str, Any]) -> str:
        out = ""
        if self.open_kind != "function_call" or call.get("index") != self.open_index:
            function = call.get("function", {})
            out = self._start("function_call", function_call_item(
                call.get("id") or _new_id("call"), function.get("name") or "", ""))
            self.open_index = call.get("index")
        arguments = call.get("function", {}).get("arguments") or ""
        if arguments:
            self.parts.append(arguments)
            out += self.events.emit("response.function_call_arguments.delta",
                                    item_id=self.open["id"], output_index=self.output_index,
                                    delta=arguments)
        return out

    def close(self) -> str:
        """Finish the open item (if any): its done events; it joins ``items``."""
        if self.open is None:
            return ""
        item, kind, text = self.open, self.open_kind, "".join(self.parts)
        index, out = self.output_index, ""
        if kind == "message":
            item = message_item(text, item["id"])
            part = item["content"][0]
            out += self.events.emit("response.output_text.done", item_id=item["id"],
                                    output_index=index, content_index=0, text=text, logprobs=[])
            out += self.events.emit("response.content_part.done", item_id=item["id"],
                                    output_index=index, content_index=0, part=part)
        elif kind == "reasoning":
            item = reasoning_item(text, item["id"])
            out += self.events.emit("response.reasoning_text.done", item_id=item["id"],
                                    output_index=index, content_index=0, text=text)
            out += self.events.emit("response.content_part.done", item_id=item["id"],
                                    output_index=index, content_index=0,
                                    part=item["content"][0])
        else:
            item = function_call_item(item["call_id"], item["name"], text, item["id"])
            out += self.events.emit("response.function_call_arguments.done",
                                    item_id=item["id"], output_index=index, arguments=text,
                                    name=item["name"])
        out += self.events.emit("response.output_item.done", output_index=index, item=item)
        self.items.append(item)
        self.open = self.open_kind = self.open_index = None
        self.parts = []
        return out

    def ensure_output(self) -> str:
        """An output with no items at all still answers with an (empty) message."""
        if self.items or self.open is not None:
            return ""
        return self._start("message", message_item(""))
