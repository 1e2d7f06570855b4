"""Which sums format can a small model learn in SFT's budget? A dense transformer (the OPD teacher class) trained
on stride-1 traces of one format, then greedy-decoded on 200 held-out problems. Formats:
  A  the 2026-12-05 format: `sum 29141` -> `2=2 9=1 1=2 4=6</think>7` (the last digit only in the prompt)
  B  complete trace:        `sum 29141` -> `2=2 9=1 1=2 4=6 1=7</think>7` (the answer is the last state)
  C  labelled digits:       `sum a2 b9 c1 d4 e1` -> `a2=2 b9=1 c1=2 d4=6 e1=7</think>7`
usage: fmt.py FORMAT STEPS BATCH [stride: one|uniform]"""
import random, sys, time, torch, torch.nn.functional as F
torch.set_num_threads(1)
from dsv41.posttrain import tasks as T, sft as S
from dsv41.posttrain.opd import DenseTeacher
from dsv41.posttrain.tokenizer import load_post_tokenizer
from dsv41.server.chat import THINK_END
fmt, steps, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]); strides = sys.argv[4] if len(sys.argv) > 4 else "one"
tok = load_post_tokenizer("/tmp/diagtok")
def problem(rng, split):
    p = T.sample_problem(rng, "sums", 2, 6, split); d = p.pieces
    content = "sum " + " ".join(f"{'abcdefgh'[i]}{x}" for i, x in enumerate(d)) if fmt == "C" else p.content
    return p, content
def texts(p, content, stride):
    n = p.difficulty; d = p.pieces; lab = (lambda i: "abcdefgh"[i]) if fmt == "C" else (lambda i: "")
    ends = list(range(stride, n, stride)) + ([n] if fmt in "BC" and stride < n else [])
    items = [" ".join(f"{lab(i)}{d[i]}" for i in range(e - stride if e % stride == 0 else e - n % stride, e)).replace(" ", "") if fmt != "C" else
             " ".join(f"{lab(i)}{d[i]}" for i in range(max(0, e - stride) if e % stride == 0 else e - n % stride, e)) for e in ends]
    tr = " ".join(f"{it}={p.states[e - 1]}" for it, e in zip(items, ends))
    msgs = T.OfficialTemplate().render([{"role": "user", "content": content}], effort=50, thinking=True)
    return [tok.bos_id] + T.encode_prompt(tok, msgs), T.encode_prompt(tok, tr + THINK_END + p.answer) + [tok.eos_id]
torch.manual_seed(0); m = DenseTeacher(tok.vocab_size); opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
t0 = time.time()
for st in range(steps):
    rng = random.Random(f"f{st}"); E = []
    for _ in range(B):
        p, c = problem(rng, "train"); s = 1 if strides == "one" else rng.randint(1, p.difficulty)
        pr, rs = texts(p, c, s); E.append((pr + rs)[:-1]); E[-1] = (E[-1], [S.IGNORE] * (len(pr) - 1) + rs)
    ids = S.pad_batch([e[0] for e in E], tok.pad_id); tg = S.pad_batch([e[1] for e in E], S.IGNORE)
    loss = F.cross_entropy(m(ids).flatten(0, 1), tg.flatten(), ignore_index=S.IGNORE); opt.zero_grad(); loss.backward(); opt.step()
    if st % 250 == 249: print(st + 1, f"{time.time()-t0:.0f}s", round(loss.item(), 3), flush=True)
m.eval(); rng = random.Random("x"); ok = 0
with torch.no_grad():
    for _ in range(200):
        p, c = problem(rng, "held_out"); pr, rs = texts(p, c, 1); ids = list(pr)
        for _ in range(40):
            nxt = int(m(torch.tensor([ids]))[0, -1].argmax()); ids.append(nxt)
            if nxt == tok.eos_id: break
        ok += T.check(tok, p, ids[len(pr):]).correct
print(fmt, strides, "greedy accuracy", ok / 200, f"{time.time()-t0:.0f}s")
if fmt != "A": print("example", tok.decode(texts(p, c, 1)[1]), "|", tok.decode(texts(p, c, 2)[1]))
