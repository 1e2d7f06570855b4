"""Training (docs/system.md §5 and §6): data and tokenizer (`data`), optimizers (`optim`), schedule,
aux-loss-free balancing (`balance`), QAT and the training cache (`qat`), the stages behind one interface (`stage`:
`pretrain`, the DSpark drafter stage `dspark_stage`), the run's settings (`config`), parallelism (`parallel`), the
trainer's loop (`trainer`), checkpoints, the end-of-run report (`report`) and the `dsv41 train` command (`cli`)."""
