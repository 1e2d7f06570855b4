"""The experiments docs/system.md §9 asks for, runnable (`dsv41 experiments run NAME`), each writing a report
(markdown table, JSON, PNG) under runs/experiments/NAME/: counterparts.py (every approximation and its exact
counterpart as switches of one teacher-forced run), approximations.py (each alone and all stacked), replay.py
(error against distance from the recovery point), report.py (the files), cli.py. The task models they run on are
trained with `dsv41 train --data` on `dsv41.train.tasks_longctx` documents."""
