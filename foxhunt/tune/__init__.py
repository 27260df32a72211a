"""`python -m foxhunt.tune --config lightning_configs/tune.yaml`: Optuna studies over ``foxhunt.fit`` configs.

A tune config (YAML) names a base fit config, a search space over any dotted fit key (``model.members.tft.hidden_size``,
``data.lookback``, ``trainer.max_epochs``...), the objective(s), the sampler and the pruner. Each trial writes the
fit config it runs (base + ``fixed`` + its parameters) to ``<runs_dir>/<study>/trial_<n>/fit_config.yaml``, trains it
through :func:`foxhunt.fit.build_cli` with TensorBoard logging into the same folder, and reports the objective.

Storage is an Optuna RDB (SQLite under ``runs/`` by default, any SQLAlchemy URL otherwise), so a study survives a
crash, the same command resumes it, and several processes on one storage and study name share it. ``n_trials`` is
the study's total, shared by all workers: a worker starts a trial only while finished-and-counted plus running
trials stay below it (``MaxTrialsCallback`` checks only after a trial ends, so two workers overshoot; here a worker
that loses the race for the last slot records a zero-cost "surplus" trial that does not count). Each trial's sampler
randomness is seeded from (seed, trial number), so seeded studies are reproducible and parallel workers do not
propose the same parameters.

Failures: a non-finite loss or gradient (the guard's NonFiniteError) or a NaN objective prunes the trial (a bad
region the sampler should learn to avoid); an out-of-memory error or any other exception fails it; in every case the
reason is a user attribute (``fail_kind``/``fail_reason`` or ``pruned_reason``) and the study continues. Ctrl-C and
SIGTERM mark the running trial failed with ``fail_kind=interrupted`` and the signal named in ``fail_reason`` (it does
not count, so the next run replaces it), leave the storage consistent and exit 130 or 143; a worker killed outright
(SIGKILL, a lost machine) is found by Optuna's heartbeat, failed as stale and its parameters retried once by the next
worker (``RetryStaleTrial``: the retry records ``retry_of`` and ``retry_reason``). A config mistake is one ``error:``
line and exit status 2 (:mod:`foxhunt.cli_errors`).

Modules: ``space`` (the tune config, its search space and the fit configs of dotted keys), ``study`` (storage,
sampler, pruner, study creation, the trial budget), ``objective`` (a trial's fit, pruning, metric reduction, and
``run_study``), ``report`` (best configs, importances, plots, the summary), ``cli`` (the command line that ``python -m foxhunt.tune`` runs).
"""

from __future__ import annotations

from foxhunt.tune.cli import main
from foxhunt.tune.objective import FitObjective, MetricMissingError, StudyRun, Terminated, TrialError, run_study
from foxhunt.tune.report import format_summary, summarize
from foxhunt.tune.space import (
    FitConfigParser,
    Objective,
    SearchParam,
    TuneConfig,
    TuneConfigError,
    compose_fit_config,
    decoded_params,
    load_tune_config,
    set_dotted,
    write_fit_config,
)
from foxhunt.tune.study import (
    COUNTED_FAIL_KINDS,
    HEARTBEAT_GRACE_S,
    HEARTBEAT_INTERVAL_S,
    SQLITE_TIMEOUT_S,
    RetryStaleTrial,
    TrialSeededSampler,
    counts_toward_budget,
    default_storage_url,
    make_pruner,
    open_storage,
    open_study,
)

__all__ = [
    "COUNTED_FAIL_KINDS",
    "HEARTBEAT_GRACE_S",
    "HEARTBEAT_INTERVAL_S",
    "SQLITE_TIMEOUT_S",
    "FitConfigParser",
    "FitObjective",
    "MetricMissingError",
    "RetryStaleTrial",
    "Objective",
    "SearchParam",
    "StudyRun",
    "Terminated",
    "TrialError",
    "TrialSeededSampler",
    "TuneConfig",
    "TuneConfigError",
    "compose_fit_config",
    "counts_toward_budget",
    "decoded_params",
    "default_storage_url",
    "format_summary",
    "load_tune_config",
    "main",
    "make_pruner",
    "open_storage",
    "open_study",
    "run_study",
    "set_dotted",
    "summarize",
    "write_fit_config",
]
