"""`dsv41 analyze {kv,params,flops,io,memory}`: the docs/system.md §1 numbers, computed from a config."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from dsv41.analysis.flops import DEFAULT_CONTEXTS, flops_report, plot_decode_curve
from dsv41.analysis.io import io_overlap, raw_bytes_per_image_token, training_flops_per_token, vit_tokens
from dsv41.analysis.kv_bytes import kv_report
from dsv41.analysis.memory import (DENSE_POLICIES, H200_USABLE_BYTES, HOLDING_DTYPES, PREFILL_CHUNK, memory_report,
                                   parallel_plan)
from dsv41.analysis.params import params_report
from dsv41.config import ModelConfig, load_config, parse_tokens, role_summary

DEFAULT_CONFIG = "v41-flash"


def _g(x: float, unit: float = 1e9, nd: int = 2) -> str:
    return f"{x / unit:,.{nd}f}"


# Each subcommand is a pair: report(cfg, args) -> the JSON-ready dict, and table(cfg, args, report) printing it.

# ------------------------------------------------------------------------------------------ kv

def _kv_report(cfg: ModelConfig, args: argparse.Namespace) -> dict[str, Any]:
    return {**kv_report(cfg), "config": args.config, "modes": role_summary(cfg)["modes"]}


def _kv_table(cfg: ModelConfig, args: argparse.Namespace, r: dict[str, Any]) -> None:
    print(f"KV cache bytes, config {args.config}")
    print(f"  main KV entry      {r['main_entry_bytes']:>8} B   (E2M1 codes + one E4M3 scale per 16)")
    print(f"  indexer K entry    {r['indexer_entry_bytes']:>8} B   (MXFP4: E2M1 + one E8M0 per 32)")
    print(f"  global entry       {r['global_entry_bytes']:>8} B")
    for s in r["kv_source_layers"]:
        print(f"    KV source layer {s['layer']:>3}  m={s['ratio']}  {s['bytes_per_token']:>8} B/token")
    print(f"  global KV          {r['global_kv_bytes_per_token']:>8} B/token")
    print(f"  SWA row            {r['swa_bytes_per_token_per_layer']:>8} B per token per layer (FP8 + UE8M0/32)")
    sw = r["swa_bytes_per_sequence"]
    print(f"  SWA rings/sequence {sw['backbone']:>8,} B  ({sw['backbone_layers']} layers x {sw['rows_per_layer']} rows;"
          f" encoder {sw['encoder']:,}, decoder {sw['decoder']:,})")
    print(f"  DSpark SWA rings   {sw['dspark']:>8,} B  ({sw['dspark_layers']} stages)")
    print(f"  layer modes        {r['modes']}")
    print("\n  model                                  B/token")
    for c in r["comparison"]:
        print(f"  {c['model']:<36} {c['bytes_per_token']:>10,}   {c['how']}")
    d, g = r["persistent_ratio_detail"], r["global_ratio_vs_v4_flash"]
    print(f"\n  global KV at {r['tokens']:,} tokens: {r['global_kv_bytes_at_tokens'] / 1e6:,.0f} MB"
          f"   (V3.2: {r['v32_bytes_at_tokens'] / 1e9:,.1f} GB)")
    print(f"  global KV vs V4-Flash: {g:.4f} (~1/{1 / g:.1f})")
    print(f"  persistent KV vs V4-Flash: {d['swa_leaves_persistent_factor']} (SWA leaves SSD) x "
          f"{d['global_kv_ratio']:.4f} (global) = {d['ratio']:.4f} (~1/{d['as_one_over']:.1f})")


# ------------------------------------------------------------------------------------------ params

def _params_report(cfg: ModelConfig, args: argparse.Namespace) -> dict[str, Any]:
    return {**params_report(cfg), "config": args.config}


def _params_table(cfg: ModelConfig, args: argparse.Namespace, r: dict[str, Any]) -> None:
    b, e = r["backbone_detail"], r["engram_detail"]
    ap, ad = r["activated_prefill_detail"], r["activated_decode_detail"]
    print(f"Parameters, config {args.config} (billions)")
    for label, value, note in (
            ("backbone", r["backbone"], f"(embed + {cfg.n_layers} layers + norm + head)"),
            ("  experts", r["experts"], f"(routed {_g(b['routed_experts'])} + shared {_g(b['shared_experts'])})"),
            ("  other in layers", b["non_expert_layers"], ""),
            ("  embed + head", b["embed"] + b["head"], ""),
            ("Engram", r["engram"],
             f"(tables {_g(e['tables'])} + wkv {_g(e['wkv'])} + q/k weights {_g(e['qk_weights'], nd=6)})"),
            ("DSpark", r["dspark"], "(3 blocks, main_proj, Markov + confidence heads; embed/head tied)"),
            ("vision", r["vision"], "(ViT + aligner + image_start/end/newline)"),
            ("total", r["total"], ""),
            ("activated, prefill", r["activated_prefill"],
             f"(encoder layers < {r['ced_split']} {_g(ap['encoder_layers'])} + Engram {_g(ap['engram'])} + KV "
             f"production {_g(ap['kv_production'], nd=4)})"),
            ("activated, decode", r["activated_decode"],
             f"(layers {_g(ad['layers'])} + Engram {_g(ad['engram'])} + head {_g(ad['head'])})")):
        print(f"  {label:<18} {_g(value):>10}" + (f"   {note}" if note else ""))


# ------------------------------------------------------------------------------------------ flops

def _flops_report(cfg: ModelConfig, args: argparse.Namespace) -> dict[str, Any]:
    ctx = args.context or list(DEFAULT_CONTEXTS)
    r = {**flops_report(cfg, ctx), "config": args.config}
    if args.plot:
        plot_decode_curve(cfg, ctx, args.plot)
        r["plot"] = args.plot
    return r


def _flops_table(cfg: ModelConfig, args: argparse.Namespace, r: dict[str, Any]) -> None:
    f = r["indexer_formula"]
    print(f"Decode compute per token, config {args.config}")
    print(f"  indexer MACs = {f['per_token']:,.0f} N + {f['constant']:,.0f}"
          f"   (flat, no hierarchical indexer: {f['flat_per_token']:,.0f} N)")
    top = max(r["decode_flops_raw"] + r["indexer_macs_flat"])
    unit, pre = next((u, p) for u, p in ((1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, "")) if top >= u or u == 1.0)
    cols = (("idx " + pre + "MAC", "indexer_macs", 10, 3), ("flat " + pre + "MAC", "indexer_macs_flat", 10, 3),
            (pre + "FLOPs raw", "decode_flops_raw", 11, 2), ("weighted", "decode_flops_weighted", 9, 2),
            ("w/ FP4 exp", "decode_flops_weighted_fp4_experts", 10, 2))      # (header, report key, width, digits)
    print(f"  {'context':>10}" + "".join(f" {head:>{w}}" for head, _, w, _ in cols))
    for i, n in enumerate(r["contexts"]):
        print(f"  {n:>10,}" + "".join(f" {r[key][i] / unit:>{w}.{nd}f}" for _, key, w, nd in cols))
    g, m = r["decode_growth"], r["indexer_at_1m"]
    print(f"  growth {g['from']:,} -> {g['to']:,}: x{g['ratio']:.3f}  (experts counted at FP4: "
          f"x{g['ratio_fp4_experts']:.3f})")
    print(f"  indexer at N = {m['tokens']:,}: {m['macs'] / 1e9:.2f} G MACs = {m['flops_raw'] / 1e9:.1f} GFLOPs raw,"
          f" {m['flops_weighted_fp4'] / 1e9:.2f} weighted at FP4")
    print("  precision weights: BF16/FP32 1, FP8 0.5, FP4 0.25; routed experts at "
          f"{r['expert_precision'].upper()} (W4A8 MMA runs at its wider operand's rate)")
    print("Prefill (CED): encoder indexer")
    for p in r["prefill_indexer_share"]:
        print(f"  N = {p['tokens']:>9,}: {p['encoder_indexer_macs']:.3e} MACs (= {p['n2_coefficient']:,.0f} N^2);"
              f" {100 * p['fraction_raw']:.1f}% of prefill FLOPs raw, {100 * p['fraction_weighted']:.1f}% weighted")
    if args.plot:
        print(f"wrote {args.plot}")


# ------------------------------------------------------------------------------------------ io

def _io_report(cfg: ModelConfig, args: argparse.Namespace) -> dict[str, Any]:
    vt = vit_tokens(cfg, *args.image)
    rho = args.rho if args.rho is not None else raw_bytes_per_image_token(cfg)
    c = args.flops_per_token if args.flops_per_token is not None else training_flops_per_token(cfg)
    v = io_overlap(rho, c, args.io_bandwidth, args.gpu_flops)
    return {"config": args.config, "vit": vt, "rho": rho, "flops_per_token": c, "io_bandwidth": args.io_bandwidth,
            "gpu_flops": args.gpu_flops, "verdict": asdict(v)}


def _io_table(cfg: ModelConfig, args: argparse.Namespace, r: dict[str, Any]) -> None:
    vt, v, rho = r["vit"], r["verdict"], r["rho"]
    print(f"ViT: {vt['height']}x{vt['width']} -> {vt['patches']} patches of {vt['patch']} px -> {vt['image_tokens']}"
          f" tokens after {vt['unshuffle']}x{vt['unshuffle']} unshuffle (span with layout tokens {vt['span_tokens']}, "
          f"{'fits' if vt['fits_max_n_token'] else 'exceeds'} vision_max_n_token={cfg.vision_max_n_token})")
    print(f"rho = {rho:,.0f} B/token, C = {r['flops_per_token'] / 1e9:,.1f} GFLOPs/token, threshold (B_IO/B_GPU) C = "
          f"{v['threshold']:,.1f} B/token -> I/O {'hidden' if v['hidden'] else 'NOT hidden'} "
          f"(margin {v['margin']:,.1f} B/token, headroom x{v['headroom']:.3g}; independent of N)")


# ------------------------------------------------------------------------------------------ memory

KIND_LABELS = {"fp8": "FP8 Linears (e4m3 + e8m0 per 32x32 tile)",
               "experts_fp4": "routed experts FP4 (e2m1 x2 a byte + e8m0 per row x 32)",
               "experts_fp8": "routed experts FP8 (e4m3 + e8m0 per 32x32 tile)",
               "experts_bf16": "routed experts bf16", "bf16": "bf16 tensors", "fp32": "fp32 tensors"}
GROUP_LABELS = {"backbone": "backbone", "engram": "Engram projections", "dspark": "DSpark", "vision": "vision"}


def _memory_report(cfg: ModelConfig, args: argparse.Namespace) -> dict[str, Any]:
    r = memory_report(cfg, args.gpus, args.context, args.batch, args.device_memory * 1e9, args.dense,
                      args.engram_on_device, args.dtype)
    plan = parallel_plan(cfg, args.gpus, args.context, args.batch, args.chunk, args.device_memory * 1e9, args.dtype)
    return {"config": args.config, **r, "parallel_plan": plan}


def _byte_unit(largest: float) -> tuple[float, str]:
    """The largest of GB / MB / KB / B (decimal) in which `largest` is at least 1."""
    return next((u, n) for u, n in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB"), (1.0, "B")) if largest >= u or u == 1)


def _memory_weights(r: dict[str, Any]) -> None:
    w, t, e = r["weights"], r["today"], r["engram_tables"]
    u, name = _byte_unit(t["bytes"])

    def f(x: float) -> str:
        return _g(x, u, 3)

    count = {1e9: "billions", 1e6: "millions", 1e3: "thousands"}.get(u, "units")
    print(f"Weights in the checkpoint formats, as held after the official load conversions ({name}; params in "
          f"{count})")
    print(f"  {'kind':<58}{'params':>10}{'codes':>10}{'scales':>10}{'total':>10}{'per dev':>10}")
    for k, row in [*w["by_kind"].items(), ("total", w)]:
        print(f"  {KIND_LABELS.get(k, k):<58}" + "".join(
            f"{f(row[c]):>10}" for c in ("params", "code_bytes", "scale_bytes", "bytes", "per_device_bytes")))
    print("  by module: " + ", ".join(f"{GROUP_LABELS[g]} {f(v['bytes'])} ({f(v['per_device_bytes'])} per dev)"
                                      for g, v in w["by_group"].items()))
    print(f"  checkpoint files as shipped (wo_a fp8; head, m=2 compressor, DSpark heads bf16; Engram tables "
          f"included): {f(w['file_bytes'])}")
    print(f"  today's dequantized holding ({t['dtype']}, fp32 where held so, Engram tables on the device): "
          f"{f(t['bytes'])} = weights {f(t['weight_bytes'])} + Engram tables {f(t['engram_table_bytes'])}; "
          f"{f(t['per_device_bytes'])} per device")
    where = ("on the device" + (" (replicated)" if r["dense"] == "replicated" else f" (split over {r['gpus']})")
             if r["engram_on_device"] else "in host memory (one copy)")
    print(f"Engram tables (e4m3 rows + e8m0 per 32), {e['modules']} modules, {e['params']:,} values: codes "
          f"{f(e['code_bytes'])} + scales {f(e['scale_bytes'])} = {f(e['bytes'])} {name} {where}")


def _memory_kv(r: dict[str, Any]) -> None:
    k = r["kv"]
    u, name = _byte_unit(k["bytes"])

    def f(x: float) -> str:
        return _g(x, u, 3)

    print(f"KV for {k['tokens']:,} tokens x {k['batch']} sequence(s), {name} ({k['global_kv_bytes_per_token']:g} "
          f"B/token global, `dsv41 analyze kv`)")
    for label, key, note in (
            ("main KV (global store)", "main_kv_bytes", f"{k['global_entries_per_sequence']:,} entries a sequence"),
            ("indexer K cache", "indexer_k_bytes", "one index key per global entry"),
            ("SWA rings", "swa_ring_bytes", f"encoder {f(k['swa_ring_encoder_bytes'])}, decoder "
             f"{f(k['swa_ring_decoder_bytes'])}, DSpark {f(k['swa_ring_dspark_bytes'])}"),
            ("compressor carry", "compressor_carry_bytes", "fp32 kv + score of the open groups"),
            ("total", "bytes", f"{f(k['per_device_bytes'])} per device (even split)")):
        print(f"  {label:<24}{f(k[key]):>12}   {note}")


def _memory_fit(r: dict[str, Any]) -> None:
    n, p, t = r["gpus"], r["per_device"], r["today_per_device"]
    dense = "replicated" if r["dense"] == "replicated" else f"divided by {n}"
    print(f"Per device (GB), {n} device(s): routed experts spread (the fullest device holds ceil(E/{n}) of a "
          f"layer's E), other weights {dense}, KV divided by {n}; activations and workspaces not counted")
    print(f"  {'':<22}{'checkpoint formats':>20}{'today (' + r['today']['dtype'] + ')':>20}")
    rows = [("weights", p["weights"], t["weights"]),
            ("Engram tables", _g(p["engram_tables"], nd=3) if r["engram_on_device"] else "host", "in weights")]
    rows += [(label, p[key], t[key]) for label, key in (("KV", "kv"), ("total", "total"),
                                                        ("device memory", "device_memory"), ("headroom", "headroom"))]
    rows += [("fits", "yes" if p["fits"] else "NO", "yes" if t["fits"] else "NO")]
    for label, a, b in rows:
        a, b = (x if isinstance(x, str) else _g(x, nd=3) for x in (a, b))
        print(f"  {label:<22}{a:>20}{b:>20}")


def _memory_parallel(r: dict[str, Any]) -> None:
    p = r["parallel_plan"]
    if not p["splits"]:
        print(f"Parallel plan (dsv41/parallel): does not split over {p['gpus']} device(s): {p['why']}")
        return
    a, tp, dp = p["activations"], p["tensor_parallel_attention"], p["data_parallel_attention"]
    print(f"Parallel plan (dsv41/parallel), {p['gpus']} device(s), GB per device: heads / wo groups / wo_b rows "
          f"1/{p['gpus']} ({_g(p['attention_split_bytes'], nd=3)} GB whole), routed experts ceil(E/{p['gpus']}), the "
          f"rest replicated, Engram tables in host memory, latent KV whole on every device")
    print(f"  {'':<30}{'weights':>10}{'KV':>10}{'activations':>13}{'total':>10}{'headroom':>10}{'fits':>6}")
    for label, row in (("tensor-parallel attention", tp), ("data-parallel attention", dp),
                       *((f"the plan on {n} devices", v) for n, v in p["fits"].items())):
        print(f"  {label:<30}" + "".join(f"{_g(row[k], nd=3):>{w}}" for k, w in (
            ("weights", 10), ("kv", 10), ("activations", 13), ("total", 10), ("headroom", 10)))
              + f"{'yes' if row['fits'] else 'NO':>6}")
    cross = p["crossover_batch"]
    notes = [f"KV {_g(p['kv_bytes_per_sequence'], nd=3)} GB per sequence of {p['tokens']:,} tokens"]
    if cross is not None:
        notes.append(f"data-parallel attention holds fewer bytes from {cross:.1f} such sequences on")
    notes.append(f"activations: one block at a prefill chunk of {a['chunk']:,} tokens (an estimate; the gathered "
                 f"KV rows {_g(a['gathered_kv'], nd=3)} GB are the torch reference's, the GPU kernels read in place)")
    print("  " + "; ".join(notes))


def _memory_table(cfg: ModelConfig, args: argparse.Namespace, r: dict[str, Any]) -> None:
    print(f"Memory, config {args.config}, {r['gpus']} device(s) of {_g(r['device_memory'], nd=3)} GB "
          f"(GB = 1e9 bytes)")
    _memory_weights(r)
    _memory_kv(r)
    _memory_fit(r)
    _memory_parallel(r)


# ------------------------------------------------------------------------------------------ register

def _run(args: argparse.Namespace) -> int:
    """Every subcommand: load the config, build its report, print that as JSON or as the subcommand's table."""
    cfg = load_config(args.config)
    r = args.report(cfg, args)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        args.table(cfg, args, r)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("analyze", help="KV bytes, parameters, FLOPs, I/O criterion from a config")
    sub = p.add_subparsers(dest="analysis", required=True)
    parsers = {}
    for name, helptext, report, table in (
            ("kv", "KV-cache bytes per token and the comparison table", _kv_report, _kv_table),
            ("params", "parameter counts and activated parameters", _params_report, _params_table),
            ("flops", "decode indexer MACs and weighted decode FLOPs vs context", _flops_report, _flops_table),
            ("io", "image I/O hidden by compute? rho < (B_IO / B_GPU) * C", _io_report, _io_table),
            ("memory", "weight bytes per device by storage kind, Engram host bytes, KV, fit on N devices",
             _memory_report, _memory_table)):
        sp = parsers[name] = sub.add_parser(name, help=helptext)
        sp.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"preset name or config.json path / checkpoint dir (default {DEFAULT_CONFIG})")
        sp.add_argument("--json", action="store_true", help="print JSON instead of a table")
        sp.set_defaults(func=_run, report=report, table=table)
    fl, io, mem = parsers["flops"], parsers["io"], parsers["memory"]
    fl.add_argument("--context", type=parse_tokens, nargs="+", metavar="N",
                    help="context lengths (e.g. 4K 64K 1M; default 4K..1M in powers of two)")
    fl.add_argument("--plot", metavar="PNG", help="write the decode FLOPs-vs-context curve (log-x)")
    io.add_argument("--io-bandwidth", type=float, required=True, help="storage bytes/s available (e.g. per GPU)")
    io.add_argument("--gpu-flops", type=float, required=True, help="achieved FLOP/s (same scope as --io-bandwidth)")
    io.add_argument("--rho", type=float, help="raw bytes per token (default: 8-bit RGB pixels per image token)")
    io.add_argument("--flops-per-token", type=float, help="C (default: training, 6 x activated parameters)")
    io.add_argument("--image", type=int, nargs=2, default=(1344, 1344), metavar=("H", "W"))
    mem.add_argument("--gpus", type=int, default=1, help="devices to split over (default 1)")
    mem.add_argument("--context", type=parse_tokens, default=1 << 20, metavar="T",
                     help="tokens per sequence for the KV (e.g. 64K, 1M; default 1M)")
    mem.add_argument("--batch", type=int, default=1, help="sequences held at once (default 1)")
    mem.add_argument("--device-memory", type=float, default=H200_USABLE_BYTES / 1e9, metavar="GB",
                     help=f"memory of one device in GB of 1e9 bytes (default {H200_USABLE_BYTES / 1e9:.2f}: "
                          "the H200's usable 139 GiB)")
    mem.add_argument("--dense", choices=DENSE_POLICIES, default="replicated",
                     help="weights other than routed experts: replicated on every device, or split over them")
    mem.add_argument("--engram-on-device", action="store_true",
                     help="keep the Engram tables on the device(s) instead of host memory")
    mem.add_argument("--chunk", type=parse_tokens, default=PREFILL_CHUNK, metavar="T",
                     help=f"prefill chunk for the parallel plan's activation estimate (default {PREFILL_CHUNK})")
    mem.add_argument("--dtype", choices=tuple(HOLDING_DTYPES), default="bfloat16",
                     help="model dtype of today's dequantized holding (default bfloat16)")
