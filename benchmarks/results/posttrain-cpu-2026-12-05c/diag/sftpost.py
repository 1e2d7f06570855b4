"""SFT of the `post` preset on one stride distribution for a step budget, with or without the indexer objective
(dsv41/train/indexer_loss.py), then greedy accuracy on 100 held-out problems per family (QDQ on, as evaluated).
usage: sftpost.py --steps N --batch B --strides one|uniform [--indexer W] [--fam sums,chase]"""
import argparse, contextlib, json, random, time, torch
from dsv41.posttrain import tasks as T, sft as S
from dsv41.posttrain.model import build_model
from dsv41.posttrain.tokenizer import load_post_tokenizer
from dsv41.model.common import set_quantization
from dsv41.train.indexer_loss import IndexerTap, indexer_kl
from dsv41.train.schedule import default_warmup, lr_factor
ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=300); ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--batch", type=int, default=32); ap.add_argument("--strides", default="one")
ap.add_argument("--indexer", type=float, default=0.0); ap.add_argument("--fam", default="sums,chase")
ap.add_argument("--threads", type=int, default=1); ap.add_argument("--minutes", type=float, default=60)
a = ap.parse_args(); torch.set_num_threads(a.threads)
tok = load_post_tokenizer("/tmp/diagtok"); mix = S.TaskMix(families=tuple(a.fam.split(",")))
def ex(rng):
    p = T.sample_problem(rng, rng.choice(mix.families), mix.lo, mix.hi); b = rng.choice(mix.levels)
    s = 1 if a.strides == "one" else rng.randint(1, p.difficulty)
    pr, rs = T.prompt_ids(tok, p, b), T.response_ids(tok, p, s); ids = pr + rs
    return ids[:-1], [S.IGNORE] * (len(pr) - 1) + rs
import os
model = build_model(tok, 0, preset=os.environ.get("PRESET", S.__dict__.get("PRESET_PATH", "dsv41/presets/post.json"))); model.train(); set_quantization(model, False)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
t0 = time.time(); warm = default_warmup(a.steps); L = []; step = 0
while step < a.steps and time.time() - t0 < a.minutes * 60:
    for g in opt.param_groups: g["lr"] = a.lr * lr_factor(step, a.steps, warm)
    rng = random.Random(f"sft:0:{step}"); E = [ex(rng) for _ in range(a.batch)]
    ids = S.pad_batch([e[0] for e in E], tok.pad_id); tg = S.pad_batch([e[1] for e in E], S.IGNORE)
    with IndexerTap(model) if a.indexer else contextlib.nullcontext() as tap:
        loss = S.sft_loss(model, ids, tg)
    total = loss + a.indexer * indexer_kl(model, tap) if a.indexer else loss
    opt.zero_grad(); total.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    step += 1; L.append(loss.item())
    if step % 50 == 0: print(step, f"{time.time()-t0:.0f}s loss {sum(L[-50:])/50:.3f}", flush=True)
model.eval(); set_quantization(model, True); res = {}
with torch.no_grad():
    for fam in mix.families:
        rng = random.Random("eval"); probs = [T.sample_problem(rng, fam, mix.lo, mix.hi, "held_out") for _ in range(100)]
        ok = 0; lens = []
        for plen in sorted({len(T.prompt_ids(tok, p, 50)) for p in probs}):
            grp = [p for p in probs if len(T.prompt_ids(tok, p, 50)) == plen]
            ids = torch.tensor([T.prompt_ids(tok, p, 50) for p in grp])
            for _ in range(40):
                lg = S.fast_forward(model, ids, S.TrainCache(model.cfg, ids.size(0), model.dtype, ids.device), S.ForwardOptions())
                ids = torch.cat([ids, lg[:, -1].argmax(-1, keepdim=True)], 1)
            for p, row in zip(grp, ids[:, plen:].tolist()):
                v = T.check(tok, p, row); ok += v.correct; lens.append(v.reasoning_tokens)
        res[fam] = {"greedy_accuracy": ok / len(probs), "mean_reasoning_tokens": sum(lens) / len(lens)}
print(json.dumps({"args": vars(a), "steps": step, "sec": round(time.time() - t0), "loss": sum(L[-20:]) / 20, "eval": res}))
