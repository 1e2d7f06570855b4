"""Engram: n-gram hash lookups written into the hyper-connection stream (docs/model.md §6).

Legend: B batch, T tokens (of this call), S hc streams (`hc_mult`), D width (`dim`), G hash columns per engram
layer (`(engram_max_ngram_size - 1) * engram_n_heads`), N `engram_max_ngram_size`, E engram layers, R table rows,
W row width (`engram_head_dim`).

Pipeline (docs/model.md §6.1-6.3):
  1. every raw token id is mapped to a *compressed* id (tokens that normalise alike collapse together);
  2. `NgramHasher` hashes, for every position, the 2-gram .. N-gram ending there into G bucket ids per engram
     layer (rolling XOR of id * odd multiplier, reduced modulo one prime per (n-gram size, head), offset so that
     every column owns a disjoint range of the layer's table);
  3. `Engram` (one per engram layer) fetches those G table rows, projects them to S keys and one shared value,
     and adds `gate_k * value` to every stream k, the gate being a normalised stream/key dot product.

Differences in form (not in values) from the official code:
  * The official `NgramHashState` keeps a `[max_batch, max_seq_len]` cache of compressed ids. Here the hasher is
    stateless per call: the caller carries `history`, the compressed ids of the N-1 positions before the chunk
    (DEAD = -1 for positions before the sequence start or inside an image span). Because the official look-back
    treats "before the start" and "DEAD" identically (both block, cumulatively), one-shot prefill, chunked prefill
    and one-token decode all give the same hash ids.
  * The official table stays fp8 (+ one ue8m0 scale per 32) and is dequantized then cast to bf16 on lookup. Here
    `embed.weight` holds the dequantized table (every such value is exact in bf16, so holding it in bf16 or fp32
    loses nothing), or, packed (`PackedTable`), the checkpoint's bytes with only the looked-up rows decoded; the
    looked-up rows are cast to the stream's dtype.
  * A config whose `engram_num_embeddings` disagree with the prime layout raises ValueError (the official code
    would silently read zero rows for out-of-range ids).
"""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import count as count_from, islice
from typing import Sequence

import numpy as np
import torch
from torch import nn

from dsv41.codecs.weights import pack_weight, rows_values, stored_shapes
from dsv41.kernels.invariant import row_mean, row_sum, rsqrt, sigmoid
from dsv41.model.common import Linear, building_packed

DEAD = -1           # compressed id of a position that takes no part in an n-gram (docs/model.md §6.2)
GATE_CLAMP = 1e-6   # |dot| floor before the signed square root (docs/model.md §6.3, §10.1)


# ------------------------------------------------------------------------------------------------ 6.1 token map

def _engram_normalizer():
    """NFKC, NFD, strip accents, lowercase, collapse [ \\t\\r\\n]+ to one space, strip; a text that is exactly
    one space survives the strip through a private-use sentinel (docs/model.md §6.1)."""
    from tokenizers import Regex, normalizers

    keep = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), keep),
        normalizers.Strip(),
        normalizers.Replace(keep, " "),
    ])


