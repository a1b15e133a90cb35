#!/usr/bin/env python3
"""Train the tiny demo models shipped in ``engine/assets/demo`` and ``engine/assets/demo-draft``.

The models exist so that the engine can be demonstrated and tested without
downloading anything. This script is run once by hand (never in CI); the
directories it writes are committed.

Pipeline (everything except the final model directories lives in ``--work-dir``):

1. ``apt-get download`` + ``dpkg-deb -x`` three Debian packages whose text is
   public domain or permissively licensed (see ``SOURCES``).
2. Clean the text into paragraphs, split it into documents and hold out a
   fixed ~2% of documents (chosen by hash, never trained on) for perplexity.
3. Train an 8k byte-level BPE tokenizer with a ChatML/Hermes chat template.
4. Add a small amount of synthetic chat / tool-call conversations.
5. Train a ~14M parameter Llama model and a ~2M parameter draft model with
   plain PyTorch on CPU for a fixed time budget each, checkpointing every few
   minutes so that an interrupted run continues with ``--resume``.
6. Evaluate held-out perplexity and export ordinary Hugging Face model
   directories (bfloat16 safetensors, tokenizer, generation config, model card).

Example::

    nohup python tools/train_demo_model.py --minutes 40 --draft-minutes 12 \\
        > /tmp/demo_train/train.log 2>&1 &
    # after an interruption, same arguments plus --resume
"""

from __future__ import annotations

import argparse
import copy
import gzip
import hashlib
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Must be set before OpenMP starts: on a shared (oversubscribed) CPU the default
# spin-waiting made 2-thread training ~7x slower than with passive waiting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 256
MAX_POSITIONS = 2048
VOCAB_SIZE = 8192
MAX_ASSET_BYTES = 34_000_000  # both model directories together (du -b)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# Ids 0..6 in this order. The tool-call markers are added tokens but not
# "special", so ``decode(..., skip_special_tokens=True)`` keeps them for parsing.
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END]
NON_SPECIAL_ADDED = {TOOL_CALL_START, TOOL_CALL_END}

# ChatML / Hermes style template, close to Qwen2.5's.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Source:
    """A Debian package that provides training text."""

    package: str
    title: str
    license: str


SOURCES = (
    Source("jargon-text", "The Jargon File 4.4.7 (Eric S. Raymond et al.)", "Public domain"),
    Source(
        "dict-devil",
        "The Devil's Dictionary (Ambrose Bierce, 1911 edition)",
        "Public domain (copyright expired)",
    ),
    Source(
        "python3.11-doc",
        "Python 3.11 documentation, reStructuredText sources",
        "PSF License Agreement (documentation); Copyright (c) 2001-2023 Python Software "
        "Foundation. All rights reserved.",
    ),
)


@dataclass
class Doc:
    """One training/held-out document."""

    source: str
    key: str
    text: str


@dataclass(frozen=True)
class ModelSpec:
    """Architecture and optimisation settings of one model."""

    name: str
    out_subdir: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    lr: float
    batch: int = 8
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1


MAIN = ModelSpec(
    "main", "demo", hidden=384, layers=7, heads=6, kv_heads=2, intermediate=960, lr=2e-3
)
DRAFT = ModelSpec(
    "draft", "demo-draft", hidden=128, layers=4, heads=2, kv_heads=1, intermediate=512, lr=3e-3
)


def log(msg: str) -> None:
    """Print a timestamped line (the log is read while the job runs)."""
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# --------------------------------------------------------------------------- sources


def fetch_packages(work: Path) -> tuple[Path, dict[str, str]]:
    """Download and unpack the source packages; return (root, {package: version})."""
    debs, root = work / "debs", work / "root"
    debs.mkdir(parents=True, exist_ok=True)
    versions = {}
    for src in SOURCES:
        if not list(debs.glob(f"{src.package}_*.deb")):
            subprocess.run(["apt-get", "download", src.package], cwd=debs, check=True)
        deb = max(debs.glob(f"{src.package}_*.deb"))
        versions[src.package] = subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True
        ).stdout.strip()
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root, versions


QUOTES = str.maketrans({"‘": "'", "’": "'", "“": '"', "”": '"', "\xa0": " "})
BULLET = re.compile(r"^(?:[*+-]|#\.|\d+\.|\(\d+\))\s")


def join_paragraph(lines: list[str], keep_lines: bool) -> str:
    """Join one block of lines: keep line structure for verse/code, reflow prose."""
    lines = [ln.rstrip() for ln in lines if ln.strip()]
    if not lines:
        return ""
    if keep_lines:
        indent = min(len(ln) - len(ln.lstrip()) for ln in lines)
        return "\n".join(ln[indent:] for ln in lines)
    out: list[str] = []
    for ln in lines:
        ln = ln.strip()
        if out and not BULLET.match(ln):
            out[-1] += " " + ln
        else:
            out.append(ln)
    return "\n".join(re.sub(r"\s+", " ", ln) for ln in out)


