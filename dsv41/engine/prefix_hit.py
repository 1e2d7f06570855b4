"""Which prefix-cache hit a new prompt resumes from (docs/system.md §4): the device tier's shared pages or the disk
tier's stored state, as one `PrefixHit` the engine applies the same way."""

from __future__ import annotations

from dataclasses import dataclass

from dsv41.kv.device_tier import DeviceTier

__all__ = ["PrefixHit", "prefix_hit"]


@dataclass
class PrefixHit:
    """A prefix-cache hit as the engine applies it: positions 0..boundary-1 restored by `restore(sid)` (pages shared
    from the device tier, or the disk tier's global state imported), the SWA snapshot at the boundary or None
    (replay), the path and the cached tokens per tier for the usage."""

    boundary: int
    swa_state: object
    path: str
    tiers: dict
    restore: object


def prefix_hit(engine, seq) -> PrefixHit | None:
    """The prefix hit a new text prompt resumes from (docs/system.md §4), or None: the device tier first
    (pages of a retained or running sequence, shared: no disk read), taken when its SWA snapshot is in the
    pool (an exact resume) or the disk tier has nothing longer; the disk tier otherwise. In the deterministic
    mode only exact resumes (a replay would approximate)."""
    ids, salt = seq.prompt_ids, seq.params.cache_salt
    if not engine.prefix_cache or len(ids) <= 1 or seq.vision is not None:
        return None
    dev = swa = None
    if engine.device_tier is not None:
        running = {r.sid: DeviceTier.source((r.prompt_ids + r.output_ids)[:engine.pool.seqs[r.sid].pos],
                                            r.params.cache_salt)
                   for r in engine.running if r.sid is not None and r.vision is None and r is not seq}
        hits = engine.device_tier.lookup(ids, len(ids) - 1, salt, running)
        for h in hits:                        # the longest with its SWA snapshot in the pool, else the longest
            swa = engine.prefix_cache.swa_at(ids, h.boundary, salt)
            if swa is not None:
                dev = h
                break
        dev = dev or (hits[0] if hits else None)
    disk = None
    if dev is None or swa is None:
        disk = engine.prefix_cache.lookup(ids, max_len=len(ids) - 1, salt=salt)
    if disk is not None and disk.swa_state is None and engine.deterministic:
        disk = None
    if dev is not None and (swa is not None or not engine.deterministic) and (
            disk is None or disk.boundary < dev.boundary
            or (disk.boundary == dev.boundary and (swa is not None or disk.swa_state is None))):
        engine.device_tier.use(dev)
        U, anchor = dev.boundary, dev.anchor
        history = anchor.engram_history if anchor is not None else None
        if history is None and engine.model.engram_hasher is not None:
            from dsv41.kv.prefix import engram_history_at
            history = engram_history_at(engine.model.engram_hasher, ids, U)
        carries = None if anchor is None else anchor.carries
        return PrefixHit(U, swa, "swa-hit" if swa is not None else "replay",
                         {"device": U, "swa": U if swa is not None else 0},
                         lambda sid: engine.pool.share_prefix(sid, dev.source, U, carries, history))
    if disk is None:
        return None
    return PrefixHit(disk.boundary, disk.swa_state, disk.path, dict(disk.tiers),
                     lambda sid: engine.pool.import_global(sid, disk.global_state))
