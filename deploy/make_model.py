"""Build the tiny random-weight models that the default stack serves on CPU.

No model can be downloaded here, so we make them: a ~512-token byte-level BPE
trained on a small built-in corpus, and a 2-layer Llama with head_dim 64 (the
CPU attention backend supports 32/64/80/...).  Deterministic (seeded), ~1 MB,
a few seconds.  Its output is gibberish; its shapes and costs are real.

``--embed`` builds the embedding model instead (``models/tiny-embed``): the
same tokenizer and layers saved as a bare ``LlamaModel`` (no LM head), which
vLLM serves as a pooling model (last-token pooling, normalized: vLLM's
defaults for a decoder used for embeddings), marked Matryoshka so that
``dimensions`` may shorten its 128-wide vectors.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = (
    """
The quick brown fox jumps over the lazy dog. A weir is a low dam that regulates flow.
Large language models generate text one token at a time. Requests wait in queues,
are admitted when memory allows, and stream their tokens back to clients.
Hello world! How are you today? I am fine, thank you. What is the capital of France?
Paris is the capital of France. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
"""
    * 20
)


def build(out_dir: str, *, embed: bool = False) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    if embed:
        cfg.is_matryoshka = True  # vLLM: `dimensions` may take its first 1..128 values
        LlamaModel(cfg).to(torch.bfloat16).save_pretrained(out)  # architectures: ["LlamaModel"]
        return out
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--embed"]
    embed = "--embed" in sys.argv[1:]
    path = build(args[0] if args else ("models/tiny-embed" if embed else "models/tiny-llama"), embed=embed)
    print(f"tiny {'embedding ' if embed else ''}model written to {path}")