def blocks(lines: list[str]) -> list[list[str]]:
    """Split lines into blank-line separated blocks."""
    result: list[list[str]] = [[]]
    for ln in lines:
        if ln.strip():
            result[-1].append(ln)
        elif result[-1]:
            result.append([])
    return [b for b in result if b]


def indent_of(block: list[str]) -> int:
    """Smallest indentation of a block."""
    return min(len(ln) - len(ln.lstrip()) for ln in block)


def plain_paragraphs(lines: list[str], base_indent: int) -> list[str]:
    """Paragraphs of plain text; blocks indented beyond ``base_indent`` keep their lines."""
    paras = []
    for block in blocks(lines):
        text = join_paragraph(block, keep_lines=indent_of(block) >= base_indent + 4)
        if len(text) > 1:
            paras.append(text)
    return paras


def load_jargon(root: Path) -> list[Doc]:
    """The Jargon File: one document per introductory section and per glossary entry."""
    raw = gzip.decompress((root / "usr/share/doc/jargon-text/jargon.txt.gz").read_bytes())
    lines = raw.decode("utf-8").translate(QUOTES).split("\n")
    lines = lines[next(i for i, ln in enumerate(lines) if ln.startswith("Chapter 1.")) :]
    lines = [ln for ln in lines if not re.search(r"[─-╿]", ln)]  # box-drawing tables
    sections: list[tuple[str, list[str]]] = []
    for ln in lines:
        if ln and not ln[0].isspace():
            sections.append((ln.strip(), []))
        else:
            sections[-1][1].append(ln)

    def clean(text: str) -> str:
        return re.sub(r"\{([^{}]+)\}", r"\1", text)

    docs = []
    for heading, body in sections:
        if heading != "Glossary":
            paras = plain_paragraphs(body, base_indent=3)
            if paras:
                docs.append(Doc("jargon-text", heading, clean("\n\n".join([heading] + paras))))
            continue
        entry: tuple[str, list[str]] | None = None  # text before the first entry is an index
        for ln in body + ["   :END: "]:
            m = re.match(r"^   :(.+?):\s*(.*)$", ln)
            if m is None:
                if entry:
                    entry[1].append(ln)
                continue
            if entry:
                paras = [p for p in plain_paragraphs(entry[1], base_indent=3) if len(p) > 1]
                if paras:
                    docs.append(
                        Doc("jargon-text", entry[0], clean("\n\n".join([entry[0]] + paras)))
                    )
            term, rest = m.groups()
            entry = (f"{term}: {rest}".strip(), [])
    return docs


DICTD_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def dictd_number(s: str) -> int:
    """Decode a dictd base64 offset/length."""
    n = 0
    for ch in s:
        n = n * 64 + DICTD_ALPHABET.index(ch)
    return n


def load_devil(root: Path) -> list[Doc]:
    """The Devil's Dictionary: the preface plus one document per entry."""
    data = gzip.decompress((root / "usr/share/dictd/devil.dict.dz").read_bytes())
    docs = []
    for line in (root / "usr/share/dictd/devil.index").read_text().splitlines():
        word, off, length = line.split("\t")
        text = data[dictd_number(off) : dictd_number(off) + dictd_number(length)].decode("latin-1")
        if word == "00databaseinfo":
            text, word = text[text.index("PREFACE") :], "preface"
        elif word.startswith("00database"):
            continue
        text = re.sub(r"_([^_]+)_", r"\1", text)
        paras = plain_paragraphs(text.split("\n"), base_indent=0)
        if paras:
            docs.append(Doc("dict-devil", word, "\n\n".join(paras)))
    return docs


RST_ADORNMENT = re.compile(r"^\s*([=\-~^\"'`*+#:.<>_])\1{2,}\s*$")
RST_SIGNATURE = re.compile(
    r"^(?:py:)?(function|method|class|classmethod|staticmethod|attribute|data|exception|"
    r"decorator|decoratormethod|opcode|cmdoption|option|envvar|describe|pdbcommand|"
    r"abstractmethod|coroutinefunction|coroutinemethod|module|glossary|rubric|"
    r"productionlist)$"
)
RST_CODE = {
    "code-block",
    "sourcecode",
    "doctest",
    "testcode",
    "testoutput",
    "code",
    "parsed-literal",
}
RST_KEEP_BODY = {
    "note",
    "warning",
    "seealso",
    "impl-detail",
    "attention",
    "caution",
    "important",
    "tip",
    "hint",
    "admonition",
    "topic",
    "sidebar",
    "centered",
    "epigraph",
    "container",
}
RST_LABELS = {  # directives whose argument Sphinx renders as a sentence
    "versionadded": "New in version {}.",
    "versionchanged": "Changed in version {}:",
    "deprecated": "Deprecated since version {}:",
    "deprecated-removed": "Deprecated since version {}, will be removed in version {}:",
    "availability": "Availability: {}.",
}


