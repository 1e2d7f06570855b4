"""Distributed inference: the V4.1 model over several ranks (torch.distributed; gloo on CPU, NCCL on GPUs).

The plan (`dsv41.parallel.plan`), applied from outside the model:
  - attention: tensor parallel over heads. Each rank runs H / N heads, the wo_a groups that read them and 1/N of
    wo_b's output rows; the latent KV path (wq_a, wkv, compressor, indexer) runs whole on every rank.
  - routed experts: expert parallel, ceil(E / N) experts per rank, tokens dispatched by the (replicated) gate,
    outputs merged with one all-reduce of disjoint slots and summed in the one-device order.
  - shared expert, mHC, norms, embedding, head, Engram, DSpark heads, vision: replicated.

Why tensor-parallel attention and not data-parallel attention: V4.1's attention has ONE latent KV (head_dim
512) that all heads read, so under head parallelism every rank holds the same KV bytes; data-parallel attention
would keep 1/N of the sequences' KV per rank but the attention weights whole. `dsv41 analyze memory --config
v41-flash --gpus 8` ("Parallel plan") gives the numbers: the head-split tensors (wq_b, wo_a, wo_b, attn_sink) are
6.50 GB whole, 0.81 GB per GPU split, and a sequence of 1M tokens holds 0.94 GB of KV (890 B/token global + SWA
rings), so duplicating the KV costs fewer bytes than replicating those weights up to 6.9 concurrent 1M-token
sequences (whatever N; many more at shorter contexts): per GPU 51.0 GB (tensor-parallel) vs 56.7 GB
(data-parallel) at one such sequence on 8 H200s. Head parallelism also divides the attention's work at batch 1,
where data-parallel attention leaves N - 1 ranks idle. Beyond ~7 long sequences per GPU group (throughput serving
of long contexts) data-parallel attention holds fewer bytes; it is not built.

Results do not depend on the rank count: no reduction across ranks enters a sum (`dsv41.parallel.group`): wo_b
is split by output rows, the experts' outputs are merged from disjoint slots and summed in the one-device order.
On the CPU the logits are the one-process bits with quantization on (dense and packed storage) and within 2e-6
with it off (the plain GEMMs of other shapes); in the deterministic mode (exact block sums, fixed tiles) a
rank count gives the same bits as one device, so greedy outputs are identical across world sizes as well as
across runs (tests/test_parallel*.py).

Serving (`dsv41.parallel.lockstep`): every rank runs the same `Engine` over its own shard and its own KV pool
(the same bytes on every rank); rank 0 takes the HTTP requests and broadcasts each engine command (admit, abort,
step) before running it, so all ranks take the same steps. `torchrun --nproc_per_node N -m dsv41 serve ...`.
Loading (`dsv41.parallel.loading`): each rank builds its share on the meta device and reads only its slices.
"""
