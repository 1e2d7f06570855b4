"""`dsv41 cache stats|verify|clear [--cache-dir DIR] [--json]`: operate on a prefix cache's persistent tier (without
--cache-dir: every checkpoint's directory under the default location, `default_cache_root()/prefix`).

  stats    entries, bytes, fingerprints (namespaces), age of the oldest / newest entry, free disk; per namespace
           the token positions its prefix units store and the bytes per stored token beside the analytic global
           KV bytes per token of the stored records (sum over KV-source layers of (main + index record bytes) /
           m, `dsv41.analysis.kv_bytes`'s formula read off one entry's layout)
  verify   read every entry in full and check it (header, lengths, key, SHA-256); report bad ones and remove them
           (--keep: report only). Exit status 1 when bad entries were found.
  clear    remove every entry (temp files of live writers are left to them)

Wiring: the CLI's command table calls `register(subparsers)`. Works on the directory alone (no model): the store is
opened without a fingerprint, so entries of every namespace are considered.

Where the cache lives. `dsv41 serve` caches prefixes by default (`--cache-dir auto --swa-pool auto`): the SWA pool
in the process's memory and the persistent tier in `default_cache_root()/prefix/<weights fingerprint>`, the root
being $DSV41_CACHE_DIR, else $XDG_CACHE_HOME/dsv41, else ~/.cache/dsv41; `--cache-dir none` / `--swa-pool none`
turn them off. `dsv41 generate` (one request per process, so no SWA pool outlives it) keeps both off unless given.
`resolve_prefix_flags` turns the flags into the engine's arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Callable

AUTO, OFF = "auto", "none"


def default_cache_root() -> Path:
    """$DSV41_CACHE_DIR, else $XDG_CACHE_HOME/dsv41, else ~/.cache/dsv41."""
    if os.environ.get("DSV41_CACHE_DIR"):
        return Path(os.environ["DSV41_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "dsv41"


def resolve_prefix_flags(cache_dir: str | None, swa_pool: str | None, packed: bool,
                         weights_id: Callable[[], str]) -> tuple[str | None, str | None]:
    """(cache_dir, swa_pool) for the engine from --cache-dir / --swa-pool: None or "none" is off; "auto" is the
    default directory `default_cache_root()/prefix/<weights_id()>` / the in-process pool ("memory") when the
    model keeps the packed store (`packed`; prefix caching stores packed KV), else off; anything else as given."""
    def pick(value, auto):
        if value is None or value.lower() == OFF:
            return None
        return (auto() if packed else None) if value.lower() == AUTO else value
    return (pick(cache_dir, lambda: str(default_cache_root() / "prefix" / weights_id())),
            pick(swa_pool, lambda: "memory"))


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("cache", help="prefix cache: stats, verify, clear",
                       description=__doc__.split("\n\n")[0])
    csub = p.add_subparsers(dest="cache_command", required=True)
    for name, helptext in (("stats", "entries, bytes, namespaces, ages"),
                           ("verify", "check every entry's checksum; remove bad ones"),
                           ("clear", "remove every entry")):
        c = csub.add_parser(name, help=helptext)
        c.add_argument("--cache-dir", default=None, help="the persistent tier's directory (default: every "
                       "checkpoint's under the default location, see `dsv41 serve --help`)")
        c.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "verify":
            c.add_argument("--keep", action="store_true", help="report bad entries without removing them")
        c.set_defaults(func=cmd_cache)
    return p


def _open(cache_dir: str):
    from dsv41.kv.disk import DiskStore

    if not os.path.isdir(cache_dir):
        raise ValueError(f"no such cache directory: {cache_dir}")
    # no fingerprint: every namespace; repair=False: opening changes nothing (verify / clear do, explicitly)
    return DiskStore(cache_dir, max_bytes=1 << 62, fingerprint=None, repair=False)


def _analytic_bytes_per_token(path) -> float | None:
    """Sum over the layers of the unit entry at `path` of (main + index record bytes) / ratio, or None when the
    file is not a readable unit entry."""
    from dsv41.kv.disk_files import read_file
    from dsv41.kv.disk_format import BadEntry, parse_entry
    from dsv41.kv.state_format import GlobalState

    try:
        st = GlobalState.from_bytes(parse_entry(read_file(path)[0])[2])
    except (OSError, BadEntry, ValueError):
        return None
    return sum((ls.main.size(1) + ls.index.size(1)) / ls.ratio for ls in st.layers)


def _namespace_stats(store, entries: list[dict]) -> dict[str, dict]:
    """Per fingerprint: entries, bytes, token positions stored by prefix units (sum of their segments' lengths),
    bytes per stored token and the analytic figure beside it."""
    from dsv41.kv.disk import SUFFIX
    from dsv41.kv.manager import parse_unit_meta

    fps: dict[str, dict] = {}
    smallest: dict[str, dict] = {}
    for e in entries:
        d = fps.setdefault(e["fingerprint"], {"entries": 0, "bytes": 0, "units": 0, "tokens": 0})
        d["entries"] += 1
        d["bytes"] += e["size"]
        unit = parse_unit_meta(e["meta"])
        if unit is not None:
            d["units"] += 1
            d["tokens"] += unit.boundary - unit.start
            if e["fingerprint"] not in smallest or e["size"] < smallest[e["fingerprint"]]["size"]:
                smallest[e["fingerprint"]] = e
    for fp, d in fps.items():
        d["bytes_per_token"] = d["bytes"] / d["tokens"] if d["tokens"] else None
        d["analytic_bytes_per_token"] = (_analytic_bytes_per_token(store.dir / (smallest[fp]["key"] + SUFFIX))
                                         if fp in smallest else None)
    return fps


def cache_stats(cache_dir: str) -> dict:
    store = _open(cache_dir)
    now = time.time()
    entries = store.describe()
    fps = _namespace_stats(store, entries)
    created = [e["created"] for e in entries]
    s = store.stats()
    return {"cache_dir": os.path.abspath(cache_dir), "entries": s["entries"], "bytes": s["bytes"],
            "fingerprints": fps, "oldest_age_s": now - min(created) if created else None,
            "newest_age_s": now - max(created) if created else None,
            "temp_files": sum(n.startswith(".tmp.") for n in os.listdir(cache_dir)),
            "unreadable_entries": len(store.entry_files()) - s["entries"], "free_bytes": s["free_bytes"]}


def cmd_cache(args: argparse.Namespace) -> int:
    if args.cache_dir is not None:
        return _cmd_one(args, args.cache_dir)
    root = default_cache_root() / "prefix"
    dirs = sorted(str(d) for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
    if not dirs and not args.json:
        print(f"no prefix cache under {root}")
    return max((_cmd_one(args, d) for d in dirs), default=0)


def _cmd_one(args: argparse.Namespace, cache_dir: str) -> int:
    cmd = args.cache_command
    if cmd == "stats":
        r = cache_stats(cache_dir)
    else:
        store = _open(cache_dir)
        r = store.verify(remove=not args.keep) if cmd == "verify" else store.clear()
    if args.json:
        print(json.dumps(r, indent=None if cmd == "clear" else 2))
    elif cmd == "stats":
        print(f"prefix cache {r['cache_dir']}: {r['entries']:,} entries, {r['bytes']:,} B "
              f"({r['free_bytes']:,} B free on the file system)")
        for fp, d in sorted(r["fingerprints"].items()):
            print(f"  namespace {fp[:16]}…  {d['entries']:,} entries  {d['bytes']:,} B", end="")
            if d["tokens"]:
                a = d["analytic_bytes_per_token"]
                vs = f", analytic global KV {a:,.1f} B/token: x{d['bytes_per_token'] / a:.3f}" if a else ""
                print(f"  {d['tokens']:,} token positions stored: {d['bytes_per_token']:,.1f} B/token{vs}", end="")
            print()
        if r["oldest_age_s"] is not None:
            print(f"  oldest entry {r['oldest_age_s'] / 3600:.2f} h, newest {r['newest_age_s'] / 3600:.2f} h")
        print(f"  temp files {r['temp_files']}; entries with an unreadable header {r['unreadable_entries']} "
              "(`dsv41 cache verify` removes them)")
    elif cmd == "verify":
        print(f"verified {r['checked']:,} entries: {r['ok']:,} ok ({r['ok_bytes']:,} B), {len(r['bad'])} bad, "
              f"{r['removed']} removed")
        for b in r["bad"]:
            print(f"  {b['key']}: {b['reason']}")
    else:
        print(f"removed {r['removed']:,} entries ({r['bytes']:,} B) from {os.path.abspath(cache_dir)}")
    return 1 if cmd == "verify" and r["bad"] else 0
