"""The dense baseline plugin: every request attends to every block, in every layer."""

from __future__ import annotations

from kvfabric.ucm_layer.sparse.base import AttentionMetadata, AttnMode, SparseMeta, StepBatch, UcmSparseBase


class DenseAttention(UcmSparseBase):
    """Changes nothing the kernel sees; exists so engines and harnesses treat every method
    alike (``create("dense", ...)``)."""

    name = "dense"

    def build_sparse_meta(self, batch: StepBatch, attn: AttentionMetadata) -> SparseMeta:
        modes = tuple((AttnMode.DENSE,) * self.model.num_layers for _ in batch.request_ids)
        self._step = getattr(self, "_step", 0) + 1
        return SparseMeta(batch=batch, modes=modes, step=self._step)


__all__ = ["DenseAttention"]
