"""The planner: what a run records of its workload, and what `rllm-async plan` and
`rllm-async simulate` make of it on the sim backend's virtual clock.

- `record`: the workload a training run records (`workload.jsonl`); the trainer imports it.
- `fit`: a sim workload fitted to a record (`FittedWorkload`, `fit_workload`).
- `replay`: `rllm-async plan`, replaying candidate settings on a fitted workload and choosing one.
- `simulate`: `rllm-async simulate`, and the sim runs through the real trainer that the replay uses.

This file imports nothing, so that the trainer takes `record` without the rest of the planner,
which lies above the trainer (docs/architecture.md, "Layers").
"""
