"""A small byte-level BPE tokenizer trained in memory (no hub) for front-end tests.

The vocabulary is small on purpose: CJK characters and emoji stay split across several
byte tokens, which is what the incremental detokenizer must handle.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

CORPUS = [
    "Hello world, this is a small test. The quick brown fox jumps over the lazy dog.",
    "Streaming text arrives token by token; stop strings may span token boundaries.",
    "Café, naïve, résumé, façade, déjà vu, über, Ångström, São Paulo.",
    "日本語のテキストです。中文文本测试。한국어 텍스트입니다.",
    "Emoji: 😀 🎉 🚀 👍🏽 and a family 👨\u200d👩\u200d👧 waving 👋.",
    "Numbers 0123456789 and symbols: <>[]{}()!?@#$%^&*",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(
    vocab_size: int = 420, chat_template: str | None = CHAT_TEMPLATE
) -> PreTrainedTokenizerFast:
    """A fresh tokenizer (callers may mutate it): BOS added to encodings, EOS ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    return fast
