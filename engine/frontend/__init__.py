"""The front end: what runs in the process that talks to users, beside (not inside) the
engine core.

Prompts (text, token ids, chat messages, images) become validated ``EngineCoreRequest``s
(:mod:`.processor`, :mod:`.chat_template`, :mod:`.pooling_processor`; images through
:mod:`engine.multimodal`), and the core's step outputs become ``RequestOutput``s
(:mod:`.output_processor`: incremental detokenization, stop strings, logprobs, n > 1
aggregation). :mod:`.llm_engine` joins the two with an engine-core client for the
offline API. It depends on ``engine.core`` (requests, outputs, clients), never the other
way round: the core process imports none of it.
"""
