import sys, time, random, json, torch, torch.nn.functional as F
torch.set_num_threads(1)
from dsv41.posttrain import tasks as T, sft as S
from dsv41.posttrain.model import build_model
from dsv41.posttrain.tokenizer import load_post_tokenizer
from dsv41.model.common import set_quantization
from dsv41.train.schedule import default_warmup, lr_factor
import argparse
ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=300); ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--batch", type=int, default=32); ap.add_argument("--strides", default="uniform")
ap.add_argument("--lo", type=int, default=2); ap.add_argument("--hi", type=int, default=6)
ap.add_argument("--fam", default="sums,chase"); ap.add_argument("--minutes", type=float, default=4)
a = ap.parse_args()
tok = load_post_tokenizer("runs/diag")
mix = S.TaskMix(families=tuple(a.fam.split(",")), lo=a.lo, hi=a.hi)
def pick(rng, n):
    if a.strides == "uniform": return rng.randint(1, n)
    if a.strides == "ends": return rng.choice([1, n])
    if a.strides == "one": return 1
def ex(rng):
    p = T.sample_problem(rng, rng.choice(mix.families), mix.lo, mix.hi); b = rng.choice(mix.levels)
    pr, rs = T.prompt_ids(tok, p, b), T.response_ids(tok, p, pick(rng, p.difficulty))
    ids = pr + rs; return ids[:-1], [S.IGNORE] * (len(pr) - 1) + rs
import os
from dsv41.posttrain.model import PRESET
model = build_model(tok, 0, preset=os.environ.get("PRESET", PRESET)); model.train(); set_quantization(model, False)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
t0 = time.time(); warm = default_warmup(a.steps); step = 0; L = []
while step < a.steps and time.time() - t0 < a.minutes * 60:
    for g in opt.param_groups: g["lr"] = a.lr * lr_factor(step, a.steps, warm)
    rng = random.Random(f"sft:0:{step}"); E = [ex(rng) for _ in range(a.batch)]
    ids = S.pad_batch([e[0] for e in E], tok.pad_id); tg = S.pad_batch([e[1] for e in E], S.IGNORE)
    loss = S.sft_loss(model, ids, tg); opt.zero_grad(); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); step += 1; L.append(loss.item())
    if step % 50 == 0: print(step, f"{time.time()-t0:.0f}s loss {sum(L[-50:])/50:.3f}", flush=True)
model.eval(); set_quantization(model, True)
# teacher-forced per stride: answer correct given gold trace; trace tokens all argmax-correct after the first chunk
rng = random.Random("diag"); res = {}
with torch.no_grad():
    for fam in mix.families:
        probs = [T.sample_problem(rng, fam, mix.lo, mix.hi, "held_out") for _ in range(100)]
        for rel in ("1", "n"):
            rows = []
            for p in probs:
                s = 1 if rel == "1" else p.difficulty
                pr, rs = T.prompt_ids(tok, p, 50), T.response_ids(tok, p, s)
                rows.append((pr, rs))
            ids = S.pad_batch([pr + rs for pr, rs in rows], tok.pad_id)
            lg = S.fast_forward(model, ids, S.TrainCache(model.cfg, ids.size(0), model.dtype, ids.device), S.ForwardOptions())
            ans = tr = 0
            for i, (pr, rs) in enumerate(rows):
                pred = lg[i, len(pr) - 1:len(pr) + len(rs) - 1].argmax(-1).tolist()
                k = rs.index(tok.think_end_id)
                ans += pred[k + 1] == rs[k + 1]
                tr += all(pred[j] == rs[j] for j in range(2, k + 1)) if k > 2 else 1
            res[f"{fam} stride {rel}"] = {"answer_given_trace": ans / len(rows), "trace_ok": tr / len(rows)}
print(json.dumps({"args": vars(a), "steps": step, "sec": round(time.time() - t0), "loss": sum(L[-20:]) / 20, "tf": res}))
