"""Speculative decoding with the DSpark drafter (SYSTEM.md 5, MODEL.md 7): propose, schedule, verify, roll back.

One engine step for the running rows r, each holding its pending token t_r at position P_r (the target has consumed
P_r tokens; the drafter's rings hold the target's taps of positions < P_r):

  1. propose   the drafter reads t_r and its rings and proposes G = dspark_block_size drafts d_r,1..G for
               positions P_r+1.., each sampled from a known distribution q_r,k: the request's own sampling
               transform (temperature, top-k, top-p; `target_probs`) of the drafter's logits, the argmax for
               greedy requests. Its confidence head gives a_r,k = sigmoid(confidence), the predicted acceptance
               of draft k given drafts < k accepted.
  2. schedule  the number V of drafts to verify: fixed (`fixed:N`) or the confidence scheduler (`dspark`).
  3. verify    ONE target forward over [t_r, d_r,1..V] per row (T = 1 + V, a chunk at P_r) gives the target's
               logits at positions P_r..P_r+V, i.e. its distributions p_r,0..V for the tokens after each.
  4. accept    speculative rejection sampling per row (`accept_drafts`): draft k is accepted with probability
               min(1, p_k(d) / q_k(d)); at the first rejection the token is drawn from norm(max(0, p_k - q_k));
               when all V are accepted a bonus token is drawn from p_V. Greedy: accept iff d equals argmax p_k,
               else emit that argmax. Either way each emitted token has exactly the target's distribution given
               its prefix, whatever the drafter proposes (Leviathan et al. / Chen et al. 2023), so speculation
               changes speed, never output distribution; greedy output is token-for-token greedy decoding.
  5. roll back  rejected tokens leave no trace (`VerifyJournal`): the ring rows they overwrote are put back,
               global entries of groups they completed are forgotten (pages freed), each compressor's carry is
               recomputed for the accepted prefix from the group-aligned per-token sequence the forward recorded,
               the Engram n-gram history and the position are set to the accepted prefix.
  6. seed      the drafter's rings get the target's taps of the kept positions only.

Rows verify the same V (the forward runs [B, 1+V]); a row whose remaining `max_tokens` allows fewer drafts
still runs V (padding whose tokens cannot be emitted).

Confidence scheduler (SYSTEM.md 5). Prefix survival S_r,k = prod_{i<=k} a_r,i; verifying v_r drafts yields
1 + sum_{k<=v_r} S_r,k tokens in expectation; choose {v_r} maximising sum_r (1 + sum_{k<=v_r} S_r,k) / T(n) with T
the measured step latency at n tokens in the batch (`StepProfile`, written by `dsv41 profile-step`).
`choose_verify_lengths(..., ragged=True)` is that objective with n = sum_r (1 + v_r): for a fixed budget the
optimum takes drafts in decreasing S order across rows (S is non-increasing in k, so each row takes a prefix),
then the budget with the best ratio wins. The engine's forward is padded (every row runs 1 + V tokens), so it
uses `ragged=False`: the same objective with n = B (1 + V), whose optimum gives every row the same V.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from dsv41.engine.sampling import SamplingParams, target_probs
from dsv41.model.attention import carry_after
from dsv41.model.step import ForwardOptions

MODES = ("off", "fixed", "dspark")
PROFILE_FILE = "step_profile.json"


# ------------------------------------------------------------------------------------------------ policy

@dataclass(frozen=True)
class Speculation:
    """`off`, `fixed:N` (verify N drafts every step), `dspark` (the confidence scheduler of SYSTEM.md 5 on the
    confidence head's a_r,k and the profiled T(n)) or `dspark:online` (the same scheduler with both inputs corrected
    online by what the engine measures: `AcceptanceCalibration`, `MeasuredCost`; an extension, not yet shown to
    pay: see benchmarks/results/speculative-*-2026-12-03c.json)."""
    mode: str = "off"
    n: int = 0
    online: bool = False

    @classmethod
    def parse(cls, text: "str | Speculation | None") -> "Speculation":
        if isinstance(text, Speculation):
            return text
        t = (text or "off").strip().lower()
        if t in ("off", "dspark"):
            return cls(t)
        if t == "dspark:online":
            return cls("dspark", online=True)
        if t.startswith("fixed:"):
            try:
                n = int(t.split(":", 1)[1])
            except ValueError:
                n = -1
            if n >= 0:
                return cls("fixed", n)
        raise ValueError(f"speculative must be off, fixed:N (N >= 0), dspark or dspark:online, got {text!r}")

    def __str__(self) -> str:
        if self.mode == "fixed":
            return f"fixed:{self.n}"
        return "dspark:online" if self.mode == "dspark" and self.online else self.mode


class AcceptanceCalibration:
    """Online per-position correction of the drafter's acceptance estimates a_r,k for the scheduler.

    Over the drafts verified so far at position k (those reached with drafts < k accepted), accepted_k counts the
    accepted ones and predicted_k sums their a_r,k; ratio_k = (accepted_k + n0) / (predicted_k + n0) (n0 pseudo-
    drafts pull it to 1 while there are few) and the scheduler uses min(1, a_r,k * ratio_k). A confidence head that
    over-predicts (the tiny model's at batch 8 chose 4 drafts where 1 was best) is scaled down by what the engine
    measures; one that is right is left alone. Only the choice of V changes, never the output distribution."""

    def __init__(self, G: int, n0: float = 8.0):
        self.n0 = n0
        self.accepted = [0.0] * G
        self.predicted = [0.0] * G

    def update(self, k: int, predicted: float, accepted: bool) -> None:
        self.predicted[k] += predicted
        self.accepted[k] += float(accepted)

    def ratios(self) -> torch.Tensor:
        return torch.tensor([(a + self.n0) / (p + self.n0) for a, p in zip(self.accepted, self.predicted)])

    def apply(self, accept: torch.Tensor) -> torch.Tensor:
        """a [B, G] -> calibrated a [B, G]."""
        return (accept * self.ratios()[:accept.size(1)]).clamp(max=1.0)


# ------------------------------------------------------------------------------------------------ acceptance

def accept_drafts(logits: torch.Tensor, drafts: Sequence[int], q: torch.Tensor | None, params: SamplingParams,
                  gen: torch.Generator) -> tuple[int, int]:
    """Speculative rejection sampling for one row. logits [v+1, V] are the target's at the pending token and
    each of the v drafts; q [v, V] the distributions the drafts were sampled from (None: each draft was a
    deterministic choice, a point mass). Returns (accepted drafts n, the next token: the correction at n < v or
    the bonus at n = v)."""
    v = len(drafts)
    if params.temperature == 0:
        best = logits[:v + 1].argmax(-1).tolist()
        for k in range(v):
            if best[k] != int(drafts[k]):
                return k, best[k]
        return v, best[v]
    p = target_probs(logits[:v + 1].float().cpu(), params)
    for k in range(v):
        d = int(drafts[k])
        qd = 1.0 if q is None else float(q[k, d])
        u = float(torch.rand((), generator=gen))
        if u * qd < float(p[k, d]):                            # accept with probability min(1, p/q)
            continue
        qk = torch.zeros_like(p[k]).index_fill_(0, torch.tensor([d]), 1.0) if q is None else q[k].float().cpu()
        resid = (p[k] - qk).clamp_min(0)
        if float(resid.sum()) <= 0:                            # p == q up to rounding: rejection had mass 0
            resid = p[k]
        return k, int(torch.multinomial(resid / resid.sum(), 1, generator=gen))
    return v, int(torch.multinomial(p[v], 1, generator=gen))


# ------------------------------------------------------------------------------------------------ drafter

@dataclass
class Proposal:
    tokens: torch.Tensor              # [B, G] drafts for positions P_r+1..P_r+G
    q: list                           # per row: [G, V] proposal distributions (CPU), or None (point masses)
    accept: torch.Tensor              # [B, G] a_r,k = sigmoid(confidence), CPU float

    def survival(self, calibration: "AcceptanceCalibration | None" = None) -> torch.Tensor:
        """S_r,k = prod_{i<=k} a_r,i  [B, G] (a_r,k calibrated first when given)."""
        a = self.accept if calibration is None else calibration.apply(self.accept)
        return torch.cumprod(a, dim=1)


class DSparkDrafter:
    """The model's DSpark stages (`model.mtp`) as the engine's drafter."""

    def __init__(self, model):
        if not model.cfg.dspark_enabled or len(model.mtp) == 0:
            raise ValueError("speculative decoding needs a model with the DSpark drafter (dspark_enabled)")
        self.model = model

    def seed(self, view, main_hidden: torch.Tensor, start: torch.Tensor, count: torch.Tensor | None = None) -> None:
        """Write the target's taps main_hidden [B,T,taps*D] of positions start_b.. (first count_b) to the rings."""
        from dsv41.model.dspark import forward_spec
        forward_spec(self.model, None, main_hidden, view, start, count=count)

    def propose(self, view, seqs: list, pos: torch.Tensor) -> Proposal:
        """Drafts for the rows of `view`: seqs[b] (the engine's Sequence: .pending at position pos_b, .params,
        .gen) -> `Proposal`. Any object with `seed` and `propose` can serve as the engine's drafter (tests inject
        oracle and adversarial ones); exactness never depends on it."""
        from dsv41.model.dspark import forward_spec
        model = self.model
        B = len(seqs)
        pending = torch.tensor([s.pending for s in seqs])
        params, gens = [s.params for s in seqs], [s.gen for s in seqs]
        dev = model.embed.weight.device
        taps = len(model.cfg.dspark_target_layer_ids) * model.cfg.dim
        q_rows: list[list] = [[] for _ in range(B)]

        def sampler(i: int, logits: torch.Tensor) -> torch.Tensor:
            out = torch.empty(B, dtype=torch.long)
            for b in range(B):
                if params[b].temperature == 0:
                    out[b] = int(logits[b].argmax())
                    q_rows[b].append(None)
                else:
                    q = target_probs(logits[b].float().cpu(), params[b])
                    out[b] = int(torch.multinomial(q, 1, generator=gens[b]))
                    q_rows[b].append(q)
            return out.to(logits.device)

        empty = torch.zeros(B, 0, taps, dtype=model.dtype, device=dev)
        ids, _, confidence = forward_spec(model, pending.to(dev), empty, view, pos, sampler=sampler)
        q = [None if r[0] is None else torch.stack(r) for r in q_rows]
        return Proposal(ids[:, 1:].cpu(), q, torch.sigmoid(confidence.float()).cpu())


# ------------------------------------------------------------------------------------------------ rollback

class VerifyJournal:
    """What a verify forward of T tokens per row at positions start.. changes in a bound store, kept so that
    `rollback(keep)` leaves exactly the state after each row's first keep_b tokens. Pass `.model_journal` to the
    forward (`ForwardOptions(journal=...)`): compressors record their per-token sequence there."""

    def __init__(self, model, view, start: torch.Tensor, T: int):
        cfg = model.cfg
        W = cfg.window_size
        if T > W:
            raise ValueError(f"a verify step of {T} tokens exceeds the window of {W}")
        self.start, self.T = start.clone().cpu(), T
        self.slots = (self.start.view(-1, 1) + torch.arange(T)) % W                  # [B,T] ring slots written
        self.layers = range(cfg.n_layers)                                              # the target's rings
        self.rings = {L: view.ring_rows(L, self.slots) for L in self.layers}
        h = view.engram_history
        if h is None and model.engram_hasher is not None:                             # before any token: all DEAD
            h = model.engram_hasher.init_history(self.start.numel())
        self.history = None if h is None else h.clone()
        self.model_journal: dict = {}

    def rollback(self, model, view, ids: torch.Tensor, keep: torch.Tensor) -> None:
        """ids [B,T] the tokens the forward ran; keep [B] in 1..T: tokens each row keeps."""
        keep = torch.as_tensor(keep, dtype=torch.long).cpu()
        n = self.start + keep
        rejected = torch.arange(self.T).view(1, -1) >= keep.view(-1, 1)
        if bool(rejected.any()):
            for L in self.layers:
                view.set_ring_rows(L, self.slots, self.rings[L], rejected)
        view.truncate_global(n)
        for key, (seq_kv, seq_sc, carried) in self.model_journal.items():
            if key[0] == "compressor":
                L = key[1]
                m = view.specs[L].ratio
                view.set_compressor_state(L, *carry_after(seq_kv, seq_sc, carried + keep.to(carried.device), m))
        hasher = model.engram_hasher
        if hasher is not None and self.history is not None:
            k = self.history.size(1)
            ext = torch.cat([self.history.to(hasher.token_map.device).long(),
                             hasher.compress(ids.to(hasher.token_map.device))], dim=1)
            idx = keep.to(ext.device).view(-1, 1) + torch.arange(k, device=ext.device)
            view.engram_history = ext.gather(1, idx)
        view.pos = n


# ------------------------------------------------------------------------------------------------ scheduler

class StepProfile:
    """T(n): the engine's measured step latency (seconds) with n tokens in the batch; piecewise linear between
    measured points (duplicates averaged), extended linearly past the ends, never below the smallest time."""

    def __init__(self, tokens: Sequence[int], seconds: Sequence[float], meta: dict | None = None):
        if not tokens or len(tokens) != len(seconds):
            raise ValueError("a step profile needs matching, non-empty token counts and times")
        acc: dict[int, list[float]] = {}
        for n, s in zip(tokens, seconds):
            if n < 1 or not (s > 0 and math.isfinite(s)):
                raise ValueError(f"bad profile point ({n}, {s})")
            acc.setdefault(int(n), []).append(float(s))
        self.n = sorted(acc)
        self.t = [sum(acc[n]) / len(acc[n]) for n in self.n]
        self.meta = dict(meta or {})

    def __call__(self, n: int) -> float:
        xs, ys = self.n, self.t
        if len(xs) == 1:
            return ys[0] * max(1.0, n / xs[0])
        if n <= xs[0]:
            return ys[0]
        i = next((j for j in range(1, len(xs)) if n <= xs[j]), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(min(ys), y0 + (y1 - y0) * (n - x0) / (x1 - x0))

    def to_json(self) -> dict:
        return {"tokens": self.n, "seconds": self.t, **self.meta}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path) -> "StepProfile":
        d = json.loads(Path(path).read_text())
        return cls(d["tokens"], d["seconds"], {k: v for k, v in d.items() if k not in ("tokens", "seconds")})


class MeasuredCost:
    """T(n) for the scheduler, corrected by the engine's own speculative step times.

    The profile is the prior. Each engine step records (n, seconds); the first step at each n is a warm-up and is
    dropped. A measured n costs its mean; any other n costs profile(n) times the mean measured/profile ratio, which
    puts a profile from another context length or machine on the engine's scale. A V whose verify costs more than
    the profile said is corrected the first time the scheduler chooses it."""

    def __init__(self, profile: Callable[[int], float]):
        self.profile = profile
        self.seen: set[int] = set()
        self.sums: dict[int, float] = {}
        self.counts: dict[int, int] = {}

    def record(self, n: int, seconds: float) -> None:
        if n not in self.seen:
            self.seen.add(n)
            return
        self.sums[n] = self.sums.get(n, 0.0) + seconds
        self.counts[n] = self.counts.get(n, 0) + 1

    def __call__(self, n: int) -> float:
        if n in self.counts:
            return self.sums[n] / self.counts[n]
        if not self.counts:
            return self.profile(n)
        scale = sum(self.sums[m] / self.counts[m] / self.profile(m) for m in self.counts) / len(self.counts)
        return self.profile(n) * scale


def expected_tokens(S: torch.Tensor, v: Sequence[int]) -> float:
    """sum_r (1 + sum_{k<=v_r} S_r,k)."""
    return sum(1.0 + float(S[r, :v[r]].sum()) for r in range(S.size(0)))


def choose_verify_lengths(S: torch.Tensor, cost: Callable[[int], float], max_v: int | Sequence[int],
                          ragged: bool = True) -> list[int]:
    """The {v_r} maximising expected_tokens(S, v) / cost(tokens in the batch) (module docstring).
    S [B,G] prefix survivals (non-increasing along k); max_v: the most drafts per row (int or per row).
    ragged: tokens = sum_r (1 + v_r); otherwise (a padded forward) tokens = B (1 + max v) and every row gets
    the same v."""
    S = torch.as_tensor(S, dtype=torch.float64).cpu()
    B, G = S.shape
    caps = [min(G, int(c)) for c in (max_v if isinstance(max_v, Sequence) else [max_v] * B)]
    caps = [max(0, c) for c in caps]
    if not ragged:
        best, best_v = -1.0, 0
        for V in range(max(caps) + 1):
            num = sum(1.0 + float(S[r, :min(V, caps[r])].sum()) for r in range(B))
            ratio = num / cost(B * (1 + V))
            if ratio > best + 1e-12 * abs(best):
                best, best_v = ratio, V
        return [best_v] * B
    gains = sorted(((float(S[r, k]), k, r) for r in range(B) for k in range(caps[r])), key=lambda g: (-g[0], g[1]))
    num, best, best_b = float(B), B / cost(B), 0
    for b, (s, _, _) in enumerate(gains, start=1):
        num += s
        ratio = num / cost(B + b)
        if ratio > best + 1e-12 * abs(best):
            best, best_b = ratio, b
    v = [0] * B
    for _, _, r in gains[:best_b]:
        v[r] += 1
    return v


# ------------------------------------------------------------------------------------------------ profiling

@dataclass
class _ProfileRow:
    pending: int
    params: SamplingParams
    gen: torch.Generator


@torch.no_grad()
def profile_step(model, batches: Sequence[int] = (1, 2, 4, 8), max_v: int | None = None, context: int = 256,
                 repeats: int = 3, device="cpu", seed: int = 0, log=print) -> StepProfile:
    """Measure the speculative step (drafter proposal + verify forward over B x (1 + V) tokens + rollback) at a
    context of `context` tokens, for each batch size and V = 0..max_v; median of `repeats`."""
    from dsv41.engine.store import make_pool

    cfg = model.cfg
    G = cfg.dspark_block_size if max_v is None else max_v
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(model, device)
    drafter = DSparkDrafter(model) if cfg.dspark_enabled and len(model.mtp) else None
    tokens, seconds, rows = [], [], []
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    for B in batches:
        sids = []
        for _ in range(B):
            sid = pool.new_sequence()
            view = pool.bind([sid])
            ids = torch.randint(0, cfg.vocab_size, (1, context), generator=gen).to(device)
            out = model(ids, view, last_only=True)
            if drafter is not None and out.main_hidden is not None:
                drafter.seed(view, out.main_hidden[:, -cfg.window_size:],
                             view.pos - min(context, cfg.window_size))
            getattr(pool, "release", lambda *a: None)(view, [sid])
            sids.append(sid)
        for V in range(G + 1):
            times = []
            for _ in range(repeats):
                view = pool.bind(sids)
                pos = view.pos.clone()
                pending = torch.randint(0, cfg.vocab_size, (B,), generator=gen)
                sync()
                t0 = time.perf_counter()
                if drafter is not None:
                    seqs = [_ProfileRow(int(t), SamplingParams(), gen) for t in pending]
                    prop = drafter.propose(view, seqs, pos)
                    drafts = prop.tokens[:, :V]
                else:
                    drafts = torch.randint(0, cfg.vocab_size, (B, V), generator=gen)
                ids = torch.cat([pending.view(-1, 1), drafts], dim=1).to(device)
                journal = VerifyJournal(model, view, pos, 1 + V)
                model(ids, view, opts=ForwardOptions(journal=journal.model_journal))
                journal.rollback(model, view, ids, torch.ones(B, dtype=torch.long))
                sync()
                times.append(time.perf_counter() - t0)
                getattr(pool, "release", lambda *a: None)(view, sids)
            t = sorted(times)[len(times) // 2]
            tokens.append(B * (1 + V))
            seconds.append(t)
            rows.append({"batch": B, "verify": V, "tokens": B * (1 + V), "seconds": t})
            log(f"profile-step  batch {B:3d}  verify {V}  tokens {B * (1 + V):4d}  {t * 1e3:9.2f} ms")
        for sid in sids:
            pool.free(sid)
    return StepProfile(tokens, seconds, {"context": context, "device": str(device), "points": rows,
                                         "dtype": str(model.dtype).replace("torch.", "")})


# ------------------------------------------------------------------------------------------------ checkpoints

def has_trained_drafter(checkpoint) -> bool:
    """Whether a checkpoint directory holds a drafter trained by the DSpark stage (`dsv41 train --stage dspark`
    writes summary.json with stage "dspark")."""
    if checkpoint is None:
        return False
    f = Path(checkpoint) / "summary.json"
    try:
        return json.loads(f.read_text()).get("stage") == "dspark"
    except (OSError, ValueError, AttributeError):
        return False


def resolve_speculation(model, checkpoint, flag: str = "auto", profile_path=None, max_batch: int = 8,
                        device="cpu", log=print) -> tuple[Speculation, StepProfile | None]:
    """The `--speculative` flag of `generate` / `serve`: auto = the confidence scheduler when the checkpoint has
    a trained drafter, else off. The scheduler's T(n) comes from --step-profile, else the checkpoint's
    step_profile.json (`dsv41 profile-step`), else a quick profile measured now (logged)."""
    if flag == "auto":
        flag = "dspark" if has_trained_drafter(checkpoint) and model.cfg.dspark_enabled else "off"
    spec = Speculation.parse(flag)
    if spec.mode == "off":
        return spec, None
    if spec.mode != "off" and not has_trained_drafter(checkpoint):
        log(f"speculative {spec}: this checkpoint's drafter was not trained by the DSpark stage; outputs are "
            "exact, acceptance will be low")
    if spec.mode != "dspark":
        return spec, None
    path = Path(profile_path) if profile_path else (Path(checkpoint) / PROFILE_FILE if checkpoint else None)
    if path is not None and path.exists():
        return spec, StepProfile.load(path)
    log("speculative dspark: no step profile found (run `dsv41 profile-step --checkpoint ...` to store one); "
        "measuring a quick one now")
    batches = sorted({1, max(1, max_batch)})
    return spec, profile_step(model, batches=batches, context=256, repeats=1, device=device, log=lambda *a: None)