def rst_inline(text: str) -> str:
    """Strip the most common inline reST markup."""
    text = re.sub(
        r":[\w:.-]+:`([^`]+)`", lambda m: re.sub(r"\s*<[^<>]+>$", "", m.group(1)).lstrip("~!"), text
    )
    text = re.sub(r"``(.+?)``", r"\1", text)
    text = re.sub(r"`([^`<]+?)\s*<[^<>]+>`__?", r"\1", text)
    text = re.sub(r"`([^`]+)`_{0,2}", r"\1", text)
    text = re.sub(r"\*\*(\S(?:.*?\S)?)\*\*", r"\1", text)
    text = re.sub(r"(?<![\w*])\*(\S(?:[^*]*?\S)?)\*(?![\w*])", r"\1", text)
    text = re.sub(r"\s*\[#\w*\]_", "", text)
    text = text.replace("\\ ", "")
    text = re.sub(r"\s+::$", "", text, flags=re.MULTILINE)
    return re.sub(r"::$", ":", text, flags=re.MULTILINE)


def rst_paragraphs(text: str) -> list[tuple[bool, str]]:
    """Convert a reST file to (is_heading, paragraph) pairs, stripping markup lightly."""
    lines = text.split("\n")
    # Section titles: a text line followed by an adornment line.
    out_lines: list[str] = []
    headings: set[int] = set()
    for i, ln in enumerate(lines):
        if RST_ADORNMENT.match(ln):
            if out_lines and out_lines[-1].strip() and i > 0 and lines[i - 1].strip():
                headings.add(len(out_lines) - 1)
            continue
        out_lines.append(ln)
    result: list[tuple[bool, str]] = []
    code_indent: int | None = None  # literal block / code directive: deeper blocks are code
    skip_indent: int | None = None  # unknown directive: deeper blocks are dropped
    pos = 0
    for block in blocks(out_lines):
        start = out_lines.index(block[0], pos)
        pos = start + len(block)
        ind = indent_of(block)
        if code_indent is not None and ind > code_indent:
            result.append((False, join_paragraph(block, keep_lines=True)))
            continue
        if skip_indent is not None and ind > skip_indent:
            continue
        code_indent = skip_indent = None
        if start in headings and len(block) == 1:
            result.append((True, rst_inline(block[0].strip())))
            continue
        first = block[0].strip()
        if first.startswith(">>>"):
            result.append((False, join_paragraph(block, keep_lines=True)))
            continue
        if first.startswith(".."):
            m = re.match(r"\.\.\s+([\w:-]+)::\s*(.*)$", first)
            if m is None:  # comment, link target or substitution definition
                skip_indent = ind
                continue
            name, arg = m.group(1), m.group(2)
            body = [ln for ln in block[1:] if not re.match(r"^\s*:[\w -]+:", ln)]
            if name in RST_CODE:
                code_indent = ind
                if body:
                    result.append((False, join_paragraph(body, keep_lines=True)))
            elif RST_SIGNATURE.match(name) or name in RST_KEEP_BODY or name in RST_LABELS:
                if RST_SIGNATURE.match(name) and arg:
                    result.append((False, rst_inline(arg)))
                if name in RST_KEEP_BODY and arg:
                    body = [arg] + body
                if name in RST_LABELS:
                    label = RST_LABELS[name]
                    parts = (arg.split() + [""] * 2)[: label.count("{}")]
                    body = [label.format(*parts)] + body
                if body:
                    result.append((False, rst_inline(join_paragraph(body, keep_lines=False))))
            else:
                skip_indent = ind
            continue
        if all(ln.lstrip().startswith(("+", "|")) for ln in block):  # tables
            continue
        para = rst_inline(join_paragraph(block, keep_lines=False))
        if block[-1].rstrip().endswith("::"):
            code_indent = ind
        if para.strip():
            result.append((False, para))
    return result


PYDOC_SKIP = ("c-api/", "distutils/", "includes/", "license.rst", "contents.rst", "copyright.rst")


def load_pydoc(root: Path) -> list[Doc]:
    """Python documentation: one document per section of each reST source file."""
    base = root / "usr/share/doc/python3.11/html/_sources"
    docs = []
    for path in sorted(base.rglob("*.rst.txt")):
        rel = path.relative_to(base).as_posix()
        if rel.startswith(PYDOC_SKIP) or "changelog" in rel:
            continue
        title, paras = rel, []
        for is_heading, para in rst_paragraphs(path.read_text(encoding="utf-8")) + [(True, "")]:
            if is_heading:
                if sum(len(p) for p in paras) > 200:
                    docs.append(Doc("python3.11-doc", f"{rel}#{title}", "\n\n".join(paras)))
                title, paras = para, [para]
            else:
                paras.append(para)
    return docs


