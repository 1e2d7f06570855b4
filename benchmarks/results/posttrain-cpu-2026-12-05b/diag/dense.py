import sys, time, random, torch, torch.nn.functional as F
torch.set_num_threads(1)
from dsv41.posttrain import tasks as T, sft as S
from dsv41.posttrain.opd import DenseTeacher
from dsv41.posttrain.tokenizer import load_post_tokenizer
tok = load_post_tokenizer("runs/diag"); fam = sys.argv[1]; steps = int(sys.argv[2]); B = int(sys.argv[3])
mix = S.TaskMix(families=(fam,), lo=2, hi=6)
torch.manual_seed(0); m = DenseTeacher(tok.vocab_size); opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
def ex(rng):
    p = T.sample_problem(rng, fam, 2, 6); pr, rs = T.prompt_ids(tok, p, 50), T.response_ids(tok, p, 1)
    ids = pr + rs; return ids[:-1], [S.IGNORE] * (len(pr) - 1) + rs
t0 = time.time()
for st in range(steps):
    rng = random.Random(f"d{st}"); E = [ex(rng) for _ in range(B)]
    ids = S.pad_batch([e[0] for e in E], tok.pad_id); tg = S.pad_batch([e[1] for e in E], S.IGNORE)
    loss = F.cross_entropy(m(ids).flatten(0, 1), tg.flatten(), ignore_index=S.IGNORE); opt.zero_grad(); loss.backward(); opt.step()
    if st % 200 == 199: print(st + 1, f"{time.time()-t0:.0f}s", loss.item(), flush=True)
m.eval(); rng = random.Random("x"); ok = 0
with torch.no_grad():
    for _ in range(100):
        p = T.sample_problem(rng, fam, 2, 6, "held_out"); pr, rs = T.prompt_ids(tok, p, 50), T.response_ids(tok, p, 1)
        pred = m(torch.tensor([pr + rs]))[0, len(pr) - 1:-1].argmax(-1).tolist(); k = rs.index(tok.think_end_id)
        ok += pred[k + 1] == rs[k + 1]
print("answer given stride-1 trace", ok / 100)
