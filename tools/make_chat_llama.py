"""Write a small Hugging Face Llama chat model and a chat JSONL, nothing downloaded.

For the LoRA walkthrough in docs/fine-tuning.md, a reader can reproduce without any
download::

    python tools/make_chat_llama.py out/llama-chat --chats out/chats.jsonl

``out/llama-chat`` is a Hugging Face Llama directory as ``save_pretrained`` writes one:
``config.json`` and ``model.safetensors`` (a 2-layer Llama with grouped-query attention,
random weights drawn by nnxscale from ``--seed``, the output head's with standard deviation
:data:`HEAD_STD`, written by
``nnxscale.models.llama.save_pretrained``), a byte-level ``tokenizer.json`` (the 256 bytes
and Llama 3's special tokens) and a ``tokenizer_config.json`` holding Llama 3 Instruct's
chat template (``tests/data/chat/llama3.jinja``), ``eos_token`` ``<|eot_id|>``.
transformers loads it (``AutoModelForCausalLM``, ``AutoTokenizer``), and so does nnxscale
(``--model out/llama-chat``).

``--chats FILE`` also writes conversations of a question about a sum and its answer (``{"messages": [...]}`` per line).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent / "tests" / "data" / "chat" / "llama3.jinja"
SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"]
#: 256 byte tokens, the special tokens, padded to a multiple of 16.
VOCAB = 272
#: The output head's standard deviation (the other weights: HF's 0.02).
HEAD_STD = 0.5


def write_tokenizer(directory: Path) -> None:
    """A byte-level ``tokenizer.json`` (no merges) and a ``tokenizer_config.json`` with the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": TEMPLATE.read_text(),
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_model(directory: Path, seed: int) -> int:
    """A random 2-layer Llama in Hugging Face's layout; returns its parameter count."""
    import jax
    from flax import nnx

    from nnxscale.models import llama

    config = llama.preset("llama-tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          tie_word_embeddings=False)  # fmt: skip
    model = llama.Llama(config, rngs=nnx.Rngs(seed))
    # HF's initializer_range (0.02) makes a 64-wide head's logits spread 0.02 x sqrt(64) = 0.16: no adapter could
    # reach a confident prediction through that frozen head. Drawn wider, as a trained head would be.
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * HEAD_STD / 0.02
    llama.save_pretrained(model, directory)
    return sum(a.size for a in jax.tree.leaves(nnx.state(model)))


def chats(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        rows.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                  {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]})  # fmt: skip
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="the Hugging Face directory to write")
    parser.add_argument("--chats", type=Path, help="also write this many conversations as JSON Lines here")
    parser.add_argument("--rows", type=int, default=512, help="conversations in --chats (default 512)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.directory.mkdir(parents=True, exist_ok=True)
    n = write_model(args.directory, args.seed)
    write_tokenizer(args.directory)
    print(f"{args.directory}: Llama, 2 layers, {n:,} parameters, byte-level tokenizer, Llama 3 chat template")
    if args.chats:
        args.chats.parent.mkdir(parents=True, exist_ok=True)
        args.chats.write_text("".join(json.dumps(r) + "\n" for r in chats(args.rows, args.seed)))
        print(f"{args.chats}: {args.rows} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
