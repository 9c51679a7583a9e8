"""A paged-KV decode engine for the small Llama forward that calls the sparse hooks.

It plays the part vLLM's model runner plays for a ``UcmSparseBase`` plugin: a paged cache
per layer (``LayerKV``: ``(Hkv, num_blocks, block_size, D)``), a block table per request,
and per step ``build_sparse_meta`` -> for every layer (write the new keys/values at
``slot_mapping``, ``attention_begin``, attention over whatever ``AttentionMetadata`` then
says, ``attention_finished``) -> ``execute_finished``. Prefill attention is causal over the
step's own keys and values (as in vLLM); decode attention reads the paged cache through the
(possibly replaced) block tables. A ``slot_mapping`` entry of -1 means "do not keep this
token on the device" (a plugin that offloads it has stored it elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfabric.errors import OutOfSpace
from kvfabric.harness.sparse.llama import Llama
from kvfabric.ucm_layer.sparse.attention import dense_table, paged_attention
from kvfabric.ucm_layer.sparse.base import AttentionMetadata, LayerKV, ModelSpec, StepBatch, UcmSparseBase


@dataclass
class _Request:
    ids: list[int]
    blocks: list[int]
    seq_len: int = 0


class PagedEngine:
    """One model, one plugin, a fixed pool of ``num_blocks`` device blocks per layer."""

    def __init__(self, model: Llama, plugin: UcmSparseBase, num_blocks: int, block_size: int = 16) -> None:
        c = model.cfg
        spec = plugin.model
        expected = ModelSpec(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, block_size)
        if spec != expected:
            raise ValueError(f"plugin built for {spec}, engine runs {expected}")
        self.model, self.plugin, self.block_size = model, plugin, block_size
        shape = (c.num_kv_heads, num_blocks, block_size, c.head_dim)
        self.kv = [LayerKV(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_layers)]
        self._free = list(range(num_blocks - 1, -1, -1))
        self.requests: dict[str, _Request] = {}

    # ------------------------------------------------------------------ blocks
    def _grow(self, req: _Request, rid: str, seq_len: int) -> None:
        need = self.plugin.estimate_num_slots(rid, seq_len)
        while len(req.blocks) < need:
            if not self._free:
                raise OutOfSpace(
                    f"request {rid!r} needs {need} blocks; the engine's pool of "
                    f"{self.kv[0].num_blocks} is exhausted"
                )
            req.blocks.append(self._free.pop())

    def _metadata(self, rids: list[str], num_new: list[int]) -> AttentionMetadata:
        tables, lens, seqs, slots = [], [], [], []
        bs = self.block_size
        for rid, n in zip(rids, num_new):
            req = self.requests[rid]
            blocks = torch.tensor(req.blocks, dtype=torch.int64)
            nb = -(-req.seq_len // bs)
            if nb <= len(req.blocks):
                t, ln = dense_table(req.seq_len, blocks, bs)
            else:  # a plugin keeps fewer blocks than the sequence has: it maps them itself
                t, ln = blocks.view(1, -1), torch.full((1, len(req.blocks)), bs, dtype=torch.int64)
            pos = torch.arange(req.seq_len - n, req.seq_len)
            if nb <= len(req.blocks):
                slot = torch.stack([blocks[pos // bs], pos % bs], dim=1)
            else:
                slot = torch.full((n, 2), -1, dtype=torch.int64)
            tables.append(t)
            lens.append(ln)
            seqs.append(req.seq_len)
            slots.append(slot)
        return AttentionMetadata(tables, lens, seqs, slots)

    def _write(
        self,
        kv: LayerKV,
        attn: AttentionMetadata,
        k: torch.Tensor,
        v: torch.Tensor,
        ranges: list[tuple[int, int]],
    ) -> None:
        for i, (t0, t1) in enumerate(ranges):
            slot = attn.slot_mapping[i]
            keep = slot[:, 0] >= 0
            if bool(keep.all()):
                kv.k[:, slot[:, 0], slot[:, 1]] = k[t0:t1].transpose(0, 1)
                kv.v[:, slot[:, 0], slot[:, 1]] = v[t0:t1].transpose(0, 1)
            elif bool(keep.any()):
                s = slot[keep]
                kv.k[:, s[:, 0], s[:, 1]] = k[t0:t1][keep].transpose(0, 1)
                kv.v[:, s[:, 0], s[:, 1]] = v[t0:t1][keep].transpose(0, 1)

    # ------------------------------------------------------------------ steps
    @torch.inference_mode()
    def _step(self, rids: list[str], tokens: list[list[int]]) -> torch.Tensor:
        c = self.model.cfg
        num_new = [len(t) for t in tokens]
        for rid, t in zip(rids, tokens):
            req = self.requests[rid]
            req.ids += t
            req.seq_len += len(t)
            self._grow(req, rid, req.seq_len)
        batch = StepBatch(tuple(rids), tuple(self.requests[r].seq_len for r in rids), tuple(num_new))
        attn = self._metadata(rids, num_new)
        meta = self.plugin.build_sparse_meta(batch, attn)
        ranges, t = [], 0
        for n in num_new:
            ranges.append((t, t + n))
            t += n
        positions = torch.cat([torch.arange(s - n, s) for s, n in zip(batch.seq_lens, num_new)])
        x = self.model.embed(torch.tensor([i for tk in tokens for i in tk]))
        g = c.num_heads // c.num_kv_heads
        for layer in range(c.num_layers):
            q, k, v = self.model.qkv(layer, x, positions)
            kv = self.kv[layer]
            self._write(kv, attn, k, v, ranges)
            self.plugin.attention_begin(layer, q, k, v, kv, attn, meta)
            outs = []
            for i, (t0, t1) in enumerate(ranges):
                if t1 - t0 > 1:  # prefill (or a chunk): causal over the step's own tokens
                    if batch.seq_lens[i] != t1 - t0:
                        raise ValueError(
                            "chunked prefill after earlier tokens is not supported by this engine"
                        )
                    outs.append(self.model.causal_attention(q[t0:t1], k[t0:t1], v[t0:t1]))
                else:
                    qh = q[t0].view(c.num_kv_heads, g, c.head_dim)
                    o = paged_attention(qh, kv.k, kv.v, attn.block_tables[i], attn.block_lens[i])
                    outs.append(o.reshape(1, -1))
            out = torch.cat(outs)
            self.plugin.attention_finished(layer, q, k, v, out, kv, attn, meta)
            x = self.model.attn_out(layer, x, out)
        self.plugin.execute_finished(meta)
        last = torch.tensor([t1 - 1 for _, t1 in ranges])
        return self.model.logits(x[last])

    def add_request(self, rid: str, prompt: list[int]) -> torch.Tensor:
        """Admit and prefill ``prompt``; the logits ``(vocab,)`` of its last token."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} exists")
        self.plugin.request_begin(rid, len(prompt))
        self.requests[rid] = _Request([], [])
        try:
            return self._step([rid], [list(prompt)])[0]
        except BaseException:
            self.finish(rid)
            raise

    @torch.inference_mode()
    def add_prefilled(
        self,
        rid: str,
        prompt: list[int],
        k: torch.Tensor,
        v: torch.Tensor,
        q_prompt: torch.Tensor | None = None,
        stride: int = 1,
    ) -> None:
        """Admit a request whose prompt was already run densely elsewhere: ``k, v (L, Hkv, T, D)``
        go into the paged cache through the same slot mapping and hooks as a prefill step
        (prefill attention is dense, so only the hooks' view of keys and queries matters).
        ``q_prompt (L, ceil(T / stride), Hq, D)``: the prompt's queries at every ``stride``-th
        token (the hooks see zeros elsewhere)."""
        c = self.model.cfg
        if k.shape != (c.num_layers, c.num_kv_heads, len(prompt), c.head_dim) or v.shape != k.shape:
            raise ValueError(f"k/v must be (layers, kv heads, {len(prompt)}, head_dim), got {tuple(k.shape)}")
        if rid in self.requests:
            raise ValueError(f"request {rid!r} exists")
        self.plugin.request_begin(rid, len(prompt))
        req = self.requests[rid] = _Request(list(prompt), [], len(prompt))
        try:
            self._grow(req, rid, req.seq_len)
            batch = StepBatch((rid,), (req.seq_len,), (req.seq_len,))
            attn = self._metadata([rid], [req.seq_len])
            meta = self.plugin.build_sparse_meta(batch, attn)
            q = torch.zeros((len(prompt), c.num_heads, c.head_dim))
            for layer in range(c.num_layers):
                if q_prompt is not None:
                    q[::stride] = q_prompt[layer]
                kl, vl = k[layer].transpose(0, 1), v[layer].transpose(0, 1)
                self._write(self.kv[layer], attn, kl, vl, [(0, len(prompt))])
                self.plugin.attention_begin(layer, q, kl, vl, self.kv[layer], attn, meta)
                self.plugin.attention_finished(layer, q, kl, vl, q.flatten(1), self.kv[layer], attn, meta)
            self.plugin.execute_finished(meta)
        except BaseException:
            self.finish(rid)
            raise

    def decode(self, rids: list[str], tokens: list[int]) -> torch.Tensor:
        """One decode step: token ``tokens[i]`` appended to request ``rids[i]``; logits ``(B, vocab)``."""
        return self._step(list(rids), [[t] for t in tokens])

    def generate(self, rid: str, prompt: list[int], max_new: int, stop: int | None = None) -> list[int]:
        """Greedy decoding of one request (finished afterwards)."""
        try:
            logits = self.add_request(rid, prompt)
            out: list[int] = []
            for _ in range(max_new):
                nxt = int(logits.argmax())
                out.append(nxt)
                if nxt == stop or len(out) == max_new:
                    break
                logits = self.decode([rid], [nxt])[0]
            return out
        finally:
            self.finish(rid)

    def finish(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        self.plugin.request_finished(rid)
        if req is not None:
            self._free += req.blocks


__all__ = ["PagedEngine"]
