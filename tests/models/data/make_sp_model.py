"""Regenerate the tiny tokenizer fixtures used by tests/models/test_tokenizer.py.

Writes, next to this file:
  tiny_sp.model                    sentencepiece BPE, vocab 500, byte fallback, identity normalisation
  tiny_bpe/tokenizer.json          byte-level BPE trained with the `tokenizers` library
  tiny_bpe/tokenizer_config.json   special tokens and a small ChatML-style chat template

Training is not byte-for-byte reproducible, so the outputs are committed and the tests never retrain.
Run: python tests/models/data/make_sp_model.py
"""

from __future__ import annotations

import io
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

# A few KB of mixed text: English prose, code, numbers, accented Latin, CJK, emoji, odd whitespace.
CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged key-value cache stores attention keys in fixed-size blocks.",
    "Continuous batching lets new requests join while others are still decoding.",
    "Prefix caching reuses the blocks of a prompt that was seen before.",
    "def generate(prompt: str, max_new_tokens: int = 128) -> str:",
    "    return model.decode(tokens[:max_new_tokens])",
    "for i in range(10):\n    print(i * 2, i ** 3)",
    "if x == 42 and y != 7: total += 3.14159",
    "The year 2024 had 366 days; 1,000,000 is a million; 0x1F is 31.",
    "Café, naïve, résumé, façade, jalapeño, über, smörgåsbord, Ærøskøbing.",
    "Ça va? Très bien, merci. ¿Dónde está la estación? Ñandú.",
    "Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Größe, Straße, Mädchen, Öl, Übung.",
    "東京は日本の首都です。今日はいい天気ですね。",
    "北京欢迎你。我们一起学习机器学习。",
    "한국어 문장도 조금 넣어 봅니다.",
    "Привет, как дела? Всё хорошо.",
    "Γειά σου κόσμε.",
    "مرحبا بالعالم",
    "Emoji: 😀 😃 🎉 🚀 👍🏽 ❤️ 🇫🇷 👨‍👩‍👧",
    "Tabs\tand\tspaces   mixed    with\n\nblank lines\n   and indentation.",
    "Trailing spaces   \nleading spaces\n\t\ttabs\r\nwindows newline",
    "JSON: {\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "Markdown **bold** _italic_ `code` > quote - item 1. item",
    "E = mc² ≈ 9×10¹⁶ J; ∑ ∫ √ ∞ ≠ ≤ ≥ → ←",
    "Hello, world! How are you today? I'm fine, thanks; you're welcome.",
    "It's the model's job to predict the next token; they'll see.",
]
CORPUS = "\n".join(CORPUS_LINES * 8)

SPECIAL_TOKENS = ["<|endoftext|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_sentencepiece() -> None:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.split("\n")),
        model_writer=model,
        model_type="bpe",
        vocab_size=500,
        byte_fallback=True,
        character_coverage=0.98,  # rarer characters (some CJK, emoji) fall back to bytes
        # Identity normalisation and no dummy prefix make decode(encode(s)) == s.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=["<think>"],
        control_symbols=["<|im_start|>", "<|im_end|>"],
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=3,
        pad_piece="<pad>",
    )
    with open(os.path.join(HERE, "tiny_sp.model"), "wb") as f:
        f.write(model.getvalue())


def make_byte_level_bpe() -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n"), trainer=trainer)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    out = os.path.join(HERE, "tiny_bpe")
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {
        "bos_token": "<|startoftext|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>",
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    make_sentencepiece()
    make_byte_level_bpe()
