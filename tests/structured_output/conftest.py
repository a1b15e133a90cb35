"""Fixtures: the tiny test tokenizer (byte-level BPE, 384 ids) and grammar helpers."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="session")
def padded_model_dir(model_dir_factory):
    """A model whose logits (416 columns) are wider than its tokenizer (384 ids)."""
    return model_dir_factory("llama-gqa", vocab_size=416)
