# foxhunt for GPU machines: a CUDA PyTorch base, foxhunt with its extras, a non-root user, runs/ as a volume.
#
#   docker build -t foxhunt .
#   docker run --gpus all -v "$PWD/runs:/opt/foxhunt/runs" foxhunt --config lightning_configs/ensemble.yaml
#
# The entrypoint is `python -m foxhunt.fit`, so the arguments after the image name are foxhunt.fit's. Other entry
# points (tuning against PostgreSQL, back-tests, tests) go through `--entrypoint python`; see docs/GUIDE.md.
# The base image's CUDA build of PyTorch satisfies foxhunt's `torch>=2.4` and is kept as it is.
ARG BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MPLBACKEND=Agg

WORKDIR /opt/foxhunt

# The package with its test extras (so the suite can run inside the image on a GPU) and a PostgreSQL driver for
# Optuna storages shared by several tuning workers.
COPY pyproject.toml README.md ./
COPY foxhunt ./foxhunt
RUN python -m pip install -e '.[dev]' psycopg2-binary

# Configs, tests, benchmarks, notebooks and docs: what the commands of docs/GUIDE.md name, relative to /opt/foxhunt.
COPY lightning_configs ./lightning_configs
COPY tests ./tests
COPY scripts ./scripts
COPY notebooks ./notebooks
COPY docs ./docs

# A non-root user owns the working tree (feature cache .cache/, runs/); runs/ is a volume so that logs, checkpoints,
# exports and the default SQLite Optuna storage outlive the container.
RUN useradd --create-home --uid 1000 foxhunt \
 && mkdir -p /opt/foxhunt/runs /opt/foxhunt/.cache \
 && chown -R foxhunt:foxhunt /opt/foxhunt
USER foxhunt
VOLUME ["/opt/foxhunt/runs"]

ENTRYPOINT ["python", "-m", "foxhunt.fit"]
CMD ["--config", "lightning_configs/ensemble.yaml"]
