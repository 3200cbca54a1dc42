"""Held-out evaluation beside the run: `greedy` (the worklog's greedy table on math problems) and `sets`
(named sets, k samples a prompt, scored by the run's reward set: mean reward, avg@k, unbiased pass@j). A
role-level room: it may import the rollout client, rewards, data and the shared types; the run layer and
`miles-lite eval` import it.
"""
