"""The remembered tokenizer class: a second load of the same files builds the class
AutoTokenizer chose without asking AutoTokenizer (so without loading the model's
config), and the tokenizer it gives encodes, decodes and renders chat exactly as
AutoTokenizer's does."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.assets import demo_model_path
from engine.core import tokenizer_choice
from engine.core.tokenizer import load_tokenizer

TEXTS = ["Hello world", "  leading spaces and\ttabs\n", "über 日本語 <|im_start|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(autouse=True)
def choices_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setattr(tokenizer_choice, "cache_dirs", lambda kind: [root / kind])
    monkeypatch.delenv(tokenizer_choice.CHOICE_ENV, raising=False)
    return root / "tokenizers"


def demo_tokenizer(tmp_path):
    path = tmp_path / "demo-tok"
    shutil.copytree(demo_model_path(), path,
                    ignore=shutil.ignore_patterns("*.safetensors", "README.md"))
    return path


def byte_level_tokenizer(tmp_path):
    """A GPT-2 style byte-level BPE tokenizer, trained here, with a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world the quick brown fox"] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    path = tmp_path / "bytelevel-tok"
    fast.save_pretrained(path)
    return path


def behaviour(tokenizer) -> tuple:
    ids = [tokenizer.encode(t) for t in TEXTS]
    return (
        type(tokenizer),
        ids,
        [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS],
        [tokenizer.decode(i) for i in ids],
        [tokenizer.decode(i, skip_special_tokens=True) for i in ids],
        tokenizer.convert_ids_to_tokens(ids[0]),
        tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.all_special_ids,
        len(tokenizer), tokenizer.get_vocab(),
        tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
    )


@pytest.mark.parametrize("make", [demo_tokenizer, byte_level_tokenizer])
def test_second_load_skips_auto_tokenizer_and_behaves_the_same(tmp_path, monkeypatch, make,
                                                              choices_dir):
    path = make(tmp_path)
    reference = AutoTokenizer.from_pretrained(str(path))
    first = load_tokenizer(path)
    assert len(list(choices_dir.glob("*.json"))) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer called although a choice is recorded")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    second = load_tokenizer(path)
    assert behaviour(second) == behaviour(first) == behaviour(reference)


def test_changed_files_are_a_new_choice(tmp_path, choices_dir):
    path = demo_tokenizer(tmp_path)
    load_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(path)
    assert len(list(choices_dir.glob("*.json"))) == 2
    assert tok.apply_chat_template(CHAT, tokenize=False) == "Be brief."


def test_unusable_record_falls_back_to_auto_tokenizer(tmp_path, choices_dir):
    path = demo_tokenizer(tmp_path)
    load_tokenizer(path)
    (entry,) = choices_dir.glob("*.json")
    entry.write_text(json.dumps({"format": tokenizer_choice.FORMAT, "module": "no.such.module",
                                 "qualname": "Nothing"}))
    assert behaviour(load_tokenizer(path)) == behaviour(AutoTokenizer.from_pretrained(str(path)))


def test_a_class_that_loads_differently_alone_is_not_recorded(tmp_path, monkeypatch,
                                                              choices_dir):
    path = demo_tokenizer(tmp_path)
    chosen = AutoTokenizer.from_pretrained(str(path))
    original = type(chosen).from_pretrained.__func__

    def drifting(cls, *args, **kwargs):
        tok = original(cls, *args, **kwargs)
        tok.chat_template = "{{ 'other' }}"
        return tok

    monkeypatch.setattr(type(chosen), "from_pretrained", classmethod(drifting))
    assert tokenizer_choice.TokenizerChoices().record(path, chosen, {}) is False
    assert not list(choices_dir.glob("*.json"))


def test_switched_off_by_the_environment(tmp_path, monkeypatch, choices_dir):
    monkeypatch.setenv(tokenizer_choice.CHOICE_ENV, "0")
    load_tokenizer(demo_tokenizer(tmp_path))
    assert not choices_dir.exists()


def test_bad_directory_is_still_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(tmp_path / "empty")
