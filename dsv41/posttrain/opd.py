"""On-policy distillation (docs/system.md §7, docs/report.md §10.2): the student samples its own responses on the
engine, and at every response position it is pulled toward a teacher by the full-vocabulary reverse KL

    KL(pi_s || pi_t) = sum_v pi_s(v) (log pi_s(v) - log pi_t(v)),   d KL / d z_v = pi_s(v) (log pi_s(v) - log pi_t(v) - KL)

(z: the student's logits; the closed form is checked against autograd in the tests). Teachers are routed by task
family and share the tokenizer, and neither has the student's architecture:

* `SolverTeacher` — an exact solver that returns a distribution: the valid responses of the problem (one per
  trace stride) that agree with the student's prefix share the mass of their next tokens; when the prefix has left
  every valid response, the responses closest to it (most positions equal) say what comes next; `eps` of the mass
  is spread over the whole vocabulary, so the KL stays finite.
* `DenseTeacher` — a dense causal transformer (pre-norm, GELU MLPs, learned positions; no MoE, no compressed
  attention, no mHC), trained by SFT on its family.

The loss is token-level normalised over every response position of the batch.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.posttrain import tasks as T
from dsv41.posttrain.model import load, save
from dsv41.posttrain.rollout import Rollout, make_engine, rollouts
from dsv41.posttrain.sft import FULL_TRACE, IGNORE, TaskMix, pad_batch, sft_example
from dsv41.train.qat import sequence_forward


def reverse_kl(student_logits: torch.Tensor, teacher_lp: torch.Tensor) -> torch.Tensor:
    """KL(pi_s || pi_t) per row: logits [N, V], teacher log-probs [N, V] -> [N]."""
    lp = torch.log_softmax(student_logits.float(), -1)
    return (lp.exp() * (lp - teacher_lp)).sum(-1)


def reverse_kl_grad(student_logits: torch.Tensor, teacher_lp: torch.Tensor) -> torch.Tensor:
    """The closed-form gradient of reverse_kl with respect to the student's logits, [N, V]."""
    lp = torch.log_softmax(student_logits.float(), -1)
    p = lp.exp()
    kl = (p * (lp - teacher_lp)).sum(-1, keepdim=True)
    return p * (lp - teacher_lp - kl)


class SolverTeacher:
    """The exact solver as a distribution (module docstring). Valid responses are weighted by a prior over the
    trace stride: stride 1 gets `full_trace` of the mass plus its share of the rest, the rest is spread evenly
    over 1..n (the SFT draw); with full_trace 0 every stride weighs the same."""

    def __init__(self, tok, eps: float = 0.02, full_trace: float = FULL_TRACE):
        self.tok, self.eps, self.full_trace = tok, eps, full_trace

    def prior(self, n: int) -> list[float]:
        return [(self.full_trace if s == 1 else 0.0) + (1 - self.full_trace) / n for s in range(1, n + 1)]

    def logprobs(self, p: T.Problem, output: list[int]) -> torch.Tensor:
        """log pi_t of each position of `output` given the prefix before it: [len(output), V]."""
        V = self.tok.vocab_size
        valid = [T.response_ids(self.tok, p, s) for s in range(1, p.difficulty + 1)]
        prior = self.prior(p.difficulty)
        out = torch.full((len(output), V), self.eps / V, dtype=torch.float64)
        for t in range(len(output)):
            prefix = output[:t]
            match = [i for i, r in enumerate(valid) if len(r) > t and r[:t] == prefix]
            if not match:
                cand = [i for i, r in enumerate(valid) if len(r) > t] or list(range(len(valid)))
                pos = {i: t if len(valid[i]) > t else len(valid[i]) - 1 for i in cand}
                score = {i: sum(a == b for a, b in zip(valid[i], prefix)) for i in cand}
                best = max(score.values())
                nxt = [(valid[i][pos[i]], prior[i]) for i in cand if score[i] == best]
            else:
                nxt = [(valid[i][t], prior[i]) for i in match]
            total = sum(w for _, w in nxt)
            for v, w in nxt:
                out[t, v] += (1 - self.eps) * w / total
        return out.log().float()


