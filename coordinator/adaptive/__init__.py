"""Adaptive K (docs/design.md#adaptive-k): what the drafts accept
(``acceptance``), what rounds cost (``step_costs``), the plan that chooses
every session's K for the deployment's goodput (``planner``), each target
replica's costs and sessions (``cost_model``), and one session's K
(``session``)."""
