"""CPU backends: batched torch formulations of the decode-time ops (no per-request Python loop,
no padding), falling back to the reference for shapes they do not specialise."""
