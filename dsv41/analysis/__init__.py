"""Analysis: the numbers of docs/system.md §1 as pure functions of a ModelConfig (no weights, no torch).

- `kv_bytes`: packed KV entry sizes, global KV bytes/token, SWA rings, the model comparison, persistent ratio.
- `params`: parameter counts per tensor (docs/model.md §9), activated parameters in prefill and decode.
- `flops`: decode indexer MACs and weighted decode FLOPs versus context; the encoder prefill indexer share.
- `io`: the image-I/O overlap criterion and the ViT token arithmetic.
- `memory`: weight bytes by checkpoint storage kind per device, Engram host bytes, KV for a context, the fit.
- `cli`: `dsv41 analyze {kv,params,flops,io,memory}`.
"""
