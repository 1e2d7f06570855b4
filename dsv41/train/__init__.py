"""Training (issue 7; SYSTEM.md 5 and 6): data and tokenizer (`data`), optimizers (`optim`), schedule,
aux-loss-free balancing (`balance`), QAT (`qat`), the trainer, checkpoints, the DSpark drafter stage and the
`dsv41 train` command (`cli`)."""