def build_compressed_token_map(tokenizer) -> tuple[torch.Tensor, int]:
    """(map [V] int64, compressed vocab size) for a `tokenizers.Tokenizer` (docs/model.md §6.1).

    V = the tokenizer's size including added tokens (what `len()` of a transformers fast tokenizer reports). Each
    id is decoded alone, special tokens kept. A text holding U+FFFD (a partial UTF-8 byte token) is keyed by the
    raw token string; any other text by its normalised form (or the text itself if normalising empties it).
    Compressed ids are handed out in first-seen order over ids 0..V-1. A transformers tokenizer is accepted too
    (its `backend_tokenizer` is used)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    n = backend.get_vocab_size(with_added_tokens=True)
    norm = _engram_normalizer()
    key_ids: dict[str, int] = {}
    out = [0] * n
    for tid in range(n):
        text = backend.decode([tid], skip_special_tokens=False)
        key = backend.id_to_token(tid) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out[tid] = key_ids.setdefault(key, len(key_ids))
    return torch.tensor(out, dtype=torch.long), len(key_ids)


def identity_token_map(vocab_size: int) -> tuple[torch.Tensor, int]:
    """(arange(V), V): compressed id = raw id.

    Project convention for models without a tokenizer (random / preset models): their config must then say
    `engram_compressed_vocab_size == vocab_size`, since the multipliers are derived from that size."""
    return torch.arange(vocab_size, dtype=torch.long), int(vocab_size)


# ------------------------------------------------------------------------------------------------ 6.2 primes

def is_prime(n: int) -> bool:
    """Trial division by the odd numbers up to sqrt(n): ~2000 steps at the release's 1.6e7 (the primes are
    searched once per config, `_primes` is cached)."""
    if n < 3 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@lru_cache(maxsize=32)
def _primes(count: int, start: int) -> tuple[int, ...]:
    """The first `count` primes >= start."""
    return tuple(islice(filter(is_prime, count_from(start)), count))


def engram_primes(cfg) -> list[list[list[int]]]:
    """Bucket moduli [engram layer][n-gram size index (2-gram first)][head] (docs/model.md §6.2).

    One global "seen" set; for every layer and every n-gram size the search restarts just below
    `engram_vocab_size` (the first candidate is engram_vocab_size itself) and takes the next `engram_n_heads`
    primes not handed out yet. Every prime such a search skips has been handed out already, so this deals out
    the consecutive primes from engram_vocab_size on, in (layer, n-gram size, head) order. Released config: the
    48 consecutive primes from 16000057 on."""
    E, K, H = len(cfg.engram_layer_ids), cfg.engram_max_ngram_size - 1, cfg.engram_n_heads
    flat = _primes(E * K * H, cfg.engram_vocab_size)
    return [[list(flat[(e * K + k) * H:(e * K + k + 1) * H]) for k in range(K)] for e in range(E)]


def check_engram_tables(cfg, primes: list[list[list[int]]] | None = None) -> None:
    """Raise ValueError naming `engram_num_embeddings` unless every layer's table has sum(its primes) rows."""
    primes = engram_primes(cfg) if primes is None else primes
    want = tuple(sum(sum(h) for h in layer) for layer in primes)
    have = tuple(cfg.engram_num_embeddings)
    if have != want:
        raise ValueError(f"config field 'engram_num_embeddings' = {list(have)!r}: the hash layout (primes from "
                         f"engram_vocab_size={cfg.engram_vocab_size}, {cfg.engram_n_heads} heads, n-grams up to "
                         f"{cfg.engram_max_ngram_size}) needs {list(want)!r} rows per engram layer")


def hash_column_offsets(primes_of_layer: Sequence[Sequence[int]]) -> list[int]:
    """Exclusive cumulative sum of one layer's G primes, in column order (2-gram heads, 3-gram heads, ...)."""
    flat = [p for per_ngram in primes_of_layer for p in per_ngram]
    return [0] + list(np.cumsum(flat[:-1]).tolist()) if flat else []


def hash_multipliers(cfg, layer_id: int) -> torch.Tensor:
    """Odd multipliers [N] int64 of one engram layer, seeded by the layer *id* (docs/model.md §6.2).

    `numpy.random.default_rng(10007 * layer_id).integers(0, bound, size=N, dtype=int64) * 2 + 1`, with
    bound = max(1, ((2^63 - 1) // engram_compressed_vocab_size) // 2), which keeps id * multiplier in int64."""
    bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
    rng = np.random.default_rng(10007 * layer_id)
    v = rng.integers(low=0, high=bound, size=(cfg.engram_max_ngram_size,), dtype=np.int64)
    return torch.from_numpy(v * 2 + 1)


# ------------------------------------------------------------------------------------------------ 6.2 hashing

