"""Quality yardsticks, after the members and their evaluation in the data flow: task families an agent was never
tuned on (``agent_tasks``), markets with a known conditional mean and their oracles, and the train-then-score runs
of each member through the coordinator (``agents`` for the DQN, ``ppo_runs``, ``forecasters`` for the TFT and
Mamba-2) that the learning tests, ``scripts/*_quality.py`` and ``scripts/agent_generalisation.py`` share. Nothing in
training, evaluation or export imports this package."""