def is_heldout(doc: Doc) -> bool:
    """Fixed ~2% split by hash of the document key (independent of everything else)."""
    digest = hashlib.sha256(f"{doc.source}/{doc.key}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 50 == 0


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], out_dir: Path) -> None:
    """Train the byte-level BPE tokenizer and write tokenizer.json + configs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
            ),
        ]
    )
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] not in NON_SPECIAL_ADDED
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False, indent=2))
    write_tokenizer_configs(spec, out_dir)


def write_tokenizer_configs(spec: dict, out_dir: Path) -> None:
    """Write tokenizer_config.json and special_tokens_map.json next to tokenizer.json."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "padding_side": "left",
        "added_tokens_decoder": {
            str(t["id"]): {
                k: t[k]
                for k in ("content", "lstrip", "rstrip", "normalized", "single_word", "special")
            }
            for t in spec["added_tokens"]
        },
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))


DEMO_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "Name of the city"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "define_word",
            "description": "Look up a word in the Devil's Dictionary.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "description": "The word to define"}},
                "required": ["word"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 2 + 2"}},
                "required": ["expression"],
            },
        },
    },
]


def check_tokenizer(tok_dir: Path) -> object:
    """Load the tokenizer with transformers and verify round-trips and the chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert type(tok).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend"), type(tok)
    sample = "The  hacker's\n\tcode: x = {'a': 1}  # naïve — ok\n"
    ids = tok(sample)["input_ids"]
    assert ids[0] == tok.bos_token_id == 0 and ids[1] != 0, ids[:3]
    assert tok.decode(ids, skip_special_tokens=True) == sample, tok.decode(ids)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(
        range(len(SPECIAL_TOKENS))
    )
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temperature": 21}'},
    ]
    text = tok.apply_chat_template(
        messages, tools=DEMO_TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert (
        text.startswith("<s><|im_start|>system\nYou are terse.\n\n# Tools") and "<tools>\n{" in text
    ), text
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>" in text, text
    assert text.endswith(
        '<|im_start|>tool\n{"temperature": 21}<|im_end|>\n<|im_start|>assistant\n'
    ), text
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert plain == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", plain
    call_ids = tok.encode(text, add_special_tokens=False)
    # Two <tool_call> markers in the instructions plus the call itself.
    assert call_ids.count(tok.convert_tokens_to_ids(TOOL_CALL_START)) == 3
    assert TOOL_CALL_START in tok.decode(call_ids, skip_special_tokens=True)
    return tok


# --------------------------------------------------------------------------- synthetic chats


def first_prose(text: str, limit: int = 400) -> str:
    """First reflowed paragraph after the header paragraph, cut at a sentence end."""
    paras = [p for p in text.split("\n\n")[1:] if "\n" not in p] or [text.split("\n\n")[0]]
    para = paras[0]
    if len(para) > limit:
        cut = para.rfind(". ", 0, limit)
        para = para[: cut + 1] if cut > 0 else para[:limit]
    return para


def synthetic_chats(train_docs: list[Doc], tok: object, rng: random.Random) -> list[str]:
    """Chat-formatted conversations (definitions and tool calls) rendered with the template."""
    devil = []
    for d in train_docs:
        m = re.match(r"^([A-Z][A-Z' -]*[A-Z]), ((?:\w+\. ?)+)\s+(.+)", d.text.split("\n")[0])
        if d.source == "dict-devil" and m:
            devil.append(
                (m.group(1).lower(), m.group(1) + ", " + m.group(2).strip() + " " + m.group(3))
            )
    jargon = [
        (d.key.split(":")[0], first_prose(d.text))
        for d in train_docs
        if d.source == "jargon-text" and ":" in d.key and "\n\n" in d.text
    ]
    systems = [
        None,
        None,
        "You are a helpful assistant.",
        "You are a cynical lexicographer.",
        "Answer briefly.",
    ]
    devil_q = [
        "Define {w}.",
        "What does {w} mean?",
        "What is the Devil's Dictionary definition of {w}?",
        "Give me a cynical definition of {w}.",
        "{W}?",
        "How would Ambrose Bierce define {w}?",
    ]
    jargon_q = [
        "What does {w} mean in hacker slang?",
        "Explain the jargon term {w}.",
        "What is {w}?",
        "In the Jargon File, what is {w}?",
    ]
    chats: list[list[dict]] = []

    def with_system(msgs: list[dict]) -> list[dict]:
        system = rng.choice(systems)
        return ([{"role": "system", "content": system}] if system else []) + msgs

    def qa(word: str, answer: str, questions: list[str]) -> list[dict]:
        q = rng.choice(questions).format(w=word, W=word.capitalize())
        return [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]

    for word, definition in devil:
        msgs = qa(word, first_prose("x\n\n" + definition), devil_q)
        if rng.random() < 0.2:
            msgs += qa(*rng.choice(devil), devil_q)
        chats.append(with_system(msgs))
    for word, definition in rng.sample(jargon, min(len(jargon), 400)):
        chats.append(with_system(qa(word, definition, jargon_q)))

    cities = [
        "Paris",
        "London",
        "Tokyo",
        "Berlin",
        "Lagos",
        "Lima",
        "Oslo",
        "Cairo",
        "Delhi",
        "Boston",
        "Rome",
    ]
    skies = ["sunny", "cloudy", "raining", "snowing", "windy", "foggy"]
    tool_chats = []
    for _ in range(150):
        kind = rng.choice(["weather", "define", "calc", "none"])
        if kind == "weather":
            city, unit = rng.choice(cities), rng.choice(["celsius", "fahrenheit"])
            temp, sky = (
                rng.randint(-5, 35) if unit == "celsius" else rng.randint(25, 95),
                rng.choice(skies),
            )
            q = rng.choice(
                [
                    "What is the weather in {c}?",
                    "Is it cold in {c} today?",
                    "Weather for {c}, please.",
                ]
            )
            args = {"city": city, "unit": unit}
            result = {"city": city, "temperature": temp, "unit": unit, "sky": sky}
            answer = f"It is {temp} degrees {unit.capitalize()} and {sky} in {city}."
            call = ("get_weather", args, q.format(c=city))
        elif kind == "define":
            word, definition = rng.choice(devil)
            q = rng.choice(
                ["Look up {w} in the dictionary.", "Use the dictionary to define {w}."]
            ).format(w=word)
            answer = first_prose("x\n\n" + definition)
            result = {"word": word, "definition": answer}
            call = ("define_word", {"word": word}, q)
        elif kind == "calc":
            a, b, op = rng.randint(2, 999), rng.randint(2, 999), rng.choice("+-*")
            value = {"+": a + b, "-": a - b, "*": a * b}[op]
            expr = f"{a} {op} {b}"
            q = rng.choice(["What is {e}?", "Calculate {e}.", "Compute {e} for me."]).format(e=expr)
            result, answer = {"result": value}, f"{expr} = {value}."
            call = ("calculator", {"expression": expr}, q)
        else:
            word, definition = rng.choice(devil)
            tool_chats.append(
                (with_system(qa(word, first_prose("x\n\n" + definition), devil_q)), DEMO_TOOLS)
            )
            continue
        name, args, question = call
        tools = rng.sample(DEMO_TOOLS, rng.randint(1, len(DEMO_TOOLS)))
        if not any(t["function"]["name"] == name for t in tools):
            tools.append(next(t for t in DEMO_TOOLS if t["function"]["name"] == name))
        msgs = [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}],
            },
            {"role": "tool", "content": json.dumps(result)},
            {"role": "assistant", "content": answer},
        ]
        tool_chats.append((with_system(msgs), tools))

    rendered = [tok.apply_chat_template(c, tokenize=False) for c in chats]
    rendered += [tok.apply_chat_template(c, tools=t, tokenize=False) for c, t in tool_chats]
    rng.shuffle(rendered)
    return rendered


# --------------------------------------------------------------------------- data


@dataclass
class DataMeta:
    """What went into the token streams (written into the model cards)."""

    versions: dict[str, str]
    docs: dict[str, int]
    heldout_docs: dict[str, int]
    train_tokens: dict[str, int]
    heldout_tokens: int
    repeats: dict[str, int]
    command: str
    seed: int


# Documents of the small literary sources are repeated to balance the mix.
REPEATS = {"jargon-text": 2, "dict-devil": 3, "python3.11-doc": 1, "chat": 1}


def prepare_data(work: Path, seed: int, command: str) -> tuple[dict[str, torch.Tensor], DataMeta]:
    """Fetch, clean, split, train the tokenizer and tokenize; cached in ``work/data.pt``."""
    root, versions = fetch_packages(work)
    docs = load_jargon(root) + load_devil(root) + load_pydoc(root)
    train_docs = [d for d in docs if not is_heldout(d)]
    heldout_docs = [d for d in docs if is_heldout(d)]

    def count(ds: list[Doc]) -> dict[str, int]:
        return {s.package: sum(d.source == s.package for d in ds) for s in SOURCES}

    log(f"documents: {count(docs)}; held out: {count(heldout_docs)}")
    chars = {s.package: sum(len(d.text) for d in docs if d.source == s.package) for s in SOURCES}
    log(f"characters: {chars}")

    tok_dir = work / "tokenizer"
    t0 = time.time()
    train_tokenizer([d.text for d in train_docs], tok_dir)
    tok = check_tokenizer(tok_dir)
    log(f"tokenizer: vocab {len(tok)} trained in {time.time() - t0:.0f}s and verified")

    rng = random.Random(seed)
    chats = synthetic_chats(train_docs, tok, rng)

    def encode(texts: list[str], add_bos: bool) -> list[list[int]]:
        # Plain text gets <s> from the post-processor; rendered chats already start with it.
        return [
            e.ids + [tok.eos_token_id]
            for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=add_bos)
        ]

    pieces = [
        (d.source, ids) for d, ids in zip(train_docs, encode([d.text for d in train_docs], True))
    ]
    pieces = [p for p in pieces for _ in range(REPEATS[p[0]])]
    pieces += [("chat", ids) for ids in encode(chats, False)]
    rng.shuffle(pieces)
    train_tokens = {name: 0 for name in REPEATS}
    stream: list[int] = []
    for source, ids in pieces:
        stream += ids
        train_tokens[source] += len(ids)
    heldout = [i for ids in encode([d.text for d in heldout_docs], True) for i in ids]
    meta = DataMeta(
        versions=versions,
        docs=count(train_docs),
        heldout_docs=count(heldout_docs),
        train_tokens=train_tokens,
        heldout_tokens=len(heldout),
        repeats=REPEATS,
        command=command,
        seed=seed,
    )
    data = {
        "train": torch.tensor(stream, dtype=torch.int32),
        "heldout": torch.tensor(heldout, dtype=torch.int32),
    }
    log(
        f"train tokens by source: {train_tokens} (total {len(stream)}); "
        f"held-out tokens {len(heldout)}"
    )
    torch.save({"data": data, "meta": asdict(meta)}, work / "data.pt")
    return data, meta


# --------------------------------------------------------------------------- model


def llama_config(spec: ModelSpec) -> object:
    """The transformers LlamaConfig for a spec."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        attention_bias=False,
        mlp_bias=False,
    )


