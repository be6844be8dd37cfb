"""GSM8K text for training: the same "Question: …\\nAnswer: …" records, separated by a blank
line, that `bench gsm8k` and `bench spec` put in their few-shot prompts, so a model trained on
it continues those prompts in kind."""

from __future__ import annotations

from pathlib import Path

import torch

from kdaserve.datasets import gsm8k_file, read_jsonl


def gsm8k_rows(split: str, data_dir: str | Path | None = None) -> list[dict[str, str]]:
    """The rows of `train.jsonl` or `test.jsonl` (question, answer): in `data_dir`, else as
    kdaserve.datasets finds them."""
    return read_jsonl(gsm8k_file(split, data_dir))


def record(row: dict[str, str]) -> str:
    return "Question: " + row["question"] + "\nAnswer: " + row["answer"] + "\n\n"


def token_stream(rows: list[dict[str, str]], encode) -> torch.Tensor:  # noqa: ANN001
    """Every record tokenized on its own and concatenated: [N] int64 (the blank line between
    records is a split point of the BPE's pre-tokenizer, so this is how the joined text of a
    few-shot prompt encodes too)."""
    ids: list[int] = []
    for row in rows:
        ids.extend(encode(record(row)))
    return torch.tensor(ids, dtype=torch.int64)


def windows(stream: torch.Tensor, length: int, count: int,
            generator: torch.Generator) -> torch.Tensor:
    """`count` random windows of `length` tokens from the stream: [count, length]."""
    if stream.numel() <= length:
        raise ValueError(f"the token stream ({stream.numel()}) is shorter than one window")
    starts = torch.randint(0, stream.numel() - length, (count,), generator=generator)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


def tiled(stream: torch.Tensor, length: int) -> torch.Tensor:
    """The stream cut into consecutive windows of `length` (the tail dropped): held-out
    evaluation sees every token once."""
    n = stream.numel() // length
    return stream[:n * length].view(n, length)
