"""What a position series earns and the policies every member is measured against, below both the agents'
environment (:mod:`foxhunt.rl`) and the back-test (:mod:`foxhunt.evaluation`) in the data flow, so neither imports
the other: ``pnl`` the exact per-bar log return after costs, ``policy_table`` the loop-free rollout of a policy
given as a table, ``oracle`` the cost-aware oracle policies of a known conditional mean."""
