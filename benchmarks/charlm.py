"""A task whose loss means something: next-byte prediction on Python's own source code.

The text is the standard library's .py files (every machine with Python has them), read in
sorted order and cut at `MAX_BYTES`; the last 5% is held out for validation. Unlike the
course's random tokens, the loss falls far below ln(256) = 5.55 as a model learns, so time to
a target loss compares training runs. Two models:

- `CharLM`, a small causal transformer over 128-byte windows: much computation per byte of
  gradient, so on a CPU its step is mostly compute even over a 1 Gbit/s link;
- `CharMLP`, Bengio et al.'s (2003) neural language model over bytes: the previous CONTEXT
  bytes embedded and concatenated, two wide hidden layers, a byte head. Little computation
  per byte of gradient: its step over a slow link is mostly communication, the balance a GPU
  (tens of times faster than these CPU cores) has with most models on such a link.

The text depends on the Python version: compare figures from one machine and one Python.
"""
import functools
import glob
import os
import sysconfig

import torch
import torch.nn.functional as F
from torch import nn

MAX_BYTES = 8 << 20
HELD_OUT = 0.05


@functools.lru_cache(maxsize=1)
def stdlib_text():
    """(bytes as a uint8 tensor, a description of where they came from)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in p and "dist-packages" not in p)
    chunks, size = [], 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        size += len(data)
        if size >= MAX_BYTES:
            break
    if size < 1 << 20:
        raise RuntimeError(f"charlm: found only {size} bytes of .py files under {root}; "
                           f"the benchmark needs the standard library's sources")
    text = b"".join(chunks)[:MAX_BYTES]
    where = f"{len(text) / 2**20:.1f} MiB of {root}/**/*.py ({len(chunks)} files)"
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long(), where


class CharLM(nn.Module):
    """Byte embedding + learned positions, a causal pre-norm encoder, a byte head."""

    def __init__(self, d_model=256, nhead=8, num_layers=4, seq_len=128, dim_feedforward=1024):
        super().__init__()
        self.embedding = nn.Embedding(256, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256)

    def forward(self, ids):
        length = ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        x = self.embedding(ids) + self.positions(torch.arange(length, device=ids.device))
        return self.head(self.norm(self.blocks(x, mask=causal, is_causal=True)))


class CharMLP(nn.Module):
    """The previous `context` bytes -> the next byte: embeddings, two GELU layers, a head."""

    def __init__(self, context=16, embed=64, hidden=2048):
        super().__init__()
        self.embedding = nn.Embedding(256, embed)
        self.net = nn.Sequential(nn.Linear(context * embed, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 256))

    def forward(self, ids):
        return self.net(self.embedding(ids).flatten(1))


CONTEXT = 16  # CharMLP's window


def loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _window(text, starts, seq_len):
    index = starts[:, None] + torch.arange(seq_len + 1)
    chunk = text[index]
    return chunk[:, :-1], chunk[:, 1:]


def _last(ids, labels):
    """CharMLP's sample: the window, and only the byte after it as the label."""
    return ids, labels[:, -1]


def batch(rank, step, batch_size, seq_len=128, label=None):
    """Training windows for (rank, step): random offsets in the first 95% of the text."""
    text, _ = stdlib_text()
    train_end = int(len(text) * (1 - HELD_OUT)) - seq_len - 1
    g = torch.Generator().manual_seed(1000003 * rank + step)
    ids, labels = _window(text, torch.randint(0, train_end, (batch_size,), generator=g), seq_len)
    if label is not None:
        ids, labels = label(ids, labels)
    return (ids,), labels


def mlp_batch(rank, step, batch_size):
    return batch(rank, step, batch_size, CONTEXT, _last)


def validation(batches=8, batch_size=16, seq_len=128, label=None):
    """Fixed held-out windows, the same on every rank: [(inputs, labels)]."""
    text, _ = stdlib_text()
    start = int(len(text) * (1 - HELD_OUT))
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(batches):
        starts = torch.randint(start, len(text) - seq_len - 1, (batch_size,), generator=g)
        ids, labels = _window(text, starts, seq_len)
        if label is not None:
            ids, labels = label(ids, labels)
        out.append(((ids,), labels))
    return out


def mlp_validation(batches=8):
    """As many held-out bytes per batch as CharLM's validation scores (16 x 128)."""
    return validation(batches=batches, batch_size=2048, seq_len=CONTEXT, label=_last)
