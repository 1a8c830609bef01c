"""Helpers shared by the experiment scripts."""

from __future__ import annotations

import json
import os
import random


def write_record(path: str | None, record: dict) -> None:
    """Write a script's JSON record to `path` (creating its folder) and say so; nothing when `path` is None."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump(record, fh, indent=2)
    print(f"wrote {path}")


def load_experiment_model(name: str, *, dtype: str = "float32", quant: str | None = None):
    """`"tiny"` (a random 2-layer Llama for quick runs) or anything `models.load_model` accepts, loaded with `dtype`
    and `quant` (both ignored for "tiny")."""
    from models import ModelConfig, init_random_weights, load_model
    from models.loader import Model

    if name == "tiny":
        cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16)
        return Model(config=cfg, params=init_random_weights(cfg), tokenizer=None, source="tiny")
    return load_model(name, dtype=dtype, quant=quant)


# Seeded prompt material shared by the speculative-decoding benchmark and the matmul quality check.
TEXTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold; fortune favours the bold, and practice makes perfect.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "def factorial(n):\n    return 1 if n < 2 else n * factorial(n - 1)\n",
    "Photosynthesis converts light energy into chemical energy. Plants take in carbon dioxide and water and, using "
    "sunlight, produce glucose and oxygen. The process happens in the chloroplasts.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n",
]
COPY_TASKS = ["Repeat the following text exactly:\n\n{}", "Rewrite the following, fixing any typos:\n\n{}",
              "Quote this passage and then explain it briefly:\n\n{}"]
CHAT = ["What are three tips for learning a new language?", "Write a short poem about autumn.",
        "Explain how a rainbow forms.", "What should I pack for a weekend hiking trip?",
        "Tell me a fun fact about octopuses.", "How do I make a good cup of tea?",
        "Describe the city of Paris in a few sentences.", "Why is the sky blue?"]


def workload(name: str, n: int, seed: int) -> list[str]:
    """`n` seeded prompts of a speculative-decoding workload: "copy" (rewrite or quote one of `TEXTS`) or "chat"."""
    rng = random.Random(f"{name}:{seed}")
    if name == "copy":
        return [rng.choice(COPY_TASKS).format(rng.choice(TEXTS)) for _ in range(n)]
    return [rng.choice(CHAT) for _ in range(n)]


def chat_prompt(tok, text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