class NgramHasher(nn.Module):
    """Hash ids of every position for all engram layers; stateless per call (docs/model.md §6.2).

    `hasher(input_ids [B,T], history [B,N-1] | None, token_mask [B,T] | None)` returns
    `(hash_ids [B,T,E,G] int64, new_history [B,N-1] int64)`.

    `history` holds the compressed ids of the N-1 positions before this chunk, oldest first, DEAD (-1) for a
    position before the sequence start or inside an image span; `init_history(B)` (all DEAD) starts a sequence
    and `new_history` continues it. Positions whose `token_mask` is False are DEAD. For position p the look-back
    token at shift s (0..N-1) is the compressed id at p-s; a `blocked` flag turns on at the first DEAD slot and
    stays on for larger shifts (a DEAD token at shift 0 blocks all), and every blocked slot takes `pad_id` (the
    compressed id of `engram_pad_id`). Then h = t0*m0, and for n = 1..N-1, h ^= t_n*m_n, column block n-1 =
    h mod prime[layer][n-1][head] + offset (int64 throughout)."""

    def __init__(self, cfg, token_map: torch.Tensor | Sequence[int] | tuple, compressed_vocab_size: int | None = None):
        super().__init__()
        if isinstance(token_map, tuple) and len(token_map) == 2 and isinstance(token_map[1], int):
            token_map, compressed_vocab_size = token_map
        tmap = torch.as_tensor(token_map, dtype=torch.long).flatten()
        size = int(tmap.max()) + 1 if compressed_vocab_size is None else int(compressed_vocab_size)
        if size != cfg.engram_compressed_vocab_size:
            raise ValueError(f"config field 'engram_compressed_vocab_size' = {cfg.engram_compressed_vocab_size}: "
                             f"the token map has {size} compressed ids")
        if int(tmap.min()) < 0 or int(tmap.max()) >= size:
            raise ValueError(f"token map values must lie in [0, {size})")
        if not 0 <= cfg.engram_pad_id < tmap.numel():
            raise ValueError(f"config field 'engram_pad_id' = {cfg.engram_pad_id}: outside the token map "
                             f"({tmap.numel()} ids)")
        primes = engram_primes(cfg)
        check_engram_tables(cfg, primes)
        N = self.max_ngram = cfg.engram_max_ngram_size
        self.pad_id = int(tmap[cfg.engram_pad_id])
        if tmap.numel() < cfg.vocab_size:       # ids past a small tokenizer's vocabulary (an untrained model can
            tmap = torch.cat([tmap, tmap.new_full((cfg.vocab_size - tmap.numel(),), self.pad_id)])   # emit them)
        E, H = len(cfg.engram_layer_ids), cfg.engram_n_heads
        mult = [hash_multipliers(cfg, L) for L in cfg.engram_layer_ids]
        buffers = {"token_map": tmap,
                   "primes": torch.tensor(primes, dtype=torch.long).reshape(E, N - 1, H),              # [E, N-1, H]
                   "offsets": torch.tensor([hash_column_offsets(p) for p in primes],
                                           dtype=torch.long).reshape(E, (N - 1) * H),                 # [E, G]
                   "multipliers": torch.stack(mult) if mult else torch.zeros(0, N, dtype=torch.long)}  # [E, N]
        for name, t in buffers.items():
            self.register_buffer(name, t, persistent=False)

    def init_history(self, batch: int, device: torch.device | str | None = None) -> torch.Tensor:
        """All-DEAD history [B, N-1]: the state before a sequence's first token."""
        return torch.full((batch, self.max_ngram - 1), DEAD, dtype=torch.long,
                          device=self.token_map.device if device is None else device)

    def compress(self, input_ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Compressed ids [B,T], DEAD where token_mask is False."""
        c = self.token_map[input_ids]
        return c if token_mask is None else torch.where(token_mask.to(torch.bool), c, torch.full_like(c, DEAD))

    def forward(self, input_ids: torch.Tensor, history: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = input_ids.shape
        k = self.max_ngram - 1
        if history is None:
            history = self.init_history(B, input_ids.device)
        if history.shape != (B, k):
            raise ValueError(f"history must be [B={B}, {k}], got {tuple(history.shape)}")
        ext = torch.cat([history.to(torch.long), self.compress(input_ids, token_mask)], dim=1)  # [B, k+T]
        look = torch.stack([ext[:, k - s:k - s + T] for s in range(self.max_ngram)], dim=-1)  # [B, T, N] by shift
        blocked = (look == DEAD).cumsum(-1) > 0                              # on from the first DEAD shift
        toks = look.masked_fill(blocked, self.pad_id)                        # [B, T, N]
        prod = toks.unsqueeze(2) * self.multipliers                          # [B, T, E, N]
        h = prod[..., 0]
        cols = []
        for n in range(1, self.max_ngram):
            h = torch.bitwise_xor(h, prod[..., n])                           # hash of the (n+1)-gram, >= 0
            cols.append(h.unsqueeze(-1) % self.primes[:, n - 1])             # [B, T, E, H]
        hash_ids = torch.cat(cols, dim=-1) + self.offsets                    # [B, T, E, G]
        return hash_ids, ext[:, T:].contiguous()                             # new history: the last k ids


# ------------------------------------------------------------------------------------------------ 6.3 lookup, gate

PACK_CHUNK = 1 << 26      # table elements packed per chunk by `PackedTable.of`


class PackedTable(nn.Module):
    """An Engram hash table as the checkpoint stores it (docs/model.md §9): `weight` e4m3 codes [R, W] and `scale`
    one e8m0 per row and 32 values [R, W/32] (uint8 buffers under the checkpoint's names). A lookup gathers the
    rows' bytes and decodes only those, to the values the dequantized table holds in `held_dtype`.

    `host` (set by `dsv41.model.packed_weights.engram_tables_on_host`): the table stays in host memory when the
    model moves to an accelerator. The rows a step needs are known from its token ids before any layer runs, so
    `prefetch` (called by the model right after hashing) gathers them on the host into pinned memory and copies
    only those bytes to the device on a side stream; the copy overlaps the blocks below this table's layer, and
    the lookup waits for it on the device (no host synchronisation at the layer). On the CPU the same code path
    runs without the copy (docs/model.md §9).

    `static` (set by the graph-captured decode step, `dsv41.engine.graphs`): device buffers (codes [n, W], scales
    [n, W/32]) the step's rows are copied into before each replay; a lookup then decodes them as they stand (the
    ids' order, n = the ids' count) and `prefetch` leaves them alone."""

    host = False
    static: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, rows: int, width: int, held_dtype: torch.dtype):
        super().__init__()
        codes, scales = stored_shapes("fp8_rows", rows, width)
        self.register_buffer("weight", torch.empty(codes, dtype=torch.uint8))
        self.register_buffer("scale", torch.empty(scales, dtype=torch.uint8))
        self.held_dtype = held_dtype
        self._ahead: _Ahead | None = None          # the rows `prefetch` started for the next lookup
        self._staging: tuple[torch.Tensor, torch.Tensor] | None = None     # pinned host buffers, reused
        self._copied = None                         # the event of the last copy out of them

    def _apply(self, fn, recurse=True):
        """`.to(device)` / `.cuda()` of the model: a host table stays where it is (its buffers are uint8, so no
        dtype conversion applies to them either)."""
        return self if self.host else super()._apply(fn, recurse)

    @classmethod
    @torch.no_grad()
    def of(cls, table: torch.Tensor) -> "PackedTable":
        """The packed storage of a dense table [R, W] (exact for checkpoint-representable rows). Rows are packed
        independently, so a huge table is packed in chunks of rows: the float temporaries stay small (a whole
        v41-geometry table's fp32 copies do not fit beside the model on an 80 GB GPU)."""
        out = cls(*table.shape, table.dtype).to(table.device)
        rows = max(1, PACK_CHUNK // max(1, table.size(1)))
        for r0 in range(0, table.size(0), rows):
            codes, scale = pack_weight(table[r0:r0 + rows], "fp8_rows")
            out.weight[r0:r0 + rows].copy_(codes)
            out.scale[r0:r0 + rows].copy_(scale)
        return out

    def dense(self) -> torch.Tensor:
        """The dequantized table [R, W] in `held_dtype`."""
        return rows_values(self.weight, self.scale).to(self.held_dtype)

    def _gather_pinned(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows `flat` [n] (host ids) gathered into this table's pinned staging buffers (grown on demand; the
        previous copy out of them finished first)."""
        n, (W, Ws) = flat.numel(), (self.weight.size(1), self.scale.size(1))
        if self._copied is not None:
            self._copied.synchronize()
        if self._staging is None or self._staging[0].size(0) < n:
            pin = torch.cuda.is_available()
            self._staging = tuple(torch.empty(n, w, dtype=torch.uint8, pin_memory=pin) for w in (W, Ws))
        codes, scale = self._staging[0][:n], self._staging[1][:n]
        torch.index_select(self.weight, 0, flat, out=codes)
        torch.index_select(self.scale, 0, flat, out=scale)
        return codes, scale

    def stage(self, flat: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """The rows `flat` [n] (host ids) into the buffers codes [n, W] / scale [n, W/32] (the static step's, on the
        device): gathered into pinned memory and copied on the current stream (the copy's event guards the staging
        buffers' reuse); on the CPU gathered straight into them."""
        if codes.device.type != "cuda":
            torch.index_select(self.weight, 0, flat, out=codes)
            torch.index_select(self.scale, 0, flat, out=scale)
            return
        codes_h, scale_h = self._gather_pinned(flat)
        codes.copy_(codes_h, non_blocking=True)
        scale.copy_(scale_h, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def prefetch(self, ids: torch.Tensor, ids_host: torch.Tensor) -> None:
        """Start fetching the rows of `ids` [...] (on the device the lookup will run on; `ids_host` the same ids
        in host memory) for the next `forward(ids)`. A host table on a CUDA device: gathered into pinned memory,
        copied on the device's side stream; anywhere else: gathered (the same path, no copy)."""
        flat = ids_host.reshape(-1)
        if ids.device.type != "cuda" or self.weight.device.type == "cuda":
            at = flat.to(self.weight.device)
            self._ahead = _Ahead(ids, self.weight[at], self.scale[at], None)
            return
        codes_h, scale_h = self._gather_pinned(flat)
        main, side = torch.cuda.current_stream(ids.device), _side_stream(ids.device)
        codes = torch.empty(codes_h.shape, dtype=torch.uint8, device=ids.device)
        scale = torch.empty(scale_h.shape, dtype=torch.uint8, device=ids.device)
        side.wait_stream(main)                      # the buffers above were allocated on the main stream
        with torch.cuda.stream(side):
            codes.copy_(codes_h, non_blocking=True)
            scale.copy_(scale_h, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        codes.record_stream(side)
        scale.record_stream(side)
        self._ahead, self._copied = _Ahead(ids, codes, scale, event), event

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 -> rows [..., W] in `held_dtype`, on the ids' device: the prefetched rows when
        `prefetch(ids)` started them, else gathered now (a host table: only these rows cross to the device)."""
        if self.static is not None:
            codes, scale = self.static
            return rows_values(codes, scale).to(self.held_dtype).unflatten(0, ids.shape)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.serves(ids):
            if ahead.event is not None:
                torch.cuda.current_stream(ids.device).wait_event(ahead.event)
            codes, scale = ahead.codes, ahead.scale
        else:
            at = ids.reshape(-1).to(self.weight.device)
            codes, scale = self.weight[at], self.scale[at]
            if codes.device != ids.device:
                codes, scale = codes.to(ids.device, non_blocking=True), scale.to(ids.device, non_blocking=True)
        return rows_values(codes, scale).to(self.held_dtype).unflatten(0, ids.shape)


class _Ahead:
    """Rows fetched ahead for one lookup: its ids (kept alive, so their address identifies them), the rows'
    codes [n, W] and scales [n, W/32] on the lookup's device, the copy's event (None: no copy)."""

    def __init__(self, ids: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, event):
        self.ids, self.codes, self.scale, self.event = ids, codes, scale, event

    def serves(self, ids: torch.Tensor) -> bool:
        a = self.ids
        return (ids.data_ptr() == a.data_ptr() and ids.shape == a.shape and ids.stride() == a.stride()
                and ids.device == a.device)


_SIDE: dict = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One copy stream per CUDA device (host-table prefetches)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=key)
    return _SIDE[key]


def prefetch_host_rows(engrams: Sequence["Engram"], hashes: torch.Tensor) -> None:
    """Start fetching every host table's rows of this step (`hashes` [B,T,E,G] from `NgramHasher`): one copy of
    the ids to the host, then each table's gather and copy (`PackedTable.prefetch`). Device tables: nothing."""
    hosts = [e for e in engrams if e.packed and e.embed.host and e.embed.static is None]
    if not hosts:
        return
    ids_host = hashes.to("cpu")
    for e in hosts:
        e.embed.prefetch(hashes[:, :, e.layer_index], ids_host[:, :, e.layer_index])


class Engram(nn.Module):
    """One engram layer: X [B,T,S,D] -> X' [B,T,S,D] (docs/model.md §6.3), applied before its block.

    Parameters (official checkpoint names under `layers.{L}.engram.`): `embed.weight` [R, W] (dequantized),
    `wkv.weight` [D*(S+1), G*W] (fp8 Linear), `q_weight`, `k_weight` [S, D].

    rows = embed(hash_ids) [B,T,G,W] -> [B,T,G*W] in the stream's dtype; kv = wkv(rows) (FP8 activation QDQ
    inside the Linear); key [B,T,S,D], value [B,T,D]. In fp32, with w = q_weight * k_weight and h = X:
      dot_k  = sum_D(h_k * w_k * key_k) * rsqrt(mean_D h_k^2 + eps) * rsqrt(mean_D key_k^2 + eps) * D^-0.5
      gate_k = sigmoid(copysign(sqrt(max(|dot_k|, 1e-6)), dot_k)),  0 where token_mask is False
      X'_k   = (h_k + gate_k * value) cast to X's dtype (the value is shared by all S streams)."""

    def __init__(self, cfg, layer_id: int, dtype: torch.dtype | None = None):
        super().__init__()
        if layer_id not in cfg.engram_layer_ids:
            raise ValueError(f"config field 'engram_layer_ids' = {list(cfg.engram_layer_ids)!r}: no engram at "
                             f"layer {layer_id}")
        check_engram_tables(cfg)
        self.layer_index = tuple(cfg.engram_layer_ids).index(layer_id)  # slice of NgramHasher's E axis
        self.eps = cfg.norm_eps
        self.n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        S, D, W = cfg.hc_mult, cfg.dim, cfg.engram_head_dim
        # the hash table [R, W]: held dequantized (official: e4m3 rows times one ue8m0 scale per 32, exact in bf16)
        # or packed as the checkpoint stores it (`PackedTable`)
        R = cfg.engram_num_embeddings[self.layer_index]
        if building_packed():
            self.embed = PackedTable(R, W, dtype or torch.get_default_dtype())
        else:
            self.embed = nn.Embedding.from_pretrained(torch.empty(R, W, dtype=dtype), freeze=False)
        self.wkv = Linear(self.n_cols * W, D * (S + 1), kind="fp8", dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(S, D, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(S, D, dtype=dtype))

    @property
    def packed(self) -> bool:
        return isinstance(self.embed, PackedTable)

    def pack(self) -> None:
        """Hold the table as the checkpoint stores it (`PackedTable`); `unpack` goes back to the dense Embedding."""
        if not self.packed:
            self.embed = PackedTable.of(self.embed.weight.detach())

    def unpack(self) -> None:
        if self.packed:
            self.embed = nn.Embedding.from_pretrained(self.embed.dense(), freeze=False)

    def forward(self, x: torch.Tensor, hash_ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, S, D = x.shape
        if hash_ids.shape != (B, T, self.n_cols):
            raise ValueError(f"hash_ids must be [B={B}, T={T}, G={self.n_cols}], got {tuple(hash_ids.shape)}")
        rows = self.embed(hash_ids).flatten(-2).to(x.dtype)                 # [B, T, G*W]
        key, value = self.wkv(rows).split([S * D, D], dim=-1)
        key = key.float().unflatten(-1, (S, D))                              # [B, T, S, D]
        w = self.q_weight.float() * self.k_weight.float()                    # [S, D]
        h = x.float()
        # normalised per (token, stream) over D, applied after the dot product (docs/model.md §10.2 item 6)
        rstd = rsqrt(row_mean(h.square()) + self.eps) * rsqrt(row_mean(key.square()) + self.eps)
        dot = row_sum(h * w * key) * rstd * D ** -0.5                       # [B, T, S]
        gate = sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.to(torch.bool).unsqueeze(-1), 0.0)
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(x.dtype)
