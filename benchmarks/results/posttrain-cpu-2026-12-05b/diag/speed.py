import time, random, torch, sys
torch.set_num_threads(1)
from dsv41.posttrain import tasks as T, sft as S
from dsv41.posttrain.model import build_model
from dsv41.posttrain.tokenizer import load_post_tokenizer
from dsv41.model.common import set_quantization
tok = load_post_tokenizer("runs/diag"); mix = S.TaskMix()
model = build_model(tok, 0); model.train(); set_quantization(model, False)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for B in (8, 32):
    ids, tg = S.sft_batch(0, 0, tok, mix, B)
    for i in range(6):
        if i == 1: t = time.time()
        loss = S.sft_loss(model, ids, tg); opt.zero_grad(); loss.backward(); opt.step()
    print(B, ids.shape, (time.time() - t) / 5)
import cProfile, pstats
ids, tg = S.sft_batch(0, 0, tok, mix, 32)
pr = cProfile.Profile(); pr.enable()
for i in range(3):
    loss = S.sft_loss(model, ids, tg); opt.zero_grad(); loss.backward(); opt.step()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