class DenseTeacher(nn.Module):
    """A dense causal transformer over the shared tokenizer's ids (see the module docstring)."""

    def __init__(self, vocab: int, dim: int = 96, layers: int = 3, heads: int = 4, max_len: int = 256):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T_ = ids.size(1)
        h = self.embed(ids) + self.pos(torch.arange(T_, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T_, device=ids.device)
        return self.head(self.norm(self.body(h, mask=mask, is_causal=True)))

    def logprobs(self, p: T.Problem, output: list[int], prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            lg = self(torch.tensor([prompt + output]))[0, len(prompt) - 1:len(prompt) - 1 + len(output)]
        return torch.log_softmax(lg.float(), -1)


def train_dense_teacher(tok, family: str, mix: TaskMix, steps: int, seed: int = 0, say=print,
                        full_trace: float = 0.5) -> DenseTeacher:
    """SFT of a DenseTeacher on one family's examples (every stride, every level; stride 1 with probability
    `full_trace`, the rest uniform)."""
    torch.manual_seed(seed)
    model = DenseTeacher(tok.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    fam = TaskMix((family,), mix.lo, mix.hi, mix.levels)
    t0 = time.time()
    for step in range(steps):
        rng = random.Random(f"teacher:{family}:{seed}:{step}")
        ex = [sft_example(rng, tok, fam, full_trace) for _ in range(32)]
        ids, tg = pad_batch([e[0] for e in ex], tok.pad_id), pad_batch([e[1] for e in ex], IGNORE)
        loss = F.cross_entropy(model(ids).flatten(0, 1), tg.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 250 == 0:
            say(f"teacher {family} step {step + 1}/{steps} loss {float(loss.detach()):.4f} ({time.time() - t0:.0f}s)")
    return model.eval()


def teacher_logprobs(teachers: dict, r: Rollout) -> torch.Tensor:
    t = teachers[r.problem.family]
    if isinstance(t, DenseTeacher):
        return t.logprobs(r.problem, r.output_ids, r.prompt_ids)
    return t.logprobs(r.problem, r.output_ids)


def opd_loss(model, rs: list[Rollout], teachers: dict, pad: int) -> torch.Tensor:
    """Mean reverse KL over every response position of the batch (the student's reference forward, QDQ on)."""
    rows = [r.prompt_ids + r.output_ids for r in rs]
    ids = pad_batch(rows, pad)
    logits = sequence_forward(model, ids).logits
    z, lt = [], []
    for i, r in enumerate(rs):
        a = len(r.prompt_ids) - 1
        z.append(logits[i, a:a + len(r.output_ids)])
        lt.append(teacher_logprobs(teachers, r))
    return reverse_kl(torch.cat(z), torch.cat(lt)).mean()


@dataclass
class OPDConfig:
    init: str = "runs/post-rl"
    out: str = "runs/post-opd"
    steps: int = 30
    minutes: float = 4.0
    prompts: int = 16
    max_tokens: int = T.MAX_TOKENS
    lr: float = 5e-4
    teacher_steps: int = 1500        # the dense teacher learns the sums step near 1,250 steps (~90 s on one core)
    eval_problems: int = 100          # held-out problems for the student-vs-teacher accuracy; 0: off
    # the levels of that comparison (the five anchor levels, whatever the training grid: with the dense grid of
    # `posttrain all`, 96 levels made it ~20 times longer than the stage's training)
    eval_levels: tuple = (1, 25, 50, 75, 100)
    seed: int = 0
    mix: TaskMix = field(default_factory=TaskMix)


def run_opd(cfg: OPDConfig, say=print) -> Path:
    """Distil the teachers into the checkpoint cfg.init on the student's own samples; sums -> a dense transformer
    trained here (it learns the labelled sums to 1.0 greedy in 1,500 steps, where the `post` student's SFT often
    has not learned the mod-10 step yet), chase -> the exact solver."""
    cfg.mix.check()
    model, tok, _ = load(cfg.init)
    teachers = {"chase": SolverTeacher(tok)}
    if "sums" in cfg.mix.families:
        teachers["sums"] = train_dense_teacher(tok, "sums", cfg.mix, cfg.teacher_steps, cfg.seed, say)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    eng = make_engine(model, tok, max_batch=cfg.prompts)
    t0, step, history = time.time(), 0, []
    while step < cfg.steps and time.time() - t0 < cfg.minutes * 60:
        rng = random.Random(f"opd:{cfg.seed}:{step}")
        items = [(T.sample_problem(rng, cfg.mix.families[i % len(cfg.mix.families)], cfg.mix.lo, cfg.mix.hi),
                  rng.choice(cfg.mix.levels), rng.randrange(2 ** 31)) for i in range(cfg.prompts)]
        rs = rollouts(eng, tok, items, cfg.max_tokens)
        model.train()
        try:
            loss = opd_loss(model, rs, teachers, tok.pad_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        finally:
            model.eval()
        step += 1
        kl = float(loss.detach())
        history.append({"step": step, "kl": kl, "sampled_tokens": sum(len(r.output_ids) for r in rs),
                        "accuracy": sum(r.verdict.correct for r in rs) / len(rs)})
        say(f"opd step {step}/{cfg.steps} kl {kl:.4f} acc {history[-1]['accuracy']:.2f} "
            f"({time.time() - t0:.0f}s)")
    save(model, tok, Path(cfg.out), {"stage": "opd", "step": step, "history": history, "config": asdict(cfg)})
    if "sums" in teachers:
        torch.save(teachers["sums"].state_dict(), Path(cfg.out) / "teacher_sums.pt")
    if cfg.eval_problems:
        from dsv41.posttrain.rollout import evaluate, held_out_problems
        t1 = time.time()
        problems = held_out_problems(cfg.mix, cfg.eval_problems)
        levels = tuple(cfg.eval_levels)
        res = evaluate(model, tok, problems, levels, cfg.max_tokens)
        rep = {"problems": len(problems), "levels": list(levels), "greedy": True, "families": {}}
        for fam, t in teachers.items():
            idx = [i for i, p in enumerate(problems) if p.family == fam]
            tc = [int(T.check(tok, problems[i], teacher_greedy(t, tok, problems[i], b, cfg.max_tokens)).correct)
                  for b in levels for i in idx]
            sc = [res[b]["correct"][i] for b in levels for i in idx]
            ta, sa = sum(tc) / len(tc), sum(sc) / len(sc)
            rep["families"][fam] = {"teacher": type(t).__name__, "n": len(tc), "teacher_accuracy": ta,
                                    "student_accuracy": sa, "student_pct_of_teacher": 100 * sa / ta if ta else None}
        rep["seconds"] = time.time() - t1
        (Path(cfg.out) / "opd.json").write_text(json.dumps(rep, indent=2) + "\n")
        say("opd: held-out greedy accuracy, student vs teacher: " + ", ".join(
            f"{f} {v['student_accuracy']:.3f} / {v['teacher_accuracy']:.3f}" for f, v in rep["families"].items()))
    return Path(cfg.out)


@torch.no_grad()
def teacher_greedy(teacher, tok, p: T.Problem, effort: int, max_tokens: int) -> list[int]:
    """The teacher's greedy response to the (problem, effort) prompt: the argmax of its next-token distribution,
    token by token, up to the EOS or max_tokens (the row after the output is read by appending a placeholder id,
    which the next-token distribution of a causal teacher does not see)."""
    prompt, out = T.prompt_ids(tok, p, effort), []
    while len(out) < max_tokens:
        probe = out + [tok.pad_id]
        lp = teacher.logprobs(p, probe, prompt) if isinstance(teacher, DenseTeacher) else teacher.logprobs(p, probe)
        nxt = int(lp[-1].argmax())
        out.append(nxt)
        if nxt == tok.eos_id:
            break
    return out
