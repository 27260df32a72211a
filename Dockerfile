# GPU image: CUDA PyTorch base, foxhunt with its extras, a non-root user, runs/ as a volume.
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime

WORKDIR /opt/foxhunt
COPY pyproject.toml README.md ./
COPY foxhunt ./foxhunt
COPY lightning_configs ./lightning_configs
RUN python -m pip install --no-cache-dir -e '.[dev]' \
 && useradd --create-home --uid 1000 foxhunt \
 && mkdir -p /opt/foxhunt/runs && chown -R foxhunt /opt/foxhunt
USER foxhunt
VOLUME ["/opt/foxhunt/runs"]
ENTRYPOINT ["python", "-m", "foxhunt.fit"]
