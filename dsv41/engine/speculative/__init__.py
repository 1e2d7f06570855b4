"""Speculative decoding with the DSpark drafter (docs/system.md §5, docs/model.md §7): propose, schedule, verify,
roll back.

One engine step for the running rows r, each holding its pending token t_r at position P_r (the target has consumed
P_r tokens; the drafter's rings hold the target's taps of positions < P_r):

  1. propose   the drafter reads t_r and its rings and proposes G = dspark_block_size drafts d_r,1..G for
               positions P_r+1.., each sampled from a known distribution q_r,k: the request's own sampling
               transform (temperature, top-k, top-p; `target_probs`) of the drafter's logits, the argmax for
               greedy requests. Its confidence head gives a_r,k = sigmoid(confidence), the predicted acceptance
               of draft k given drafts < k accepted.
  2. schedule  the number v_r of drafts each row verifies: fixed (`fixed:N`) or the confidence scheduler (`dspark`).
  3. verify    ONE ragged target forward over [t_r, d_r,1..v_r] per row (a chunk of 1 + v_r tokens at P_r) gives
               the target's logits at positions P_r..P_r+v_r, i.e. its distributions p_r,0..v_r for the tokens
               after each.
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

Rows verify their own lengths in one forward (`ForwardOptions.lengths`, `dsv41.model.step.Ragged`): the stack
runs on the n = sum_r (1 + v_r) real tokens packed row after row; only what reads or writes a row's store is laid
out [B, 1 + max v_r], its padding causally after the row's tokens and rolled back by the journal. A row whose
remaining `max_tokens` allows fewer drafts verifies fewer.

Confidence scheduler (docs/system.md §5). Prefix survival S_r,k = prod_{i<=k} a_r,i; verifying v_r drafts yields
1 + sum_{k<=v_r} S_r,k tokens in expectation; choose {v_r} maximising sum_r (1 + sum_{k<=v_r} S_r,k) / T(n) with T
the measured step latency at n tokens in the batch (`StepProfile`, written by `dsv41 profile-step`).
`choose_verify_lengths(..., ragged=True)` is that objective with n = sum_r (1 + v_r): for a fixed budget the
optimum takes drafts in decreasing S order across rows (S is non-increasing in k, so each row takes a prefix),
then the budget with the best ratio wins; the engine's ragged forward runs exactly those n tokens. The engine
prices a ragged step by its longest row too (`by_longest=True`: T(n, vmax), every vmax tried with the rows capped
at it): its token-wise work runs on the n tokens, but what reads and writes each row's store is laid out [B, 1 +
vmax], and on the CPU that part is most of a token's price (issue 28: a step with one row verifying 4 drafts and
seven none cost 195 ms at batch 8, every row verifying 4 224 ms, what 12 tokens cost uniformly 159 ms), so a
scheduler priced by n alone verified long for a few rows and paid for every row. `ragged=False` is the same
objective for a padded forward (n = B (1 + V), every row the same V).

The acceptance inputs: the confidence head's a_r,k, used raw by `dspark`; `dspark:online` calibrates them per
draft position and confidence bin on the drafts the engine verified (`AcceptanceCalibration`) and corrects T with
the engine's own step times (`MeasuredCost`).

A closed batch (no request waiting for a finished row's place, every row's end known: ignore_eos, no stops) ends
with its slowest row, so there the scheduler prices policies by the batch's end (`closed_batch_times`: plain
decoding and each uniform length, each row at its own measured acceptance, plus the latest row's spread) and picks
a step's lengths by what they take off it (`closed_batch_lengths`); once enough drafts were verified and no length
ends the batch sooner than plain decoding, its rows stop drafting and seeding for good (issue 28: at batch 32 the
per-step objective verified, the low-acceptance rows straggled and the batch ended after off's).

V = 0 is not a verify of 0 drafts but a plain decode step (no proposal): `choose_verify_lengths(..., plain=T_plain)`
compares every verify length with B / T_plain(B), and before drafting the engine asks whether any length could win
(at acceptance 1, then at the measured acceptance); when none can it decodes plainly, skipping the drafter's cost
(`Engine._drafting_pays`). T comes from `StepProfile.spec(B, n)` / `plain(B)`: per-batch curves of whole engine
steps (the drafter, each row's accept and emit work included) measured warm, median of repeats, non-decreasing
(a line per batch on a CPU; `profile.py`), plus, at B > 1, a ragged step that gives the price of a padded slot
(`padded_share`).

    policy.py     the `--speculative` flag (`Speculation`) and what `auto` resolves to for a checkpoint
    drafter.py    the DSpark drafter: propose (1) and seed (6)
    scheduler.py  the confidence scheduler (2) and its online corrections
    rejection.py  speculative rejection sampling (4)
    rollback.py   the verify journal (5)
    profile.py    T(n): the step latency profile the scheduler reads (`dsv41 profile-step`)
"""
