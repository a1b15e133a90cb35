"""Tool-call parsers for the model families beside Hermes (vLLM's names).

=============== ==========================================================================
``llama3_json`` ``<|python_tag|>`` (optional) then ``{"name": ..., "parameters": {...}}``
                objects separated by ``;`` (Llama 3.1 / 3.2 JSON tool calling)
``mistral``     ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
                ``[TOOL_CALLS]name[ARGS]{...}`` (repeated per call)
``pythonic``    ``[get_weather(city="Paris"), get_time()]`` (Llama 3.2 / 4 pythonic)
``qwen3_coder`` ``<tool_call><function=NAME><parameter=P>value</parameter>...</function>
                </tool_call>``; values typed by the request's tool schemas
``granite``     ``<|tool_call|>`` or ``<tool_call>`` then a JSON list of calls
``deepseek_v3`` ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``
                and a ```` ```json ```` block per call (V3.1's ``NAME<｜tool▁sep｜>{...}`` too)
``openai``      GPT-OSS harmony messages: ``<|channel|>commentary to=functions.NAME
                <|constrain|>json<|message|>{...}<|call|>``; ``final`` channel is content
=============== ==========================================================================

Each is registered by the in-tree ``tool_parsers`` plugin
(:mod:`engine.structured_output.tool_parsers.plugin`) through the
``engine_register_tool_parsers`` hook, as a third party's parser would be.
"""

from engine.structured_output.tool_parsers._common import (
    Location,
    PartialCall,
    RegionParse,
    RegionToolParser,
)

__all__ = ["Location", "PartialCall", "RegionParse", "RegionToolParser"]
