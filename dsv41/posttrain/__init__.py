"""Post-training (docs/system.md §7): verifiable tasks with exact checkers, SFT, RL with controllable reasoning
effort, the asynchronous sample-level dispatcher, on-policy distillation, and the `dsv41 posttrain` command."""
