"""The trainer: pretraining of a V4.1-architecture model from scratch, and the DSpark drafter stage, on one CPU,
one GPU or many processes under `torchrun` (issue 7; SYSTEM.md 5 and 6).

One step: `grad_accum` micro-batches of [batch_size, seq_len] tokens (per process) -> forward (a training
prefill at position 0 through `TrainCache`, FP8/FP4 QDQ off, bf16 autocast on GPU, fp32 on CPU) -> mean
cross-entropy -> backward -> gradient clipping -> the routed optimizers at the scheduled learning rate ->
aux-loss-free bias update from the step's expert loads. With `replay` (decoder | encoder | both) the forward
simulates bounded replay: the sliding windows of those layers are truncated at a replay start drawn per sequence
and step (qat.py); evaluation measures the plain model. The training forward is the fast one of fast.py by default (the same
function as the model's, dense masked attention, batched experts, matmul mHC; `--no-fast` and FSDP2 take the
reference); evaluation, the QDQ evaluation and the sample always run the model's own forward.

Parallelism, applied from outside the model: under `torchrun` with more than one process, data parallelism with
`DistributedDataParallel` (gloo on CPU, NCCL on GPU; each rank takes its slice of every global batch, so W
processes with batch B follow the data of one process with batch W*B), or with `fsdp=True` FSDP2 (`fully_shard`
per block, then the root; Muon, the Sinkhorn optimizer and the balancer work on full tensors, see muon.py; NCCL
on GPU, gloo on CPU; run on CPU with 2 processes and on one GPU, never on several GPUs yet).

CPU threads: one by default. torch's OpenMP threads spin-wait at every barrier; when the cores are shared
(2 cores, other processes) the tiny model measured ~250 -> ~80 tokens/s with 2 threads against a steady ~180 with
one. `--threads 2` is faster on an idle machine.

Budget: `steps`, or `minutes` of wall time for the whole command (the default, 5): a probe forward/backward
measures the step time and fixes the step count, which then stays fixed (the schedule and a resumed run need it).

Outputs in `out`: the checkpoint (see checkpoint.py), `log.jsonl` (one line per step and per evaluation),
`loss_curve.png`, `summary.json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dsv41.config import ced_split, load_config
from dsv41.model.common import set_quantization
from dsv41.model.init import init_weights
from dsv41.model.step import ForwardOptions
from dsv41.train import data as D
from dsv41.train.balance import LoadBalancer
from dsv41.train.checkpoint import load_training_checkpoint, save_training_checkpoint, unwrap_state_dict
from dsv41.train.fast import fast_applies, fast_forward
from dsv41.train.optim.routing import build_optimizers, format_routing, route_parameters
from dsv41.train.qat import TrainCache
from dsv41.train.schedule import default_warmup, lr_factor

DEFAULT_MINUTES = 5.0
_REPLAY_STREAM = 0x7265706C                 # tags the replay-start seed (seed, step, tag): its own random stream
STAGES = ("pretrain", "dspark")
REPLAY_MODES = ("off", "decoder", "encoder", "both")
MUON_NS = ("auto", "fp32", "bf16")


def muon_ns_dtype(mode: str, device: torch.device) -> torch.dtype:
    """The Newton-Schulz dtype of `--muon-ns`: auto is bf16 on GPUs and on CPUs with AMX bf16 tiles (oneDNN runs
    its batched matmuls ~2.7x faster than fp32 there; singular values land within ~1e-2 of 1 instead of ~1e-3,
    as on GPUs), fp32 on other CPUs."""
    if mode == "auto":
        amx = device.type == "cpu" and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
        return torch.bfloat16 if device.type == "cuda" or amx else torch.float32
    return torch.bfloat16 if mode == "bf16" else torch.float32


@dataclass
class TrainConfig:
    preset: str = "tiny"
    stage: str = "pretrain"
    data: str | None = None                # None: the Python standard library (data.py)
    out: str = "runs/train-tiny"
    init: str | None = None                # dspark stage: the pretrained checkpoint directory
    steps: int | None = None
    minutes: float | None = None           # wall-time budget of the whole command (default when steps is None)
    seq_len: int = 128
    batch_size: int = 16                   # per process and micro-batch; tiny, 5 min, fast forward: 16 (41 steps,
                                           # val 5.675) beat 8 (61 steps, 5.718) and 32 (worse per token)
    grad_accum: int = 1
    lr: float = 3e-2                       # peak; tuned on the tiny preset (3e-3, 1e-2, 3e-2, 6e-2 tried)
    weight_decay: float = 0.1
    warmup: int | None = None              # steps; default 5% of the run
    clip: float = 1.0
    optimizer: str = "muon"                # muon: the routed recipe; adamw: AdamW for everything
    muon_ns: str = "auto"                  # Newton-Schulz dtype: auto (bf16 on GPUs and AMX CPUs) | fp32 | bf16
    qat: bool = False
    replay: str = "off"                    # bounded-replay simulation: off | decoder | encoder | both (qat.py)
    fast: bool = True                      # the training-only fast forward (fast.py; not under FSDP2)
    balance_rate: float = 1e-2             # 10x DeepSeek-V3's 1e-3: runs here last 10^2, not 10^5 steps
    seed: int = 0
    eval_every: int | None = None          # default: 8 evaluations per run
    eval_windows: int = 32
    val_fraction: float = D.DEFAULT_VAL_FRACTION
    threads: int | None = None            # CPU default 1: OpenMP threads that spin-wait collapse on shared cores
    device: str = "auto"
    fsdp: bool = False
    sample_tokens: int = 64
    save_every: int | None = None          # default: at every evaluation
    quiet: bool = False

    def validate(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"--stage must be one of {STAGES}, got {self.stage!r}")
        if self.optimizer not in ("muon", "adamw"):
            raise ValueError(f"--optimizer must be 'muon' or 'adamw', got {self.optimizer!r}")
        if self.muon_ns not in MUON_NS:
            raise ValueError(f"--muon-ns must be one of {MUON_NS}, got {self.muon_ns!r}")
        if self.replay not in REPLAY_MODES:
            raise ValueError(f"--replay must be one of {REPLAY_MODES}, got {self.replay!r}")
        for name in ("seq_len", "batch_size", "grad_accum", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"--minutes must be > 0, got {self.minutes}")
        if self.steps is not None and self.minutes is not None:
            raise ValueError("give --steps or --minutes, not both")
        if self.lr <= 0 or self.clip < 0 or self.weight_decay < 0:
            raise ValueError(f"--lr {self.lr}, --clip {self.clip}, --weight-decay {self.weight_decay}: out of range")
        if self.stage == "dspark" and not self.init:
            raise ValueError("--stage dspark needs --init CHECKPOINT (a pretrained model directory)")
        if self.stage == "dspark" and self.replay != "off":
            raise ValueError("--replay simulates bounded replay in pretraining; the dspark stage does not take it")


# ------------------------------------------------------------------------------------------------ distributed

@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (moved through the device for NCCL)."""
        if self.world > 1:
            import torch.distributed as dist
            if self.device.type == "cuda" and t.device.type != "cuda":
                tmp = t.to(self.device)
                dist.all_reduce(tmp)
                t.copy_(tmp.cpu())
            else:
                dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()

    def broadcast(self, obj):
        if self.world == 1:
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def setup_distributed(device: str) -> Dist:
    """Under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK set) join the process group (NCCL on GPUs, gloo on CPU),
    also with one process (FSDP2 needs the group); a plain process is rank 0 of 1."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Dist(device=torch.device("cuda" if use_cuda else "cpu"))
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Dist(rank, world, local, torch.device(f"cuda:{local}" if use_cuda else "cpu"))


# ------------------------------------------------------------------------------------------------ objectives

class LMTrainModule(nn.Module):
    """forward(ids [B,T], targets [B,T], floor [B] or None) -> (mean cross-entropy, {}): a training prefill at
    position 0; with `floor`, the sliding windows of `replay_layers` are truncated at each row's replay start
    for the queries at or after it (the bounded-replay simulation, qat.py)."""

    def __init__(self, model, kv_qat: bool = False, replay_layers: frozenset | None = None, fast: bool = False):
        super().__init__()
        self.model, self.kv_qat, self.replay_layers, self.fast = model, kv_qat, replay_layers, fast

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, floor: torch.Tensor | None = None):
        m = self.model
        cache = TrainCache(m.cfg, ids.size(0), m.dtype, ids.device, kv_qat=self.kv_qat)
        layers = self.replay_layers if floor is not None else None
        if self.fast and fast_applies(m):               # the same function, faster (fast.py)
            logits = fast_forward(m, ids, cache, floor, layers)
        else:
            logits = m(ids, cache, 0, ForwardOptions(window_floor=floor, window_floor_layers=layers)).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return loss, {}


def replay_layers(mcfg, mode: str) -> frozenset | None:
    """The layers whose sliding windows the bounded-replay simulation truncates (None for `off`): the decoder is
    the layers from the CED split (`dsv41.config.ced_split`) up, the encoder the layers below it."""
    if mode == "off":
        return None
    if mode == "both":
        return frozenset(range(mcfg.n_layers))
    split = ced_split(mcfg)
    if split is None:
        raise ValueError(f"--replay {mode}: the model has no KV-source layer, hence no encoder/decoder split; "
                         "use --replay both or off")
    return frozenset(range(split, mcfg.n_layers)) if mode == "decoder" else frozenset(range(split))


def replay_starts(seed: int, step: int, shape: tuple[int, ...], window: int, seq_len: int) -> torch.Tensor | None:
    """One optimizer step's replay starts, int64 of `shape` (micro-batches x global batch), uniform over
    [window, seq_len - 1], from a generator seeded by (seed, step) alone: a resumed run draws what the
    uninterrupted run drew, and n ranks of batch B draw what one process of batch n*B draws (rank r takes
    columns r*B..). None when seq_len - 1 < window (no start in range: the simulation is skipped)."""
    if seq_len - 1 < window:
        return None
    state = np.random.SeedSequence([seed, step, _REPLAY_STREAM]).generate_state(1, np.uint64)[0]
    return torch.randint(window, seq_len, shape, generator=torch.Generator().manual_seed(int(state)))


@torch.no_grad()
def evaluate_lm(model, windows: torch.Tensor, batch_size: int, token_bytes: torch.Tensor, dist: Dist,
                autocast=contextlib.nullcontext) -> dict:
    """Validation loss (nats per token, all targets) and bits per byte (targets that stand for bytes: special
    tokens excluded from both sums) over fixed windows [N, T+1]; ranks take windows i % world == rank."""
    sums = torch.zeros(4, dtype=torch.float64)                  # loss sum, tokens, byte-token loss sum, bytes
    n = max(dist.world, windows.size(0) // dist.world * dist.world)   # equal counts: FSDP2 forwards are collective
    mine = windows[:n][dist.rank::dist.world]
    for i in range(0, mine.size(0), batch_size):
        w = mine[i:i + batch_size].to(dist.device)
        with autocast():
            out = model(w[:, :-1], TrainCache(model.cfg, w.size(0), model.dtype, w.device), 0)
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="none").double()
        nbytes = token_bytes.to(w.device)[w[:, 1:].flatten()].double()
        sums += torch.stack([ce.sum(), torch.tensor(float(ce.numel()), device=ce.device),
                             (ce * (nbytes > 0)).sum(), nbytes.sum()]).cpu()
    dist.all_reduce(sums)
    return {"val_loss": float(sums[0] / sums[1]), "val_bpb": float(sums[2] / sums[3] / math.log(2))}


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """Greedy continuation of prompts [B,P] by `n_new` tokens: one prefill, then one-token decode steps."""
    cache = TrainCache(model.cfg, prompts.size(0), model.dtype, prompts.device)
    out = model(prompts, cache, 0, last_only=True)
    seq = [prompts]
    for k in range(n_new):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seq.append(nxt)
        if k + 1 < n_new:
            out = model(nxt, cache)
    return torch.cat(seq, dim=1)


# ------------------------------------------------------------------------------------------------ trainer

class Trainer:
    """Builds everything from a TrainConfig; `run(stop_at)` trains (to `stop_at` steps if given: tests of exact
    resume stop halfway), `finish()` evaluates, saves and reports."""

    def __init__(self, cfg: TrainConfig, resume: bool = False):
        self.t0 = time.time()
        cfg.validate()
        self.dist = setup_distributed(cfg.device)
        self.out = Path(cfg.out)
        saved = None
        if resume:
            state_path = self.out / "train_state.pt"
            if not state_path.is_file():
                raise ValueError(f"--resume: {self.out} holds no train_state.pt (nothing to resume)")
            saved = torch.load(state_path, map_location="cpu", weights_only=True)
            cfg = self._merge_saved_config(cfg, saved["config"])
        self.cfg = cfg
        if cfg.threads or self.dist.device.type == "cpu":
            torch.set_num_threads(cfg.threads or 1)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / "log.jsonl"
        torch.manual_seed(cfg.seed)
        self._build_data_and_model()
        self._build_training()
        self.step, self.history, self.total_steps = 0, [], None
        if saved is not None:
            self._resume()
        elif self.dist.main and self.log_path.exists():
            self.log_path.unlink()
        self._fix_budget()

    # ---------------------------------------------------------------- set-up
    def say(self, *args) -> None:
        if self.dist.main and not self.cfg.quiet:
            print(*args, flush=True)

    @staticmethod
    def _merge_saved_config(cfg: TrainConfig, saved: dict) -> TrainConfig:
        """A resumed run keeps the saved settings; only the output location and verbosity come from now."""
        merged = TrainConfig(**{**saved, "out": cfg.out, "quiet": cfg.quiet, "threads": cfg.threads})
        return merged

    def _build_data_and_model(self) -> None:
        from tokenizers import Tokenizer

        from dsv41.model.engram import build_compressed_token_map
        from dsv41.model.transformer import Transformer

        cfg, dist = self.cfg, self.dist
        self.corpus = D.load_corpus(cfg.data, cfg.val_fraction)
        if cfg.stage == "dspark":
            tok_path = Path(cfg.init) / "tokenizer.json"
            if not tok_path.is_file():
                raise ValueError(f"--init {cfg.init}: no tokenizer.json (train with `dsv41 train` first)")
            prov_path = Path(cfg.init) / "tokenizer_provenance.json"
            self.provenance = json.loads(prov_path.read_text()) if prov_path.is_file() else None
        else:
            tok_path = self.out / "tokenizer.json"
            prov_path = self.out / "tokenizer_provenance.json"
            want = {**self.corpus.provenance, "vocab_size": load_config(cfg.preset).vocab_size}
            fresh = not (tok_path.is_file() and prov_path.is_file()
                         and json.loads(prov_path.read_text()).get("tokenizer_of") == want)
            if fresh and dist.main:
                t = time.time()
                tok = D.train_tokenizer(self.corpus.train, want["vocab_size"])
                tok.save(str(tok_path))
                prov_path.write_text(json.dumps({"tokenizer_of": want}, indent=2) + "\n")
                self.say(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} ids, trained on "
                         f"{len(self.corpus.train)} documents in {time.time() - t:.1f}s -> {tok_path}")
            dist.barrier()
            self.provenance = {"tokenizer_of": want}
        self.tokenizer_path = tok_path
        self.tokenizer = Tokenizer.from_file(str(tok_path))
        token_map, n_comp = build_compressed_token_map(self.tokenizer)
        ids = D.special_ids(self.tokenizer)
        if cfg.stage == "dspark":
            mcfg = load_config(cfg.init)
        else:
            mcfg = load_config(cfg.preset)
            if self.tokenizer.get_vocab_size() > mcfg.vocab_size:
                raise ValueError(f"tokenizer has {self.tokenizer.get_vocab_size()} ids, the model {mcfg.vocab_size}")
            mcfg = mcfg.replace(engram_compressed_vocab_size=n_comp, engram_pad_id=D.PAD_ID,
                                image_token_id=ids["<|image|>"], dspark_noise_token_id=ids["<|draft|>"])
        self.model_cfg = mcfg
        model = Transformer(mcfg, dtype=torch.float32, token_map=(token_map, n_comp) if mcfg.engram_enabled else None)
        if cfg.stage == "dspark":
            from safetensors.torch import load_file
            model.load_state_dict(load_file(str(Path(cfg.init) / "model.safetensors")))
        else:
            init_weights(model, cfg.seed)
            with torch.no_grad():                      # aux-loss-free balancing starts from unbiased selection
                for name, p in model.named_parameters():
                    if name.endswith(("gate.bias", "gate.bias_vl")):
                        p.zero_()
        set_quantization(model, False)
        self.model = model.to(dist.device).train()
        t = time.time()
        self.train_tokens = D.encode_documents(self.tokenizer, self.corpus.train)
        self.val_tokens = D.encode_documents(self.tokenizer, self.corpus.val)
        self.token_bytes = torch.from_numpy(D.token_byte_lengths(self.tokenizer))
        self.say(f"data: {self.corpus.name}: {len(self.corpus.train)} train / {len(self.corpus.val)} val documents, "
                 f"{len(self.train_tokens):,} / {len(self.val_tokens):,} tokens "
                 f"({self.corpus.provenance['train_bytes'] / max(len(self.train_tokens), 1):.2f} bytes/token), "
                 f"encoded in {time.time() - t:.1f}s")
        self.loader = D.PackedLoader(self.train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed, dist.rank, dist.world)
        self.val_windows = D.eval_windows(self.val_tokens, cfg.seq_len, cfg.eval_windows)

    def _autocast(self):
        if self.dist.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _build_training(self) -> None:
        cfg, model, dist = self.cfg, self.model, self.dist
        self.replay_layers = None
        if cfg.stage == "dspark":
            from dsv41.train.dspark_stage import DEFAULT_ANCHORS, DSparkTrainModule
            module = DSparkTrainModule(model, DEFAULT_ANCHORS)
            trainable = {n for n, _ in model.named_parameters() if n.startswith("mtp.")}
            prefix = "mtp."
        else:
            self.replay_layers = replay_layers(self.model_cfg, cfg.replay)
            module = LMTrainModule(model, kv_qat=cfg.qat, replay_layers=self.replay_layers,
                                   fast=cfg.fast and not cfg.fsdp)
            if self.replay_layers is not None:
                W = self.model_cfg.window_size
                self.say(f"bounded-replay simulation ({cfg.replay}): layers {sorted(self.replay_layers)}, one start "
                         f"per sequence uniform over [{W}, {cfg.seq_len - 1}]" if cfg.seq_len - 1 >= W else
                         f"bounded-replay simulation ({cfg.replay}): skipped, --seq-len {cfg.seq_len} leaves no "
                         f"start in [W={W}, seq_len-1]")
            trainable = None
            prefix = ""
        for name, p in model.named_parameters():
            p.requires_grad_(trainable is None or name in trainable)
        no_grad = self._probe(module)
        self.routes = route_parameters(model, self.model_cfg, cfg.optimizer, trainable, no_grad)
        kinds = {r.name: r.kind for r in self.routes}
        for name, p in model.named_parameters():
            p.requires_grad_(kinds[name] not in ("excluded", "frozen"))
        self.trainable = [p for n, p in model.named_parameters() if p.requires_grad]
        n_params = sum(p.numel() for p in model.parameters())
        self.say(f"model: {cfg.preset if cfg.stage == 'pretrain' else cfg.init}, {n_params:,} parameters, "
                 f"{sum(p.numel() for p in self.trainable):,} trained ({cfg.stage}); device {dist.device}, "
                 f"world {dist.world}, threads {torch.get_num_threads()}; forward "
                 f"{'fast (training-only, fast.py)' if getattr(module, 'fast', False) else 'reference'}, Muon "
                 f"Newton-Schulz {str(muon_ns_dtype(cfg.muon_ns, dist.device)).removeprefix('torch.')}")
        self.say("optimizer routing (--optimizer " + cfg.optimizer + "):\n" + format_routing(self.routes))
        if cfg.fsdp:
            import torch.distributed as tdist
            if not tdist.is_initialized():
                raise ValueError("--fsdp needs a torchrun launch (also for one process: FSDP2 needs the process "
                                 "group)")
            if cfg.stage != "pretrain":
                raise ValueError("--fsdp is wired for pretraining; the drafter stage is small: run it with DDP")
            from torch.distributed.fsdp import fully_shard
            # a unit per module that is entered through its own forward: Engram (called before its block),
            # then each block, then the root (embedding, final norm, head)
            for block in model.layers:
                if block.engram is not None:
                    fully_shard(block.engram)
                fully_shard(block)
            fully_shard(model)
            # fully_shard registers new (DTensor) parameters: collect them again, or clipping would act on the
            # stale unsharded tensors (seen on CPU/gloo: no clipping at all and a wrong grad_norm)
            self.trainable = [p for p in model.parameters() if p.requires_grad]
            self.module = module
        elif dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.module = DDP(module, device_ids=[dist.local_rank] if dist.device.type == "cuda" else None,
                              find_unused_parameters=True)
        else:
            self.module = module
        self.opt = build_optimizers(model, self.routes, cfg.lr, cfg.weight_decay,
                                    muon_ns_dtype=muon_ns_dtype(cfg.muon_ns, dist.device))
        self.opt_step_time = self._time_optimizer_step()
        self.balancer = LoadBalancer(model, cfg.balance_rate, prefix=prefix)

    def _probe(self, module) -> set[str]:
        """One forward/backward on the first batch (data position untouched): parameters that get no gradient
        have no gradient path and are frozen (routed experts excepted: a batch may just not pick them).
        Rank 0 decides for everyone. Also measures the step time for a minutes budget."""
        x, y = (t.to(self.dist.device) for t in self.loader.peek())
        times = []
        for _ in range(3 if self.cfg.steps is None else 1):
            t = time.time()
            with self._autocast():
                loss, _ = module(x, y)
            loss.backward()
            times.append(time.time() - t)
        names = {n for n, p in self.model.named_parameters()
                 if p.requires_grad and p.grad is None and ".ffn.experts." not in n}
        # the first pass pays one-time costs; of the others the fastest (noise on shared cores only adds time)
        self.probe_step_time = min(times[1:]) if len(times) > 1 else times[-1]
        return set(self.dist.broadcast(sorted(names)))

    def _time_optimizer_step(self) -> float:
        """With a minutes budget: time one optimizer step on the probe's gradients, then put the weights back and
        start the optimizers afresh (so the run is exactly as if nothing had happened). Clears the gradients."""
        t = 0.0
        if self.cfg.steps is None:
            saved = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
            t0 = time.time()
            self.opt.step()
            t = time.time() - t0
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    if n in saved:
                        p.copy_(saved[n])
            self.opt = build_optimizers(self.model, self.routes, self.cfg.lr, self.cfg.weight_decay,
                                        muon_ns_dtype=muon_ns_dtype(self.cfg.muon_ns, self.dist.device))
        self.model.zero_grad(set_to_none=True)
        return t

    def _fix_budget(self) -> None:
        cfg = self.cfg
        if self.total_steps is not None:
            pass
        elif cfg.steps is not None:
            self.total_steps = cfg.steps
        else:
            minutes = cfg.minutes or DEFAULT_MINUTES
            step_time = self.dist.broadcast((self.probe_step_time * cfg.grad_accum + self.opt_step_time) * 1.05)
            left = minutes * 60 - (time.time() - self.t0)
            # 8 evaluations (+ the final QDQ one and the sample: ~2 more; a forward ~ 0.4 of a forward/backward),
            # a checkpoint with each (~1.5 s), ~10 s at the end
            batches = math.ceil(cfg.eval_windows / cfg.batch_size / self.dist.world)
            reserve = 10 * batches * 0.4 * self.probe_step_time + 8 * 1.5 + 10
            self.total_steps = max(1, int((left - reserve) / step_time))
            self.say(f"budget: {minutes:g} min; measured step {step_time:.2f}s (forward/backward "
                     f"{self.probe_step_time:.2f}s, optimizer {self.opt_step_time:.2f}s) -> {self.total_steps} steps")
        self.warmup = cfg.warmup if cfg.warmup is not None else default_warmup(self.total_steps)
        self.eval_every = cfg.eval_every or max(1, self.total_steps // 8)
        self.save_every = cfg.save_every or self.eval_every

    # ---------------------------------------------------------------- state
    def train_state(self) -> dict:
        return {"config": dataclasses.asdict(self.cfg), "optimizer": self.opt.state_dict(),
                "loader": self.loader.state_dict(), "history": self.history, "total_steps": self.total_steps,
                "rng": torch.get_rng_state(), "model_config": self.model_cfg.to_dict()}

    def save(self) -> None:
        """Rank 0 writes the checkpoint. Under FSDP2 every rank takes part in gathering the full weights and
        writes its own optimizer state (AdamW's moments are sharded) to optimizer.rank{r}.pt."""
        weights = unwrap_state_dict(self.model)            # a collective under FSDP2
        state = self.train_state()
        if self.cfg.fsdp:
            torch.save(self.opt.state_dict(), self.out / f"optimizer.rank{self.dist.rank}.pt")
            state["optimizer"] = None
        if self.dist.main:
            corpus = (self.provenance or {}).get("tokenizer_of", {})
            meta = {"stage": self.cfg.stage, "corpus": corpus.get("corpus", "?"), "split": corpus.get("split", "?")}
            save_training_checkpoint(self.out, weights, self.model_cfg, self.tokenizer_path, state, self.step, meta,
                                     self.provenance)
        self.dist.barrier()

    def _resume(self) -> None:
        state = load_training_checkpoint(self.out, self.model)
        if self.cfg.fsdp:
            state["optimizer"] = torch.load(self.out / f"optimizer.rank{self.dist.rank}.pt", weights_only=True)
        self.opt.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.history = list(state["history"])
        self.total_steps = int(state["total_steps"])
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"])
        self.say(f"resumed {self.out} at step {self.step} of {self.total_steps}")

    def log(self, rec: dict) -> None:
        self.history.append(rec)
        if self.dist.main:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    # ---------------------------------------------------------------- loop
    def evaluate(self) -> dict:
        self.model.eval()
        try:
            if self.cfg.stage == "dspark":
                from dsv41.train.dspark_stage import evaluate_drafter
                res = evaluate_drafter(self.model, self.val_windows, self.cfg.batch_size) if self.dist.main else {}
                res = self.dist.broadcast(res)
                return {"val_draft_ce": res["draft_ce"], "val_acceptance": res["acceptance"],
                        "val_tokens_per_step": res["tokens_per_step"]}
            return evaluate_lm(self.model, self.val_windows, self.cfg.batch_size, self.token_bytes, self.dist,
                               self._autocast)
        finally:
            self.model.train()

    def train_step(self) -> dict:
        cfg, dist = self.cfg, self.dist
        total = torch.zeros(1, dtype=torch.float64)
        metrics: dict[str, float] = {}
        starts = None                                       # replay starts [grad_accum, global batch] or None
        if self.replay_layers is not None:
            starts = replay_starts(cfg.seed, self.step, (cfg.grad_accum, cfg.batch_size * dist.world),
                                   self.model_cfg.window_size, cfg.seq_len)
        mine = slice(dist.rank * cfg.batch_size, (dist.rank + 1) * cfg.batch_size)
        for micro in range(cfg.grad_accum):
            x, y = (t.to(dist.device) for t in self.loader.next())
            extra = () if starts is None else (starts[micro, mine],)
            sync = micro == cfg.grad_accum - 1 or not hasattr(self.module, "no_sync")
            with (contextlib.nullcontext() if sync else self.module.no_sync()):
                with self._autocast():
                    loss, m = self.module(x, y, *extra)
                (loss / cfg.grad_accum).backward()
            self.balancer.observe()
            total += float(loss.detach())
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v / cfg.grad_accum
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, cfg.clip if cfg.clip > 0 else float("inf")))
        lr_f = lr_factor(self.step, self.total_steps, self.warmup)
        self.opt.set_lr_factor(lr_f)
        self.opt.step()
        self.opt.zero_grad()
        bal = self.balancer.step(dist.all_reduce if dist.world > 1 else None)
        dist.all_reduce(total)
        self.step += 1
        tokens = self.step * cfg.batch_size * cfg.seq_len * cfg.grad_accum * dist.world
        return {"step": self.step, "loss": float(total) / cfg.grad_accum / dist.world, "lr": cfg.lr * lr_f,
                "grad_norm": grad_norm, "tokens": tokens, **bal, **metrics}

    def run(self, stop_at: int | None = None) -> None:
        from tqdm import tqdm

        cfg = self.cfg
        end = self.total_steps if stop_at is None else min(stop_at, self.total_steps)
        bar = tqdm(total=self.total_steps, initial=self.step, desc=cfg.stage, unit="step", dynamic_ncols=True,
                   disable=not self.dist.main or cfg.quiet, mininterval=1.0)
        tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * self.dist.world
        train_time, steps_run, smooth = 0.0, 0, None
        while self.step < end:
            t = time.time()
            rec = self.train_step()
            train_time += time.time() - t
            steps_run += 1
            rec["elapsed"] = time.time() - self.t0
            rec["tok_per_s"] = steps_run * tokens_per_step / train_time
            self.log(rec)
            smooth = rec["loss"] if smooth is None else 0.9 * smooth + 0.1 * rec["loss"]
            post = f"loss {rec['loss']:.3f} (ema {smooth:.3f}) | {rec['tok_per_s']:.0f} tok/s | lr {rec['lr']:.2e}"
            if "maxvio" in rec:
                post += f" | maxvio {rec['maxvio']:.2f}"
            bar.set_postfix_str(post, refresh=False)
            bar.update(1)
            if self.step % self.eval_every == 0 or self.step == self.total_steps:
                ev = self.evaluate()
                self.log({"step": self.step, "tokens": rec["tokens"], **ev})
                if self.dist.main and not cfg.quiet:
                    bar.write(self._format_eval(ev))
            if self.step % self.save_every == 0 and self.step < self.total_steps:
                self.save()
        bar.close()
        self.tok_per_s = steps_run * tokens_per_step / train_time if steps_run else None
        if self.step < self.total_steps:                   # stopped early on purpose: leave a checkpoint
            self.save()

    def _format_eval(self, ev: dict) -> str:
        if "val_loss" in ev:
            return f"step {self.step}: val loss {ev['val_loss']:.4f}, {ev['val_bpb']:.4f} bits/byte"
        acc = ", ".join(f"{a:.2f}" for a in ev["val_acceptance"])
        return (f"step {self.step}: drafter val CE {ev['val_draft_ce']:.4f}, acceptance [{acc}], "
                f"{ev['val_tokens_per_step']:.2f} tokens/step")

    # ---------------------------------------------------------------- end
    def finish(self) -> dict:
        cfg = self.cfg
        self.save()
        summary = {"out": str(self.out), "stage": cfg.stage, "steps": self.step, "total_steps": self.total_steps,
                   "tokens": self.step * cfg.batch_size * cfg.seq_len * cfg.grad_accum * self.dist.world,
                   "tok_per_s": getattr(self, "tok_per_s", None), "wall_s": time.time() - self.t0,
                   "optimizer": cfg.optimizer, "qat": cfg.qat, "replay": cfg.replay, "world": self.dist.world}
        evals = [h for h in self.history if any(k.startswith("val_") for k in h)]
        if evals:
            summary.update({k: v for k, v in evals[-1].items() if k.startswith("val_")})
        summary.update(self._finish_pretrain() if cfg.stage == "pretrain" else self._finish_dspark())  # all ranks
        if self.dist.main:
            summary["loss_curve"] = str(plot_history(self.history, self.out / "loss_curve.png",
                                                     f"{cfg.preset} {cfg.stage} ({cfg.optimizer})"))
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.say(format_summary(summary))
        self.dist.barrier()
        return summary

    def _finish_pretrain(self) -> dict:
        """The validation loss with the inference numerics (FP8/FP4 QDQ on) and a greedy sample."""
        model, out = self.model, {}
        set_quantization(model, True)
        try:
            model.eval()
            out["val_loss_qdq"] = evaluate_lm(model, self.val_windows, self.cfg.batch_size, self.token_bytes,
                                              self.dist, self._autocast)["val_loss"]
        finally:
            set_quantization(model, False)
            model.train()
        if self.cfg.sample_tokens > 0:
            doc = self.corpus.val[0].text
            prompt = doc[:doc.find("\n", 80) + 1 or 120]
            ids = torch.tensor([[D.BOS_ID] + self.tokenizer.encode(prompt).ids], device=self.dist.device)
            model.eval()
            seq = greedy_continue(model, ids, self.cfg.sample_tokens)
            model.train()
            out["sample_prompt"] = prompt
            out["sample"] = self.tokenizer.decode(seq[0, ids.size(1):].tolist())
        return out

    def _finish_dspark(self) -> dict:
        """Acceptance on the backbone's own greedy continuations of validation prompts."""
        from dsv41.train.dspark_stage import greedy_acceptance
        P, n_new = 32, min(96, self.cfg.seq_len)
        starts = self.val_windows[:8, :P].to(self.dist.device)
        self.model.eval()
        res = greedy_acceptance(self.model, starts, n_new)
        self.model.train()
        return {"greedy_acceptance": res["acceptance"], "greedy_survival": res["survival"],
                "greedy_tokens_per_step": res["tokens_per_step"], "greedy_anchors": res["anchors"],
                "target_agrees_with_decode": res["target_agrees_with_decode"]}


