"""What a pooling model is and how it pools, read from its directory.

``--runner pooling`` (or ``auto`` on an embedder / classifier checkpoint) serves a model
for pooling instead of generation; ``--convert`` says what it turns the hidden states
into: ``embed``, ``classify`` (scores too) or ``reward``. ``auto`` reads both from the
architecture (``*ForSequenceClassification`` -> classify, ``*ForRewardModel`` -> reward,
a bare ``*Model`` or a sentence-transformers directory -> embed).

A sentence-transformers directory adds (as sentence-transformers itself reads them):
``modules.json`` (a ``Normalize`` module: embeddings are L2-normalized by default; Dense
modules after pooling), ``1_Pooling/config.json`` (CLS / mean / last-token pooling),
``config_sentence_transformers.json`` (named prompts and the default one) and
``sentence_bert_config.json`` (``max_seq_length``: the default max_model_len).
Plain Python on JSON files: the front end reads it without torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Runner = Literal["generate", "pooling"]
Convert = Literal["none", "embed", "classify", "reward"]

_ST_POOLING_MODES = {  # 1_Pooling/config.json flag (sentence-transformers < 6) -> type
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_POOLING_NAMES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}  # >= 6: "pooling_mode"


class PoolerConfig(BaseModel):
    """The resolved pooling behaviour of one model."""

    model_config = ConfigDict(extra="forbid")

    task: Literal["embed", "classify", "reward"] = "embed"
    # CLS / MEAN / LAST / ALL; None: the model class's default for its task.
    pooling_type: str | None = None
    normalize: bool = True  # embeddings' default (sentence-transformers: a Normalize module)
    dense_modules: list[str] = []  # sentence-transformers Dense module dirs, in order
    prompts: dict[str, str] = {}
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    do_lower_case: bool = False
    # Classifier built from an LM head's rows (vLLM's hf_overrides
    # ``classifier_from_token``, e.g. Qwen3-Reranker's ["no", "yes"]): the tokens whose
    # logits score; two tokens score by the 2-way softmax (the logit difference).
    classifier_from_token: list[str] = []
    # classify / score: whether the activation (sigmoid of one logit, softmax over
    # several) applies by default; a sentence-transformers CrossEncoder's activation_fn
    # Identity turns it off, as CrossEncoder.predict returns raw logits then.
    activation: bool = True

    def prompt_text(self, prompt_name: str | None) -> str:
        """The text prepended to an input (the named prompt, else the default one)."""
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            raise ValueError(f"unknown prompt name {name!r}; the model has "
                             f"{sorted(self.prompts) or 'no prompts'}")
        return self.prompts[name]


def default_runner(is_pooling_model: bool, model_dir: str | Path) -> Runner:
    """``--runner auto``: pooling for a class that only pools (an encoder, a bare
    ``*Model`` decoder, a sequence classifier) or a sentence-transformers directory."""
    if is_pooling_model or (Path(model_dir) / "modules.json").is_file():
        return "pooling"
    return "generate"


def default_convert(architecture: str) -> Convert:
    if architecture.endswith("ForSequenceClassification"):
        return "classify"
    if architecture.endswith("ForRewardModel"):
        return "reward"
    return "embed"


def resolve_pooler_config(model_dir: str | Path, architecture: str, convert: str = "auto",
                          hf_overrides: dict[str, Any] | None = None) -> PoolerConfig:
    """The pooler of the model in ``model_dir`` for ``convert`` (``auto``: from the
    architecture); ValueError naming a malformed sentence-transformers file."""
    task = default_convert(architecture) if convert in ("auto", None) else convert
    if task not in ("embed", "classify", "reward"):
        raise ValueError(f"convert must be auto, embed, classify or reward, not {convert!r}")
    fields: dict[str, Any] = {"task": task}
    path = Path(model_dir)
    modules = _read_json(path / "modules.json")
    if isinstance(modules, list):
        fields.update(_from_modules(path, modules))
    st_config = _read_json(path / "config_sentence_transformers.json")
    if isinstance(st_config, dict):
        prompts = st_config.get("prompts") or {}
        if not isinstance(prompts, dict):
            raise ValueError(f"{path / 'config_sentence_transformers.json'}: prompts must "
                             "be an object")
        fields["prompts"] = {str(k): str(v) for k, v in prompts.items()}
        default = st_config.get("default_prompt_name")
        if default is not None:
            fields["default_prompt_name"] = str(default)
        if st_config.get("activation_fn"):
            fields["activation"] = _activation_applies(st_config["activation_fn"])
    bert_config = _read_json(path / "sentence_bert_config.json")
    if isinstance(bert_config, dict):
        if isinstance(bert_config.get("max_seq_length"), int):
            fields["max_seq_length"] = bert_config["max_seq_length"]
        fields["do_lower_case"] = bool(bert_config.get("do_lower_case", False))
    if "max_seq_length" not in fields and isinstance(modules, list):
        # sentence-transformers >= 6 keeps it as the tokenizer's model_max_length
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        limit = tokenizer_config.get("model_max_length") if isinstance(
            tokenizer_config, dict) else None
        if isinstance(limit, int) and 0 < limit < 1_000_000:
            fields["max_seq_length"] = limit
    hf_config = _read_json(path / "config.json")
    legacy = hf_config.get("sentence_transformers") if isinstance(hf_config, dict) else None
    if isinstance(legacy, dict) and legacy.get("activation_fn") and "activation" not in fields:
        fields["activation"] = _activation_applies(legacy["activation_fn"])  # ST < 4 saves
    overrides = hf_overrides or {}
    if overrides.get("classifier_from_token"):
        fields["classifier_from_token"] = [str(t) for t in overrides["classifier_from_token"]]
    config = PoolerConfig(**fields)
    if config.default_prompt_name is not None:
        config.prompt_text(None)  # an unknown default prompt fails here
    return config


def _from_modules(path: Path, modules: list[Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {"normalize": False, "dense_modules": []}
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        where = str(module.get("path", "")) if isinstance(module, dict) else ""
        if kind.endswith(".Normalize"):
            fields["normalize"] = True
        elif kind.endswith(".Pooling"):
            pooling = _read_json(path / where / "config.json")
            if isinstance(pooling, dict):
                fields["pooling_type"] = _st_pooling_type(pooling, path / where)
        elif kind.endswith(".Dense"):
            fields["dense_modules"].append(where)
    return fields


def _st_pooling_type(pooling: dict[str, Any], where: Path) -> str | None:
    """The one token selection a sentence-transformers Pooling config names."""
    mode = pooling.get("pooling_mode")
    if isinstance(mode, str):
        names = [mode]
    elif isinstance(mode, (list, tuple)):
        names = [str(m) for m in mode]
    else:  # the flags of sentence-transformers < 6
        names = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v is True]
        names = [_ST_POOLING_MODES.get(k, k) for k in names]
    types = [_ST_POOLING_NAMES.get(n, n) for n in names]
    unsupported = [t for t in types if t not in ("CLS", "MEAN", "LAST")]
    if unsupported or len(types) > 1:
        raise ValueError(f"{where / 'config.json'}: pooling {unsupported or names} is not "
                         "supported (one of cls, mean, lasttoken)")
    if types and types[0] == "MEAN" and pooling.get("include_prompt") is False:
        raise ValueError(f"{where / 'config.json'}: mean pooling without the prompt "
                         "tokens (include_prompt false) is not supported")
    return types[0] if types else None


def _activation_applies(activation_fn: Any) -> bool:
    """A CrossEncoder's activation_fn: Identity means raw logits; Sigmoid (and any other
    squashing function) means the engine's default activation."""
    return not str(activation_fn).endswith(".Identity")


def _read_json(file: Path) -> Any:
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
