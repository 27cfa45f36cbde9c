"""What the model reads: text through a tokenizer, token files, and sharded batches.

``text`` turns text files into token ids with a Hugging Face ``tokenizer.json`` (or bytes)
and caches them; ``tokens`` loads token files, splits off validation, and serves global
batches through Grain, each process reading only the rows its devices hold, with an
iterator state that a checkpoint keeps so a resumed run sees the same batches.

Loads lazily, on first use of a name: the CLI reads parts of the tree before jax may be imported.
"""

from nnxscale import _lazy

_EXPORTS = {
    "load_tokenizer": "nnxscale.data.text",
    "tokenize": "nnxscale.data.text",
    "TokenData": "nnxscale.data.tokens",
    "batch_rows": "nnxscale.data.tokens",
    "eval_batches": "nnxscale.data.tokens",
    "load_tokens": "nnxscale.data.tokens",
    "to_global": "nnxscale.data.tokens",
    "train_batches": "nnxscale.data.tokens",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