def build_model(spec: ModelSpec, seed: int) -> torch.nn.Module:
    """A freshly initialised LlamaForCausalLM (fp32 master weights)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(spec))


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of a [B, T+1] batch."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


@dataclass
class TrainState:
    """Progress carried across checkpoints."""

    step: int = 0
    elapsed: float = 0.0  # seconds spent training (excludes checkpointing/eval)
    tokens: int = 0
    done: bool = False
    resumed: int = 0
    threads: int = 0
    autocast: bool = True
    losses: list[float] = field(default_factory=list)


def lr_at(spec: ModelSpec, state: TrainState, budget: float) -> float:
    """Linear warmup (steps), then cosine decay over the time budget."""
    if state.step < spec.warmup_steps:
        return spec.lr * (state.step + 1) / spec.warmup_steps
    progress = min(1.0, state.elapsed / budget)
    return spec.lr * (
        spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def train(
    spec: ModelSpec,
    data: torch.Tensor,
    minutes: float,
    work: Path,
    seed: int,
    resume: bool,
    autocast: bool,
    ckpt_minutes: float,
) -> tuple[torch.nn.Module, TrainState]:
    """Train one model for ``minutes`` of training time, checkpointing to ``work``."""
    model = build_model(spec, seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optim = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": spec.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=spec.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    state = TrainState()
    ckpt = work / f"ckpt_{spec.name}.pt"
    if resume and ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        gen.set_state(saved["gen"])
        state = TrainState(**saved["state"])
        state.resumed += 1
        # A larger --minutes extends a finished run (e.g. when shared CPUs ran it slowly).
        state.done = state.done and state.elapsed >= minutes * 60
        log(f"[{spec.name}] resumed at step {state.step}, {state.elapsed / 60:.1f} min trained")

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save(
            {
                "model": model.state_dict(),
                "optim": optim.state_dict(),
                "gen": gen.get_state(),
                "state": asdict(state),
            },
            tmp,
        )
        os.replace(tmp, ckpt)

    budget = minutes * 60
    state.threads, state.autocast = torch.get_num_threads(), autocast
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"[{spec.name}] {n_params / 1e6:.2f}M parameters, budget {minutes} min, "
        f"autocast bf16={autocast}"
    )
    model.train()
    last_ckpt, window_t, window_tok = time.time(), time.time(), 0
    while not state.done and state.elapsed < budget:
        t0 = time.time()
        for group in optim.param_groups:
            group["lr"] = lr_at(spec, state, budget)
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (spec.batch,), generator=gen)
        batch = torch.stack([data[s : s + SEQ_LEN + 1] for s in starts.tolist()]).long()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens += batch[:, 1:].numel()
        state.elapsed += time.time() - t0
        state.losses.append(round(loss.item(), 4))
        window_tok += batch[:, 1:].numel()
        if state.step % 25 == 0:
            recent = state.losses[-25:]
            log(
                f"[{spec.name}] step {state.step} loss {sum(recent) / len(recent):.3f} "
                f"lr {optim.param_groups[0]['lr']:.2e} "
                f"{window_tok / (time.time() - window_t):.0f} tok/s "
                f"trained {state.elapsed / 60:.1f}/{minutes} min, {state.tokens / 1e6:.2f}M tokens"
            )
            window_t, window_tok = time.time(), 0
        if time.time() - last_ckpt > ckpt_minutes * 60:
            save()
            last_ckpt = time.time()
    state.done = True
    save()
    return model, state


@torch.no_grad()
def heldout_perplexity(model: torch.nn.Module, heldout: torch.Tensor) -> tuple[float, int]:
    """Per-token perplexity of the (bfloat16) model on non-overlapping held-out windows."""
    model.eval()
    n = (len(heldout) - 1) // SEQ_LEN
    windows = torch.stack([heldout[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1] for i in range(n)]).long()
    total, count = 0.0, 0
    for batch in windows.split(16):
        logits = model(input_ids=batch[:, :-1]).logits.float()
        total += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += batch[:, 1:].numel()
    return math.exp(total / count), count


@torch.no_grad()
def greedy_sample(model: torch.nn.Module, tok: object, prompt: str, new_tokens: int = 40) -> str:
    """Greedy continuation, for the log and the model card."""
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=False)


# --------------------------------------------------------------------------- export


def model_card(
    spec: ModelSpec,
    n_params: int,
    weight_bytes: int,
    ppl: float,
    ppl_tokens: int,
    state: TrainState,
    meta: DataMeta,
    sample: str,
    chat_sample: str,
    other: str,
) -> str:
    """README.md for one exported model."""
    rows = "\n".join(
        f"| {s.title} | `{s.package}` {meta.versions[s.package]} | {s.license} "
        f"| {meta.docs[s.package]} / {meta.heldout_docs[s.package]} "
        f"| {meta.train_tokens[s.package]:,} |"
        for s in SOURCES
    )
    role = "main demo model" if spec is MAIN else "draft model for speculative decoding with `demo`"
    specials = ", ".join(f"`{t}`" for t in SPECIAL_TOKENS)
    precision = "bf16 autocast" if state.autocast else "fp32"
    final_loss = sum(state.losses[-50:]) / max(1, len(state.losses[-50:]))
    resumed = f" (resumed {state.resumed} time(s) with --resume)" if state.resumed else ""
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [llama, tiny, demo]
---

# engine {spec.out_subdir}: tiny Llama {role}

A {n_params / 1e6:.2f}M parameter `LlamaForCausalLM` trained from scratch on CPU by
`tools/train_demo_model.py`. It exists so that the engine can be demonstrated and
tested offline; it writes English-looking text but knows almost nothing.
Sibling model: `{other}` (same tokenizer).

## Architecture

| | |
|---|---|
| parameters | {n_params:,} (tied input/output embeddings) |
| weights | bfloat16 safetensors, {weight_bytes:,} bytes |
| layers / hidden / MLP | {spec.layers} / {spec.hidden} / {spec.intermediate} |
| attention | {spec.heads} query / {spec.kv_heads} KV heads (GQA), head_dim 64, RoPE theta 1e4 |
| vocabulary | {VOCAB_SIZE} byte-level BPE; specials {specials} (ids 0-6) |
| context | trained on {SEQ_LEN}-token windows; max_position_embeddings {MAX_POSITIONS} |
| chat format | ChatML (`<|im_start|>role ... <|im_end|>`), Hermes-style `<tool_call>` tool calls |

## Training data

Text extracted from Debian packages (`apt-get download`, `dpkg-deb -x`), cleaned
into paragraphs. About 2% of the documents (fixed by a hash of their key) are
held out and never trained on. Plus {meta.train_tokens["chat"]:,} tokens of synthetic
chat-formatted conversations built from templates (dictionary definitions, tool calls).

| source | package | license | documents train / held out | training-stream tokens |
|---|---|---|---|---|
{rows}

Documents repeated in the training stream: {meta.repeats}.

## Training

- {state.step:,} steps of {spec.batch} x {SEQ_LEN} tokens ({state.tokens / 1e6:.2f}M tokens),
  {state.elapsed / 60:.1f} minutes on {state.threads} CPU threads ({precision}),
  AdamW (0.9, 0.95), peak LR {spec.lr}, cosine decay over the time budget,
  weight decay {spec.weight_decay}, seed {meta.seed}.
- final training loss (mean of last 50 steps): {final_loss:.3f}
- **held-out perplexity: {ppl:.2f} per token** ({ppl_tokens:,} held-out tokens, bfloat16 weights)
- command: `{meta.command}`{resumed}

## Samples (greedy)

`The hacker` ->
```
{sample}
```

Chat (`Define cynic.`) ->
```
{chat_sample}
```
"""


