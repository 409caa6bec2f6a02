# lossguard-monitor: torch-free (the monitor never imports torch).
#   docker build -f deploy/monitor.Dockerfile -t lossguard-monitor .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# one uid for the monitor and the agent image: the control socket is mode 0600 and is shared
# through the runs volume
RUN groupadd --gid 10001 lossguard \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin lossguard \
    && mkdir -p /runs /var/lib/lossguard/state /var/lib/lossguard/targets \
    && chown -R lossguard:lossguard /runs /var/lib/lossguard

WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY agent ./agent
COPY ctl ./ctl
COPY monitor ./monitor
COPY supervisor ./supervisor
# the base distribution only: no [agent] extra, so no torch
RUN pip install . && rm -rf /src

COPY --chown=lossguard:lossguard alerts /etc/lossguard/alerts
COPY --chown=lossguard:lossguard deploy/monitor.yml /etc/lossguard/deploy/monitor.yml

USER lossguard
WORKDIR /var/lib/lossguard
EXPOSE 9409
ENTRYPOINT ["lossguard-monitor"]
CMD ["run", "--config", "/etc/lossguard/deploy/monitor.yml"]
