"""The engine's batch KV cache: a preallocated buffer with one row ("slot") per running sequence.

Layout: per attention layer, keys and values ``[slots, kv_heads, capacity, head_dim]``. A sequence owns one slot
from its admission to its end; its token at position ``p`` lives in column ``p`` of its slot. Joining takes a free
slot and leaving frees it: nothing else is copied (the old layout merged and trimmed one ``DynamicCache`` for the
whole batch at every join and leave). Memory is bounded by ``slots × max_len`` positions per layer: both dimensions
grow by doubling on demand (a copy ``log2`` times in a replica's life, never per join or leave) up to the slots the
scheduler uses (``max_num_seqs``) and ``max_len`` (``max_model_len``).

The cache object is what the model's attention layers see as their ``cache`` (transformers calls
``cache.update(key_states, value_states, layer_idx, ...)`` in every attention layer and attends over what it
returns). Before each forward the runner sets a *plan*, one of:

* ``plan_rows``: a forward whose batch rows are slots ``0 .. rows-1`` (decode steps: one query token per row);
  new K/V are written at ``(slot, position)`` pairs, and attention reads the view ``[:rows, :, :kv_len]``
  (no copy);
* ``plan_single``: one sequence's prompt chunk, positions ``start .. start+q-1`` of one slot (chunked prefill,
  a cached prefix's continuation, prompt logprobs); attention reads the view ``[slot:slot+1, :, :start+q]``;
* ``plan_fresh``: a group of prompts prefilled from position 0 in one left-padded forward; each row's real tokens
  are scattered into its slot and attention uses the forward's own K/V (nothing before them exists).

The attention mask (4-D, ``True`` = attend, built by the runner) is what keeps a row from seeing other rows'
columns, stale columns of a reused slot, or padding.
"""

from __future__ import annotations

from typing import Any

import torch


def _grow(size: int, need: int, limit: int | None) -> int:
    """The next capacity ≥ ``need``: double ``size`` (at least 16) until it fits, capped at ``limit``."""
    size = max(size, 16)
    while size < need:
        size *= 2
    return min(size, limit) if limit is not None and need <= limit else size


