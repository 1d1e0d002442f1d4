"""A straightforward PyTorch CPU DLRM, the baseline of ``benchmarks/dlrm.py``.

Same architecture as ``dlrm`` (and the public reference ``dlrm_s_pytorch.py``): bottom MLP with
ReLU, ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table, dot interaction (strictly lower
triangle of the pairwise dot products, concatenated with the bottom output) or ``cat``, top MLP
with ReLU and a final linear layer whose sigmoid is folded into ``BCEWithLogitsLoss`` (mean), one
``torch.optim.SGD`` over all parameters (sparse gradients for the tables). Weights can be copied
from a ``dlrm`` model so that both start identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


class TorchDLRM(nn.Module):
    def __init__(self, table_weights: Sequence[np.ndarray], dense: dict, interaction: str = "dot"):
        """``table_weights``: float32 (rows, F) arrays (taken over, not copied); ``dense``:
        ``{"bot": [(W, b)], "top": [(W, b)]}`` with ``W`` as (fan_in, fan_out), as in ``dlrm.dense``."""
        super().__init__()
        self.interaction = interaction
        self.emb = nn.ModuleList(
            nn.EmbeddingBag(w.shape[0], w.shape[1], mode="sum", sparse=True, _weight=torch.from_numpy(w))
            for w in table_weights)
        self.bot = nn.ModuleList(self._linear(W, b) for W, b in dense["bot"])
        self.top = nn.ModuleList(self._linear(W, b) for W, b in dense["top"])
        n = len(table_weights) + 1
        li, lj = np.tril_indices(n, -1)
        self.register_buffer("li", torch.from_numpy(li.astype(np.int64)), persistent=False)
        self.register_buffer("lj", torch.from_numpy(lj.astype(np.int64)), persistent=False)

    @staticmethod
    def _linear(W: np.ndarray, b: np.ndarray) -> nn.Linear:
        lin = nn.Linear(W.shape[0], W.shape[1])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(W.T)))
            lin.bias.copy_(torch.from_numpy(b))
        return lin

    def forward(self, dense: torch.Tensor, indices: Sequence[torch.Tensor],
                offsets: Sequence[torch.Tensor | None]) -> torch.Tensor:
        h = self.bottom(dense)
        ly = [e(i, o) for e, i, o in zip(self.emb, indices, offsets)]
        return self.from_embeddings(h, ly)

    def bottom(self, dense: torch.Tensor) -> torch.Tensor:
        h = dense
        for lin in self.bot:
            h = torch.relu(lin(h))
        return h

    def from_embeddings(self, h: torch.Tensor, ly: Sequence[torch.Tensor]) -> torch.Tensor:
        """Interaction and top MLP from the bottom output ``h`` and the pooled embeddings ``ly``."""
        if self.interaction == "dot":
            T = torch.stack([h] + ly, dim=1)
            Z = torch.bmm(T, T.transpose(1, 2))
            z = torch.cat([h, Z[:, self.li, self.lj]], dim=1)
        else:
            z = torch.cat([h] + ly, dim=1)
        n = len(self.top)
        for k, lin in enumerate(self.top):
            z = lin(z)
            if k < n - 1:
                z = torch.relu(z)
        return z[:, 0]


class TorchTrainer:
    """SGD training steps of a :class:`TorchDLRM` on ``dlrm.data.Batch`` objects.

    ``bf16=True`` runs the forward under ``torch.autocast("cpu", torch.bfloat16)``: PyTorch's own
    mixed precision (matmuls and the interaction's bmm with bfloat16 operands, float32 weights,
    gradients and SGD), the like-for-like baseline of ``dlrm``'s ``precision="bf16"``.
    """

    def __init__(self, model: TorchDLRM, lr: float, bf16: bool = False):
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=lr)
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.bf16 = bf16

    def _logits(self, dense, idx, offs) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            return self.model(dense, idx, offs).float()

    @staticmethod
    def convert(batch) -> tuple:
        """A dlrm Batch as torch tensors (done once, outside timed regions)."""
        idx, offs = [], []
        for t in range(len(batch.indices)):
            x = batch.indices[t]
            if batch.offsets is not None:
                idx.append(torch.from_numpy(x.astype(np.int64)))
                offs.append(torch.from_numpy(batch.offsets[t][:-1].astype(np.int64)))
            elif x.ndim == 2:
                idx.append(torch.from_numpy(x.astype(np.int64)))
                offs.append(None)
            else:
                idx.append(torch.from_numpy(x.astype(np.int64)))
                offs.append(torch.arange(x.size, dtype=torch.int64))
        return torch.from_numpy(batch.dense), idx, offs, torch.from_numpy(batch.labels)

    def dense_only_step(self, tb, ly: Sequence[torch.Tensor]) -> float:
        """The step without any embedding work: ``ly`` are precomputed pooled embeddings (leaf
        tensors); forward, backward and SGD of the MLPs only (tables get no gradient)."""
        dense, _, _, y = tb
        self.opt.zero_grad(set_to_none=True)
        for t in ly:
            t.grad = None
        loss = self.loss_fn(self.model.from_embeddings(self.model.bottom(dense), ly), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def pooled(self, tb) -> list[torch.Tensor]:
        """Pooled embeddings of a converted batch as leaf tensors requiring grad (for dense_only_step)."""
        _, idx, offs, _ = tb
        with torch.no_grad():
            return [e(i, o).requires_grad_() for e, i, o in zip(self.model.emb, idx, offs)]

    def step(self, tb) -> float:
        dense, idx, offs, y = tb
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self._logits(dense, idx, offs), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())
