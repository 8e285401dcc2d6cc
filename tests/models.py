"""Small models that exercise the reducer's corner cases, and their batches."""
import torch
from torch import nn


class BatchNormNet(nn.Module):
    """Buffers (running stats) that broadcast_buffers must keep equal."""
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class TiedNet(nn.Module):
    """One weight used twice (embedding and output projection)."""
    def __init__(self):
        super().__init__()
        self.emb, self.hidden = nn.Embedding(20, 8), nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(self.emb(x)))).mean(dim=1)


class FrozenNet(nn.Module):
    """A frozen first layer: it must not be bucketed or broadcast as a gradient."""
    def __init__(self):
        super().__init__()
        self.frozen, self.fc = nn.Linear(8, 8), nn.Linear(8, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.fc(torch.relu(self.frozen(x)))


class BranchNet(nn.Module):
    """Two heads; which one runs depends on the batch (and so on the rank)."""
    def __init__(self):
        super().__init__()
        self.trunk, self.left, self.right = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, use_left):
        h = torch.relu(self.trunk(x))
        return self.left(h) if use_left else self.right(h)


class DeepNet(nn.Module):
    """Enough layers that a tiny bucket cap gives many buckets."""
    def __init__(self, width=32, depth=6):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(depth)
                                      for m in (nn.Linear(width, width), nn.Tanh())])
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.layers(x))


class AliasNet(nn.Module):
    """Gradients that share memory: autograd hands w, a and b views of one tensor
    (the sum's gradient goes to every term, the views' backward only reshapes)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(4, 8)), nn.Parameter(torch.randn(4, 8))
        self.w = nn.Parameter(torch.randn(32))

    def forward(self, x):
        return x * (self.w + self.a.view(-1) + self.b.view(-1))


class OddNet(nn.Module):
    """Parameters of unusual kinds: complex (torch's buckets hold them as real pairs) and
    a strided view of a larger tensor (not contiguous)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Parameter(torch.randn(8, 4, dtype=torch.cfloat))
        self.s = nn.Parameter(torch.randn(4, 16)[:, ::2])
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        z = x.to(torch.cfloat) @ self.c
        return self.fc(z.abs()) + z.real @ self.s


MODELS = {"batchnorm": BatchNormNet, "tied": TiedNet, "frozen": FrozenNet,
          "branch": BranchNet, "deep": DeepNet,
          "alias": AliasNet, "odd": OddNet}


def batch(name, rank, step, size=6):
    """Inputs for model `name`, different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name == "tied":
        return (torch.randint(0, 20, (size, 5), generator=g),)
    width = 32 if name in ("deep", "alias") else 8
    x = torch.randn(size, width, generator=g)
    if name == "branch":
        return (x, (rank + step) % 2 == 0)
    return (x,)
