"""`dsv41 analyze {kv,params,flops,io}`: the SYSTEM.md section 1 numbers, computed from a config."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dsv41.config import ModelConfig, load_config, role_summary

DEFAULT_CONFIG = "v41-flash"


def parse_tokens(s: str) -> int:
    """A token count: an integer, or with a binary suffix K (1024) / M (1048576)."""
    t = s.strip()
    mult = 1
    if t[-1:].upper() == "K":
        mult, t = 1 << 10, t[:-1]
    elif t[-1:].upper() == "M":
        mult, t = 1 << 20, t[:-1]
    try:
        n = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {s!r} (use e.g. 4096, 4K, 1M)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"token count must be positive: {s!r}")
    return n


def _config(args: argparse.Namespace) -> ModelConfig:
    return load_config(args.config)


def _emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def _g(x: float, unit: float = 1e9, nd: int = 2) -> str:
    return f"{x / unit:,.{nd}f}"


# ------------------------------------------------------------------------------------------ kv

def _cmd_kv(args: argparse.Namespace) -> int:
    from dsv41.analysis.kv_bytes import kv_report

    cfg = _config(args)
    r = kv_report(cfg)
    r["config"] = args.config
    r["modes"] = role_summary(cfg)["modes"]
    if args.json:
        _emit_json(r)
        return 0
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
    n = r["tokens"]
    print(f"\n  global KV at {n:,} tokens: {r['global_kv_bytes_at_tokens'] / 1e6:,.0f} MB"
          f"   (V3.2: {r['v32_bytes_at_tokens'] / 1e9:,.1f} GB)")
    d = r["persistent_ratio_detail"]
    print(f"  global KV vs V4-Flash: {r['global_ratio_vs_v4_flash']:.4f} (~1/{1 / r['global_ratio_vs_v4_flash']:.1f})")
    print(f"  persistent KV vs V4-Flash: {d['swa_leaves_persistent_factor']} (SWA leaves SSD) x "
          f"{d['global_kv_ratio']:.4f} (global) = {d['ratio']:.4f} (~1/{d['as_one_over']:.1f})")
    return 0


# ------------------------------------------------------------------------------------------ params

def _cmd_params(args: argparse.Namespace) -> int:
    from dsv41.analysis.params import params_report

    cfg = _config(args)
    r = params_report(cfg)
    r["config"] = args.config
    if args.json:
        _emit_json(r)
        return 0
    b = r["backbone_detail"]
    e = r["engram_detail"]
    print(f"Parameters, config {args.config} (billions)")
    print(f"  backbone           {_g(r['backbone']):>10}   (embed + {cfg.n_layers} layers + norm + head)")
    print(f"    experts          {_g(r['experts']):>10}   (routed {_g(b['routed_experts'])} + shared "
          f"{_g(b['shared_experts'])})")
    print(f"    other in layers  {_g(b['non_expert_layers']):>10}")
    print(f"    embed + head     {_g(b['embed'] + b['head']):>10}")
    print(f"  Engram             {_g(r['engram']):>10}   (tables {_g(e['tables'])} + wkv {_g(e['wkv'])} + q/k "
          f"weights {_g(e['qk_weights'], nd=6)})")
    print(f"  DSpark             {_g(r['dspark']):>10}   (3 blocks, main_proj, Markov + confidence heads;"
          f" embed/head tied)")
    print(f"  vision             {_g(r['vision']):>10}   (ViT + aligner + image_start/end/newline)")
    print(f"  total              {_g(r['total']):>10}")
    ap, ad = r["activated_prefill_detail"], r["activated_decode_detail"]
    print(f"  activated, prefill {_g(r['activated_prefill']):>10}   (encoder layers < {r['ced_split']} "
          f"{_g(ap['encoder_layers'])} + Engram {_g(ap['engram'])} + KV production {_g(ap['kv_production'], nd=4)})")
    print(f"  activated, decode  {_g(r['activated_decode']):>10}   (layers {_g(ad['layers'])} + Engram "
          f"{_g(ad['engram'])} + head {_g(ad['head'])})")
    return 0


# ------------------------------------------------------------------------------------------ flops

def _cmd_flops(args: argparse.Namespace) -> int:
    from dsv41.analysis.flops import DEFAULT_CONTEXTS, flops_report, plot_decode_curve

    cfg = _config(args)
    ctx = args.context or list(DEFAULT_CONTEXTS)
    r = flops_report(cfg, ctx)
    r["config"] = args.config
    if args.plot:
        plot_decode_curve(cfg, ctx, args.plot)
        r["plot"] = args.plot
    if args.json:
        _emit_json(r)
        return 0
    f = r["indexer_formula"]
    print(f"Decode compute per token, config {args.config}")
    print(f"  indexer MACs = {f['per_token']:,.0f} N + {f['constant']:,.0f}"
          f"   (flat, no hierarchical indexer: {f['flat_per_token']:,.0f} N)")
    top = max(r["decode_flops_raw"] + r["indexer_macs_flat"])
    unit, pre = next((u, p) for u, p in ((1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, "")) if top >= u or u == 1.0)
    print(f"  {'context':>10} {'idx ' + pre + 'MAC':>10} {'flat ' + pre + 'MAC':>10} {pre + 'FLOPs raw':>11}"
          f" {'weighted':>9} {'w/ FP4 exp':>10}")
    for i, n in enumerate(r["contexts"]):
        print(f"  {n:>10,} {r['indexer_macs'][i] / unit:>10.3f} {r['indexer_macs_flat'][i] / unit:>10.3f} "
              f"{r['decode_flops_raw'][i] / unit:>11.2f} {r['decode_flops_weighted'][i] / unit:>9.2f} "
              f"{r['decode_flops_weighted_fp4_experts'][i] / unit:>10.2f}")
    g = r["decode_growth"]
    print(f"  growth {g['from']:,} -> {g['to']:,}: x{g['ratio']:.3f}  (experts counted at FP4: "
          f"x{g['ratio_fp4_experts']:.3f})")
    m = r["indexer_at_1m"]
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
    return 0


# ------------------------------------------------------------------------------------------ io

def _cmd_io(args: argparse.Namespace) -> int:
    from dsv41.analysis.io import io_overlap, raw_bytes_per_image_token, training_flops_per_token, vit_tokens

    cfg = _config(args)
    h, w = args.image
    vt = vit_tokens(cfg, h, w)
    rho = args.rho if args.rho is not None else raw_bytes_per_image_token(cfg)
    c = args.flops_per_token if args.flops_per_token is not None else training_flops_per_token(cfg)
    v = io_overlap(rho, c, args.io_bandwidth, args.gpu_flops)
    r = {"config": args.config, "vit": vt, "rho": rho, "flops_per_token": c, "io_bandwidth": args.io_bandwidth,
         "gpu_flops": args.gpu_flops, "verdict": v.to_dict()}
    if args.json:
        _emit_json(r)
        return 0
    print(f"ViT: {h}x{w} -> {vt['patches']} patches of {vt['patch']} px -> {vt['image_tokens']} tokens after "
          f"{vt['unshuffle']}x{vt['unshuffle']} unshuffle (span with layout tokens {vt['span_tokens']}, "
          f"{'fits' if vt['fits_max_n_token'] else 'exceeds'} vision_max_n_token={cfg.vision_max_n_token})")
    print(f"rho = {rho:,.0f} B/token, C = {c / 1e9:,.1f} GFLOPs/token, threshold (B_IO/B_GPU) C = "
          f"{v.threshold:,.1f} B/token -> I/O {'hidden' if v.hidden else 'NOT hidden'} "
          f"(margin {v.margin:,.1f} B/token, headroom x{v.headroom:.3g}; independent of N)")
    return 0


# ------------------------------------------------------------------------------------------ register

def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("analyze", help="KV bytes, parameters, FLOPs, I/O criterion from a config")
    sub = p.add_subparsers(dest="analysis", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"preset name or config.json path / checkpoint dir (default {DEFAULT_CONFIG})")
        sp.add_argument("--json", action="store_true", help="print JSON instead of a table")

    kv = sub.add_parser("kv", help="KV-cache bytes per token and the comparison table")
    common(kv)
    kv.set_defaults(func=_cmd_kv)

    pa = sub.add_parser("params", help="parameter counts and activated parameters")
    common(pa)
    pa.set_defaults(func=_cmd_params)

    fl = sub.add_parser("flops", help="decode indexer MACs and weighted decode FLOPs vs context")
    common(fl)
    fl.add_argument("--context", type=parse_tokens, nargs="+", metavar="N",
                    help="context lengths (e.g. 4K 64K 1M; default 4K..1M in powers of two)")
    fl.add_argument("--plot", metavar="PNG", help="write the decode FLOPs-vs-context curve (log-x)")
    fl.set_defaults(func=_cmd_flops)

    io = sub.add_parser("io", help="image I/O hidden by compute? rho < (B_IO / B_GPU) * C")
    common(io)
    io.add_argument("--io-bandwidth", type=float, required=True, help="storage bytes/s available (e.g. per GPU)")
    io.add_argument("--gpu-flops", type=float, required=True, help="achieved FLOP/s (same scope as --io-bandwidth)")
    io.add_argument("--rho", type=float, help="raw bytes per token (default: 8-bit RGB pixels per image token)")
    io.add_argument("--flops-per-token", type=float, help="C (default: training, 6 x activated parameters)")
    io.add_argument("--image", type=int, nargs=2, default=(1344, 1344), metavar=("H", "W"))
    io.set_defaults(func=_cmd_io)
