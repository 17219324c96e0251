"""What the benchmarks share: one harness and its results header (harness), the servers they start (servers), the
arm registry (arms), the workloads and the one answer comparison (workloads, answers), the decision grid's arms
(grid), the models they build (checkpoints), a cold request's timing (cold), the field harnesses' driver
(fieldharness), the report's core and its one table helper (report) and the grid's plot (plot)."""