# ------------------------------------------------------------------------------------------------ reporting

def plot_history(history: list[dict], path: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h for h in history if "loss" in h]
    evals = [h for h in history if "val_loss" in h or "val_draft_ce" in h]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if steps:
        x = [h["tokens"] for h in steps]
        y = [h["loss"] for h in steps]
        ax.plot(x, y, lw=0.8, alpha=0.45, label="train loss (step)")
        ema, sm = 0.0, []
        for i, v in enumerate(y, start=1):
            ema = 0.9 * ema + 0.1 * v
            sm.append(ema / (1 - 0.9 ** i))                   # bias-corrected: no lag from the first value
        ax.plot(x, sm, lw=1.6, label="train loss (EMA 0.9, debiased)")
    if evals:
        key = "val_loss" if "val_loss" in evals[0] else "val_draft_ce"
        ax.plot([h["tokens"] for h in evals], [h[key] for h in evals], "o-", lw=1.4, label=key.replace("_", " "))
    ax.set_xlabel("tokens")
    ax.set_ylabel("nats / token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_summary(s: dict) -> str:
    lines = [f"done: {s['steps']} steps, {s['tokens']:,} tokens in {s['wall_s'] / 60:.1f} min"
             + (f", {s['tok_per_s']:.0f} tokens/s while training" if s.get("tok_per_s") else "")]
    if "val_loss" in s:
        lines.append(f"validation: loss {s['val_loss']:.4f} nats/token, {s['val_bpb']:.4f} bits/byte"
                     + (f"; with FP8/FP4 QDQ on: loss {s['val_loss_qdq']:.4f}" if "val_loss_qdq" in s else ""))
    if "val_acceptance" in s:
        lines.append("drafter (teacher-forced validation): acceptance per position "
                     + ", ".join(f"{a:.3f}" for a in s["val_acceptance"])
                     + f"; {s['val_tokens_per_step']:.2f} tokens per verification step")
    if "greedy_acceptance" in s:
        lines.append("drafter (greedy self-generated): acceptance per position "
                     + ", ".join(f"{a:.3f}" for a in s["greedy_acceptance"])
                     + f"; {s['greedy_tokens_per_step']:.2f} tokens per verification step")
    lines.append(f"loss curve: {s['loss_curve']}; checkpoint: {s['out']}")
    if "sample" in s:
        lines.append("sample (greedy):\n" + s["sample_prompt"] + s["sample"])
    return "\n".join(lines)


def train(cfg: TrainConfig, resume: bool = False, stop_at: int | None = None) -> dict:
    """Build, train and report (the `dsv41 train` command)."""
    t = Trainer(cfg, resume=resume)
    t.run(stop_at)
    if stop_at is not None and t.step < t.total_steps:
        return {"out": str(t.out), "steps": t.step, "total_steps": t.total_steps, "stopped": True}
    return t.finish()