def export(
    spec: ModelSpec,
    model: torch.nn.Module,
    state: TrainState,
    meta: DataMeta,
    work: Path,
    out_root: Path,
    heldout: torch.Tensor,
) -> float:
    """Evaluate and write the Hugging Face model directory; return the held-out perplexity."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(work / "tokenizer")
    model = copy.deepcopy(model).to(torch.bfloat16).eval()
    t0 = time.time()
    ppl, ppl_tokens = heldout_perplexity(model, heldout)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)],
        pad_token_id=tok.pad_token_id,
    )
    sample = greedy_sample(model, tok, "The hacker")
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Define cynic."}], tokenize=False, add_generation_prompt=True
    )
    chat_sample = greedy_sample(model, tok, chat.removeprefix(BOS), new_tokens=60)
    log(
        f"[{spec.name}] held-out perplexity {ppl:.2f} over {ppl_tokens} tokens "
        f"({time.time() - t0:.0f}s)"
    )
    log(f"[{spec.name}] 'The hacker' -> {sample!r}")
    log(f"[{spec.name}] chat -> {chat_sample!r}")

    out = out_root / spec.out_subdir
    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out, safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"  # older readers; transformers 5 writes "dtype"
    config["dtype"] = "bfloat16"
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]  # older readers
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((work / "tokenizer" / name).read_bytes())
    for path in out.iterdir():
        path.chmod(0o644)
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = (out / "model.safetensors").stat().st_size
    other = (DRAFT if spec is MAIN else MAIN).out_subdir
    (out / "README.md").write_text(
        model_card(
            spec, n_params, weight_bytes, ppl, ppl_tokens, state, meta, sample, chat_sample, other
        )
    )
    log(f"[{spec.name}] exported to {out}")
    return ppl


def dir_bytes(path: Path) -> int:
    """Apparent size of a directory tree (like ``du -b``)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) + (
        path.stat().st_size if path.exists() else 0
    )


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/tmp/demo_train"),
        help="downloads, data, checkpoints",
    )
    p.add_argument(
        "--out-dir", type=Path, default=REPO_ROOT / "engine" / "assets", help="parent of demo*/"
    )
    p.add_argument(
        "--minutes", type=float, default=40.0, help="training time budget of the main model"
    )
    p.add_argument(
        "--draft-minutes", type=float, default=12.0, help="training time budget of the draft model"
    )
    p.add_argument("--models", choices=["both", "main", "draft"], default="both")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--ckpt-minutes", type=float, default=3.0, help="checkpoint interval (wall clock)"
    )
    p.add_argument(
        "--no-autocast",
        action="store_true",
        help="train in fp32 (bf16 autocast measured ~1.7x faster)",
    )
    p.add_argument(
        "--resume", action="store_true", help="reuse prepared data and continue from checkpoints"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the whole pipeline."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(
        ["python", "tools/train_demo_model.py"] + (sys.argv[1:] if argv is None else argv)
    )
    command = command.replace(" --resume", "")
    if args.work_dir.resolve().is_relative_to(REPO_ROOT):
        raise SystemExit("--work-dir must be outside the repository")
    cache = args.work_dir / "data.pt"
    if args.resume and cache.exists():
        saved = torch.load(cache, weights_only=False)
        data, meta = saved["data"], DataMeta(**saved["meta"])
        log(f"resume: loaded prepared data ({len(data['train'])} train tokens)")
    else:
        for stale in args.work_dir.glob("ckpt_*.pt"):
            stale.unlink()
        data, meta = prepare_data(args.work_dir, args.seed, command)
    specs = {"both": [DRAFT, MAIN], "main": [MAIN], "draft": [DRAFT]}[args.models]
    for spec in specs:
        minutes = args.minutes if spec is MAIN else args.draft_minutes
        model, state = train(
            spec,
            data["train"],
            minutes,
            args.work_dir,
            args.seed,
            args.resume,
            not args.no_autocast,
            args.ckpt_minutes,
        )
        export(spec, model, state, meta, args.work_dir, args.out_dir, data["heldout"])
    total = sum(dir_bytes(args.out_dir / s.out_subdir) for s in (MAIN, DRAFT))
    log(f"model directories total {total:,} bytes (limit {MAX_ASSET_BYTES:,})")
    if total > MAX_ASSET_BYTES:
        raise SystemExit("model directories exceed the size limit")


if __name__ == "__main__":
    main()
