"""The words a run's log and an experiment's results use for what they record, in one place a report can read
without loading torch: the two phases of a step and the arm every other is compared with."""

WARMUP, POLICY = "critic-warmup", "policy"  # a step's phase: critic only, then policy and critic
BASELINE = "none"  # the correction rule every other arm of an experiment is compared with
