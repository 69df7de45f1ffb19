"""Write a tiny Llama-architecture model with random weights and a tokenizer trained here.

    python make.py OUT [--size small|large] [--seed N] [--head-dim N]

Runs under the engine's interpreter (the environment vLLM is installed in: it has torch,
transformers and tokenizers), offline: nothing is downloaded, nothing is asked of a hub.
OUT gets what vLLM's `--model OUT` loads: config.json, model.safetensors,
generation_config.json, tokenizer.json and tokenizer_config.json (with a chat template).
The same seed writes the same files. The model answers with random tokens: it is for
running an engine, not for reading what it says. See the README beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

# No hub: set before transformers is imported, which reads them then.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SIZES = {
    # hidden, layers, intermediate
    "small": (128, 2, 256),
    "large": (256, 4, 512),
}
VOCAB = 1024
MAX_POSITIONS = 4096
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
ROLES = ("system", "user", "assistant")
SPECIAL = [BOS, EOS, PAD, "<|end|>", *(f"<|{r}|>" for r in ROLES)]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Text to train the tokenizer on: words of random syllables, some digits and
    punctuation, the same for the same seed."""
    rng = random.Random(seed)
    onsets = ["", "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "st", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    codas = ["", "", "n", "r", "s", "t", "l"]
    words = [
        "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
            for _ in range(rng.randint(1, 3))
        )
        for _ in range(600)
    ]
    words += ["the", "a", "model", "request", "answer", "hello", "world", "token", "prompt"]
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        line = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.2:
            line += f" {rng.randint(0, 9999)}"
        out.append(line.capitalize() + rng.choice([".", "?", "!", ","]))
    return out


def write_tokenizer(out: Path, seed: int) -> int:
    """Train a byte-level BPE on `corpus(seed)` and save it as transformers loads it;
    its vocabulary's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": MAX_POSITIONS,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n"
    )
    return int(tok.get_vocab_size())


def write_model(out: Path, seed: int, size: str, head_dim: int, vocab: int) -> int:
    """Random weights of a Llama of `size`, as safetensors; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, intermediate = SIZES[size]
    heads = hidden // head_dim
    tok = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids["<|end|>"]],
        pad_token_id=ids[PAD],
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Write a tiny Llama with random weights and a locally trained "
        "tokenizer into OUT, for running vLLM without downloading a model.",
    )
    p.add_argument("out", type=Path, help="the directory to write (created; files replaced)")
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="small: hidden 128, 2 layers (about 0.46M parameters); large: hidden 256, "
        "4 layers (about 2.9M), enough for prefix caching to show (default: small)",
    )
    p.add_argument("--seed", type=int, default=0, help="the same seed, the same files (default: 0)")
    p.add_argument(
        "--head-dim",
        type=int,
        default=64,
        help="attention head size (default: 64); vLLM's CPU build needs 32 or more, and "
        "a smaller one makes a model whose server answers /health and fails every request",
    )
    a = p.parse_args(argv)
    hidden = SIZES[a.size][0]
    if a.head_dim <= 0 or hidden % a.head_dim:
        p.error(f"--head-dim must divide the hidden size {hidden}")
    t0 = time.monotonic()
    a.out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(a.out, a.seed)
    params = write_model(a.out, a.seed, a.size, a.head_dim, vocab)
    print(
        f"{a.out}: llama {a.size}, {params:,} parameters, vocabulary {vocab}, "
        f"head size {a.head_dim}, seed {a.seed}, in {time.monotonic() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
