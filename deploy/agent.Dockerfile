# lossguard-agent with PyTorch. CPU torch by default; a CUDA build by build argument:
#   docker build -f deploy/agent.Dockerfile -t lossguard-agent .
#   docker build -f deploy/agent.Dockerfile --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 -t lossguard-agent:cu124 .
# (the CUDA wheels bring their own CUDA runtime; the host needs the NVIDIA driver and the
# NVIDIA Container Toolkit, and the container `--gpus all`)
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --gid 10001 lossguard \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin lossguard \
    && mkdir -p /runs \
    && chown lossguard:lossguard /runs

# torch first, from the chosen index, so that `pip install .[agent]` finds it satisfied
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY agent ./agent
COPY ctl ./ctl
COPY monitor ./monitor
COPY supervisor ./supervisor
RUN pip install ".[agent]" && rm -rf /src

COPY --chown=lossguard:lossguard configs /etc/lossguard/configs
COPY --chown=lossguard:lossguard deploy/demo-agent.yaml /etc/lossguard/deploy/demo-agent.yaml

USER lossguard
WORKDIR /home/lossguard
EXPOSE 9410
ENTRYPOINT ["lossguard-agent"]
CMD ["run", "/etc/lossguard/deploy/demo-agent.yaml", "--no-progress"]
