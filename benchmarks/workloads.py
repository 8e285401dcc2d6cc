"""The models and data the benchmarks and the training script share.

- `SimpleTransformer` and `DummyTextDataset`: the course's language model and
  its synthetic data: about 7.3M parameters, batch 8, seq 128.
- `MLP`: 8 x Linear(1024), little compute per byte of gradient, so it is the
  communication-heavy case.
- `ConvNet`: a small CNN with BatchNorm (buffers to broadcast).
- `narrow`: 48 blocks of Linear(64, 64) + LayerNorm(64) + ReLU, batch 16: 192
  small parameters and almost no compute, so a step is mostly what the wrapper
  costs per parameter (what a GPU step of a few milliseconds sees of it).
- `charlm` and `charmlp` (charlm.py): next-byte prediction on the standard
  library's sources, a loss that means something (time_to_loss.py); a
  transformer (compute-heavy) and an MLP (communication-heavy).

`WORKLOADS[name]` gives a `Workload`: how to build the model, a batch for a
(rank, step) pair, and the loss. Batches are made from a seeded generator so
every configuration of a benchmark sees the same data.
"""
import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import charlm


class SimpleTransformer(nn.Module):
    """Token + learned position embeddings, a post-norm encoder, a vocabulary head."""

    def __init__(self, vocab_size=8000, d_model=256, nhead=8, num_layers=4, max_seq_len=128,
                 dim_feedforward=1024, dropout=0.1):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.pos_encoding = nn.Embedding(max_seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout,
                                           batch_first=True)
        # enable_nested_tensor=False: the fast path would change which kernels
        # run depending on the mask, which makes step times jumpy.
        self.transformer = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.output_proj = nn.Linear(d_model, vocab_size)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, attention_mask=None):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embedding(input_ids) + self.pos_encoding(positions)
        padding = None if attention_mask is None else ~attention_mask.bool()
        return self.output_proj(self.transformer(x, src_key_padding_mask=padding))


class DummyTextDataset(torch.utils.data.Dataset):
    """Random token ids in [1, vocab); a padding mask whose real length is random in
    [seq/2, seq]; labels are the inputs shifted left, padded with 0 (ignored by the loss)."""

    def __init__(self, num_samples=2000, seq_len=128, vocab_size=8000, seed=42):
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, vocab_size, (num_samples, seq_len), generator=g)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (num_samples, 1), generator=g)
        self.attention_mask = (torch.arange(seq_len) < lengths).long()
        self.labels = torch.cat([self.input_ids[:, 1:],
                                 torch.zeros(num_samples, 1, dtype=torch.long)], dim=1)

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i],
                "labels": self.labels[i]}


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=0)


class MLP(nn.Sequential):
    def __init__(self, width=1024, depth=8):
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        super().__init__(*layers)


class Narrow(nn.Sequential):
    def __init__(self, width=64, blocks=48):
        layers = []
        for _ in range(blocks):
            layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
        super().__init__(*layers)


class ConvNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout),
                                 nn.ReLU(), nn.MaxPool2d(2))
        self.features = nn.Sequential(block(3, 32), block(32, 64), block(64, 128))
        self.head = nn.Linear(128 * 4 * 4, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


@dataclasses.dataclass
class Workload:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int, int], tuple]   # (rank, step, batch_size) -> (inputs, target)
    loss: Callable                            # (output, target) -> scalar
    batch_size: int


def _generator(rank, step):
    return torch.Generator().manual_seed(1000003 * rank + step)


def _text_batch(rank, step, batch_size, seq_len=128, vocab=8000):
    g = _generator(rank, step)
    ids = torch.randint(1, vocab, (batch_size, seq_len), generator=g)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size, 1), generator=g)
    mask = (torch.arange(seq_len) < lengths).long()
    labels = torch.cat([ids[:, 1:], torch.zeros(batch_size, 1, dtype=torch.long)], dim=1)
    return (ids, mask), labels


def _mlp_batch(rank, step, batch_size):
    g = _generator(rank, step)
    return (torch.randn(batch_size, 1024, generator=g),), torch.randn(batch_size, 1024, generator=g)


def _narrow_batch(rank, step, batch_size):
    g = _generator(rank, step)
    return (torch.randn(batch_size, 64, generator=g),), torch.randn(batch_size, 64, generator=g)


def _image_batch(rank, step, batch_size):
    g = _generator(rank, step)
    return ((torch.randn(batch_size, 3, 32, 32, generator=g),),
            torch.randint(0, 10, (batch_size,), generator=g))


WORKLOADS = {
    "transformer": Workload("transformer", SimpleTransformer, _text_batch, lm_loss, 8),
    "mlp": Workload("mlp", MLP, _mlp_batch, F.mse_loss, 32),
    "convnet": Workload("convnet", ConvNet, _image_batch, F.cross_entropy, 32),
    "narrow": Workload("narrow", Narrow, _narrow_batch, F.mse_loss, 16),
    "charlm": Workload("charlm", charlm.CharLM, charlm.batch, charlm.loss, 16),
    "charmlp": Workload("charmlp", charlm.CharMLP, charlm.mlp_batch, charlm.loss, 128),
}
