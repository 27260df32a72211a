"""Quality yardsticks: markets whose conditional mean or quantiles are known, the oracles that use them, and scores of
any member's positions or forecasts against those oracles on bars it never saw. foxhunt's learning tests and the
scripts (``scripts/README.md``) measure its members with them; a user can measure their own members the same way.
They sit after everything they measure: nothing else in the package imports them.

- :mod:`~foxhunt.quality.agent_tasks`: the agents' task family. ``task_market(phi, seed)`` is AR(1) returns with
  GARCH(1,1) volatility at strength ``phi``; ``real_market(csv)`` a real close series without an oracle. Both come cut
  chronologically into train | val | test ``MarketSplit``s with three causal features, as a ``SyntheticMarket``
  (``.train``, ``.val``, ``.test``, ``.expected[split]``: the known mean of every bar). ``add_task_family_arguments``
  and ``task_family`` are the task-family scripts' command line; ``record_row``, ``read_rows`` and ``score_cell``
  their JSON-lines results and table cells.
- :mod:`~foxhunt.quality.agents`: ``task_scores(positions, data)`` scores any policy's test positions as a fraction
  of the best causal oracle's reward per bar after costs (with its log return, turnover and buy-and-hold's);
  ``baseline_metrics`` and ``best_causal_oracle`` give the oracles, flat, random and buy-and-hold on the same bars and
  costs; ``ar1_market`` and ``generator_market`` are the DQN's markets; ``train_dqn``, ``run_quality`` and
  ``train_on_task`` train and score foxhunt's DQN through the coordinator.
- :mod:`~foxhunt.quality.ppo_runs`: ``train_ppo`` and ``updates_for_env_steps``, PPO's train-then-score runs.
- :mod:`~foxhunt.quality.forecasters`: the forecasters' synthetic market with its exact conditional quantiles
  (``build_quality_data`` -> ``QualityData``, ``windows`` its batches); ``evaluate(module, data)`` scores any
  forecaster member against the oracle (quantile loss and interval coverage on the same rows, and the share of the gap
  between a no-skill forecast and the oracle that it closes); ``make_module`` and ``train`` fit foxhunt's TFT on it.
- :mod:`~foxhunt.quality.gym_env`: ``make_gym_env`` and ``make_sb3_env``, the agents' task as a gymnasium environment
  with the same observations and rewards, so a gym learner (Stable-Baselines3's) is measured on exactly foxhunt's task.
- :mod:`~foxhunt.quality.talib_reference`: the features' yardstick, TA-Lib's calls equivalent to the registry's
  TA-Lib-derived features (``talib_calls``) and the synthetic bars they are compared on (``make_bars``).
- :mod:`~foxhunt.quality.promotion_streams`: the promotion rule's yardstick, paired champion/challenger returns with
  a known edge (``paired_streams``: a GARCH factor, t innovations, AR(1) noise) and ``promotion_rate``, the share of
  streams a ``PromotionRule`` promotes (its false-promotion rate under no edge, its power with one).

An agent of your own, scored on unseen bars::

    from foxhunt.quality.agent_tasks import task_market
    from foxhunt.quality.agents import task_scores

    data = task_market(phi=0.1, seed=0)               # fit on data.train, choose on data.val
    positions = my_policy(data.test)                  # [T] positions in [-1, 1], decided at bar t, held to t+1
    task_scores(positions, data)["fraction_of_oracle"]  # 1.0: the best causal oracle's reward per bar

A forecaster of your own (a ``foxhunt.lit.member.Forecaster``), against the exact quantiles::

    from foxhunt.quality.forecasters import build_quality_data, evaluate, windows

    data = build_quality_data(200_000, lookback=32, horizon=6)   # fit on windows(data, "train", 128)
    evaluate(my_forecaster, data)["loss_ratio"]       # 1.0: the oracle's quantile loss
"""