class SlotKVCache:
    """Per-slot K/V buffers for every attention layer (see the module docstring).

    Args:
        max_len: positions per slot at most (``max_model_len``).
        device: where the buffers live (the model's device).
    Buffers are allocated at a layer's first ``update`` with that layer's head count, head dim and dtype.
    """

    def __init__(self, max_len: int, device: torch.device):
        self.max_len = max_len
        self.device = device
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.slot_cap = 0
        self.len_cap = 0
        self._free: list[int] = []  # free slots below ``_next``, lowest first
        self._next = 0  # slots ``>= _next`` were never used or were released from the top
        self.used: set[int] = set()
        # the current forward's plan (``plan_*``)
        self._mode = ""
        self._rows = 0
        self._kv_len = 0
        self._slot = 0
        self._start = 0
        self._dst: tuple[torch.Tensor, torch.Tensor] | None = None  # (slots, positions) of the written tokens
        self._src: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, columns) in the forward's K/V

    # ------------------------------------------------------------------ slots
    def alloc(self) -> int:
        """Take the lowest free slot (keeps the decode batch ``0 .. rows-1`` dense)."""
        if self._free:
            self._free.sort()
            slot = self._free.pop(0)
        else:
            slot = self._next
            self._next += 1
        self.used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back; its columns are left as they are (the next owner's mask hides them)."""
        self.used.discard(slot)
        self._free.append(slot)
        while self._next and (self._next - 1) in self._free:  # shrink the top so decode rows stay few
            self._next -= 1
            self._free.remove(self._next)

    def reset(self) -> None:
        """Free every slot (the buffers stay allocated)."""
        self.used.clear()
        self._free = []
        self._next = 0

    @property
    def rows(self) -> int:
        """Slots ``0 .. rows-1`` cover every used slot (the decode batch)."""
        return self._next

    def reserve(self, slots: int, length: int) -> None:
        """Make the buffers (existing and future layers) hold ``slots`` slots of ``length`` positions."""
        if slots > self.slot_cap:
            self.slot_cap = _grow(self.slot_cap, slots, None)
        if length > self.len_cap:
            self.len_cap = _grow(self.len_cap, length, self.max_len)

    def _buffers(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kb = self.keys.get(layer)
        if kb is None or kb.shape[0] < self.slot_cap or kb.shape[2] < self.len_cap:
            shape = (self.slot_cap, k.shape[1], self.len_cap, k.shape[3])
            nk = torch.zeros(shape, dtype=k.dtype, device=k.device)
            nv = torch.zeros(shape, dtype=k.dtype, device=k.device)
            if kb is not None:  # growth: copy what was there (rare: capacities double)
                s, t = kb.shape[0], kb.shape[2]
                nk[:s, :, :t] = kb
                nv[:s, :, :t] = self.values[layer]
            self.keys[layer], self.values[layer] = nk, nv
        return self.keys[layer], self.values[layer]

    # ------------------------------------------------------------------ plans
    def plan_rows(self, rows: int, kv_len: int, dst_slots: torch.Tensor, dst_pos: torch.Tensor,
                  src_rows: torch.Tensor) -> None:
        """Next forward: batch rows are slots ``0 .. rows-1`` with one query token each; row ``src_rows[i]``'s
        K/V go to ``(dst_slots[i], dst_pos[i])``; attention reads ``kv_len`` columns."""
        self.reserve(rows, kv_len)
        self._mode, self._rows, self._kv_len = "rows", rows, kv_len
        self._dst, self._src = (dst_slots, dst_pos), (src_rows, torch.zeros_like(src_rows))

    def plan_single(self, slot: int, start: int, q: int) -> None:
        """Next forward: one row, positions ``start .. start+q-1`` of ``slot``."""
        self.reserve(slot + 1, start + q)
        self._mode, self._slot, self._start, self._kv_len = "single", slot, start, start + q

    def plan_fresh(self, dst_slots: torch.Tensor, dst_pos: torch.Tensor, src_rows: torch.Tensor,
                   src_cols: torch.Tensor, max_slot: int, width: int) -> None:
        """Next forward: a left-padded group from position 0; the real token at ``(src_rows[i], src_cols[i])``
        goes to ``(dst_slots[i], dst_pos[i])``. ``max_slot``/``width`` size the buffers."""
        self.reserve(max_slot + 1, width)
        self._mode, self._kv_len = "fresh", width
        self._dst, self._src = (dst_slots, dst_pos), (src_rows, src_cols)

    def write(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """Copy the first ``n`` positions of per-layer ``(keys, values)`` ``[kv_heads, >=n, head_dim]`` (a cached
        prefix) into ``slot``."""
        self.reserve(slot + 1, n)
        for layer, (k, v) in enumerate(kv):
            kb, vb = self._buffers(layer, k[None])
            kb[slot, :, :n] = k[:, :n].to(kb.device)
            vb[slot, :, :n] = v[:, :n].to(vb.device)

    def read(self, slot: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of ``slot``'s first ``n`` positions, per layer ``(keys, values)`` ``[kv_heads, n, head_dim]``."""
        return [(self.keys[i][slot, :, :n], self.values[i][slot, :, :n]) for i in sorted(self.keys)]

    # ------------------------------------------------------------------ transformers' cache interface
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's K/V ``[B, kv_heads, q, head_dim]`` as planned; return the K/V to attend over."""
        kb, vb = self._buffers(layer_idx, key_states)
        if self._mode == "single":
            s, lo, hi = self._slot, self._start, self._kv_len
            kb[s, :, lo:hi] = key_states[0]
            vb[s, :, lo:hi] = value_states[0]
            return kb[s:s + 1, :, :hi], vb[s:s + 1, :, :hi]
        assert self._dst is not None and self._src is not None  # set with the plan
        (slots, pos), (rows, cols) = self._dst, self._src
        kb[slots, :, pos] = key_states[rows, :, cols]
        vb[slots, :, pos] = value_states[rows, :, cols]
        if self._mode == "fresh":
            return key_states, value_states
        return kb[:self._rows, :, :self._kv_len], vb[:self._rows, :, :self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns the current forward attends over (transformers asks when it derives positions itself; the runner
        always passes them)."""
        return self._kv_len

    def get_query_offset(self, layer_idx: int | None = None) -> int:
        """Position of the forward's first query token (transformers builds the mask itself only for a forward the
        runner passes no mask for: a prompt from position 0 without padding, where it takes SDPA's causal path)."""
        return self._start if self._mode == "single" else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int | None = None) -> tuple[int, int]:
        """(key length, key offset) of the forward (see ``get_query_offset``)."""
        return self._kv_len, 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the K/V buffers."""
        return sum(t.numel() * t.element_size() for t in list(self.keys.values()) + list(self.values.values()))
