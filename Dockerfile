# syntax=docker/dockerfile:1
# The cuinterpose agent image the Helm chart runs (charts/cuinterpose, values.yaml `image`).
# Build and push: docs/kubernetes.md, "Building the image". Everything is installed by the
# project's own scripts at build time; the image needs no network at runtime.
#
#   /opt/venv   Python virtual environment with `pip install .`: cuinterpose-agent on PATH,
#               the shim (libcuinterpose.so) and fakecuda (fakecuda/libcuda.so.1) in
#               /opt/venv/lib/python3.11/site-packages/cuinterpose/lib, the directory
#               `cuinterpose-agent shim-path` names and the chart's init container
#               (install-shim) copies onto the node. Deliberately not under /opt/cuinterpose:
#               the chart mounts the node's shim directory (shim.hostPath) there.
#   /opt/criu   CRIU 4.x from scripts/install-criu.sh ($CUINTERPOSE_CRIU_CACHE)
FROM debian:bookworm

ENV DEBIAN_FRONTEND=noninteractive \
    CUINTERPOSE_CRIU_CACHE=/opt/criu \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src

# compilers, cmake, ninja, python3 + venv, iproute2 (what `make build` needs on Debian); the
# CRIU installer the package ships (scripts/install-criu.sh runs it)
COPY scripts/ scripts/
COPY agent/mech/criu_install.sh agent/mech/criu_install.sh
RUN bash scripts/bootstrap-debian.sh && rm -rf /var/lib/apt/lists/*

# CRIU 4.x and its libraries from Debian trixie, unpacked into /opt/criu. `criu check` needs
# privileges (CAP_SYS_ADMIN, ptrace) that `docker build` does not grant, so the installer's
# final check may fail here: the wrapper must at least run and report 4.x. The agent's
# `doctor` runs the real check in the privileged pod.
RUN bash scripts/install-criu.sh \
 || /opt/criu/bin/criu --version | grep -Eq '^Version: ([4-9]|[1-9][0-9])\.'

# the package: C libraries (shim, fakecuda) built by scikit-build-core, protobuf stubs
COPY pyproject.toml CMakeLists.txt README.md ./
COPY compat/ compat/
COPY interposer/ interposer/
COPY fakecuda/ fakecuda/
COPY proto/ proto/
COPY agent/ agent/
COPY coordinator/ coordinator/
COPY workloads/ workloads/
RUN python3 -m venv /opt/venv \
 && pip install --no-cache-dir . \
 && cuinterpose-agent shim-path \
 && test -f "$(dirname "$(cuinterpose-agent shim-path)")/fakecuda/libcuda.so.1" \
 && cd / && rm -rf /src

WORKDIR /
# the DaemonSet runs `command: ["cuinterpose-agent"]` with values.yaml `args`; the same here
ENTRYPOINT ["cuinterpose-agent"]
CMD ["serve", "--config", "/etc/cuinterpose/config.yaml"]
