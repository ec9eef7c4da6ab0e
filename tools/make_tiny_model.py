"""Build a tiny causal LM and its tokenizer locally, with no download.

The model is a standard transformers Qwen2 (or Llama) with random weights; the tokenizer is a byte-level
BPE trained on `tools/data/tiny_corpus.txt`, with Qwen-style special tokens and chat template. Both are
saved with `save_pretrained`, so any transformers/TRL/SGLang code loads them by path. Same seed, same files.

    python tools/make_tiny_model.py OUT_DIR [--seed N] [--size tiny|100m] [--arch qwen2|llama]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Shapes per size preset; "100m" is the ~100M-parameter config the benchmarks use.
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "100m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
}


def build_tokenizer(vocab_size: int = 300):
    """Train a byte-level BPE on the shipped corpus and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train([str(CORPUS)], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 2048
    return tokenizer


def build_model(tokenizer, seed: int, size: str = "tiny", arch: str = "qwen2"):
    """A randomly initialised causal LM sized for `tokenizer`, deterministic for `seed`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **SIZES[size],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def make_tiny_model(out_dir: str | Path, seed: int = 0, size: str = "tiny", arch: str = "qwen2") -> Path:
    """Write model + tokenizer to `out_dir` and return it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed, size, arch)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "tiny_model.json").write_text(json.dumps({"seed": seed, "size": size, "arch": arch, "parameters": n_params}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    args = parser.parse_args()
    out = make_tiny_model(args.out_dir, args.seed, args.size, args.arch)
    info = json.loads((out / "tiny_model.json").read_text())
    print(f"wrote {args.size} {args.arch} model ({info['parameters']:,} parameters, seed {args.seed}) to {out}")


if __name__ == "__main__":
    main()
