"""A model's identity from its weight files: cheap to compute, different for different weights.

The identity goes into the block-hash extra key, so two engines share KV blocks only when
they run the same weights. A name cannot promise that (two directories called `model`, two
quantizations of one GGUF share a name); the files can. Hashing every byte of a large
checkpoint would cost seconds per gigabyte, so the digest covers what tells checkpoints
apart for a fraction of that:

- the tensor table (names, stored dtypes or quantization types, shapes, offsets),
- each file's size,
- evenly spaced samples of each file's bytes (a fine-tune changes every tensor, so it
  changes every sample).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

NUM_SAMPLES = 64
SAMPLE_BYTES = 4096
DIGEST_CHARS = 32  # 128 bits of the SHA-256: collisions are not a practical concern


def fingerprint(files: Sequence[Path], tensor_table: bytes) -> str:
    """Hex digest of `tensor_table` (a canonical encoding of the tensors' metadata) and of
    each file's size and sampled bytes, in the order given. A pure function of the inputs'
    contents: the same files anywhere on disk give the same digest."""
    h = hashlib.sha256(b"kvmesh-weights-v1")
    h.update(len(tensor_table).to_bytes(8, "little"))
    h.update(tensor_table)
    for path in files:
        size = os.path.getsize(path)
        h.update(size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            step = max(size // NUM_SAMPLES, SAMPLE_BYTES)
            for offset in range(0, size, step):
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:DIGEST_CHARS]


def model_id(name: str, weights_digest: str) -> str:
    """The model identity kvmesh hashes KV blocks under: readable name plus weights digest."""
    return f"{name}@{weights_digest}"
