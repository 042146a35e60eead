#!/usr/bin/env python3
"""Writes a tiny Llama model directory for real-engine tests, downloading nothing.

    python3 make_tiny_model.py OUT_DIR [--hidden 256] [--layers 2]

The directory holds what vLLM needs to serve the model with `--load-format dummy`
(random weights, so no weight file is written) and what kvroute's picker needs to
tokenize like the engine:

  config.json             LlamaForCausalLM, small, vocab = the tokenizer's size
  tokenizer.json          byte-level BPE trained here on text this script generates
  tokenizer_config.json   bos/eos and a Llama-3-style `chat_template`
  generation_config.json

The output is deterministic: the corpus comes from a seeded PRNG and BPE training
on a fixed corpus with a fixed vocab size gives the same merges, so running the
script twice writes byte-identical files (the test suite relies on that to cache
the directory). Needs the `tokenizers` package (the vLLM venv has it).
"""

import argparse
import hashlib
import json
import os
import random
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Bump when the output changes, so cached model directories are rebuilt.
FORMAT_VERSION = 1

VOCAB_SIZE = 4096

# The Llama-3 pre-tokenizer split (needs a backtracking regex engine: the picker's
# `tokenizers` build has one).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
SPECIAL = [
    BOS,
    EOS,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT,
    "<|python_tag|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
]

# Llama-3-style template without the date line (the date would make renders differ
# from day to day). Content may be a string or a list of text parts.
CHAT_TEMPLATE = (
    "{%- macro text_of(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{{- text_of(message.content) | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will can more other time some what only into them could these two may first then "
    "do any like my now over such our man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three cache router prefix block token "
    "engine request prompt latency throughput server model kernel queue tenant session "
    "assistant system user tool function arguments weather Paris London Tokyo Berlin data "
    "hash index event replay metric gateway endpoint picker pool score policy load balance"
).split()

PUNCT = [".", ",", "?", "!", ":", ";"]

SYLLABLES = (
    "ka ri to mo na le su vi ta ren dor ex in al par ti co mi an ber gen sha lo qua ze pho "
    "tri ul os es ni ga bu fe ho ja ke lu ma ne po ru sa te vo wa xi yo zu str pl gr th"
).split()


def lexicon(rng: random.Random, n: int = 4000) -> list[str]:
    """Common English-ish words first, then made-up words of 1-4 syllables."""
    words = list(WORDS)
    seen = set(words)
    while len(words) < n:
        w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def corpus(seed: int = 13, sentences: int = 6000) -> list[str]:
    """Generated text with words, numbers, punctuation, code-ish and non-ASCII bits."""
    rng = random.Random(seed)
    lex = lexicon(rng)
    # Zipf-like weights, so frequent words become single tokens and rare ones split.
    weights = [1.0 / (rank + 10) for rank in range(len(lex))]
    out = []
    for i in range(sentences):
        n = rng.randint(4, 18)
        words = rng.choices(lex, weights=weights, k=n)
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 99999)))
        if rng.random() < 0.1:
            words.insert(rng.randrange(len(words) + 1), rng.choice(["café", "naïve", "日本語", "🚀", "Ünïcödé"]))
        s = " ".join(words)
        s = s[0].upper() + s[1:] + rng.choice(PUNCT)
        if i % 50 == 0:
            s += '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        if i % 7 == 0:
            s += "\n\n"
        out.append(s)
    return out


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos)],
    )
    return tok


def write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--max-position-embeddings", type=int, default=16384)
    args = ap.parse_args()

    os.makedirs(args.out_dir, exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bos_id, eos_id, eot_id = tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(EOT)

    tok.save(os.path.join(args.out_dir, "tokenizer.json"), pretty=True)
    heads = max(2, args.hidden // 64)
    write_json(
        os.path.join(args.out_dir, "config.json"),
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": args.hidden,
            "intermediate_size": args.hidden * 2,
            "num_hidden_layers": args.layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "head_dim": args.hidden // heads,
            "hidden_act": "silu",
            "max_position_embeddings": args.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "vocab_size": vocab,
            "bos_token_id": bos_id,
            "eos_token_id": [eos_id, eot_id],
            "torch_dtype": "bfloat16",
            "transformers_version": "5.16.1",
            "kvroute_tiny_model_version": FORMAT_VERSION,
        },
    )
    write_json(
        os.path.join(args.out_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOT,
            "clean_up_tokenization_spaces": False,
            "model_max_length": args.max_position_embeddings,
            "model_input_names": ["input_ids", "attention_mask"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    write_json(
        os.path.join(args.out_dir, "generation_config.json"),
        {"bos_token_id": bos_id, "eos_token_id": [eos_id, eot_id], "do_sample": False},
    )

    digest = hashlib.sha256()
    for name in sorted(os.listdir(args.out_dir)):
        if name.endswith(".json"):
            with open(os.path.join(args.out_dir, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    print(f"vocab={vocab} bos={bos_id} eos={eos_id} eot={eot_id} sha256={digest.hexdigest()[:16]}")
    print(os.path.abspath(args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
